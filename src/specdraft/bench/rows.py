"""One bench row in the making: all prompts x repeats of one method in one setting
(dataset, temperature, batch size), measured batch by batch (``RowMeasure``), and the
figures derived from its raw numbers. The runner decides the order of the batches: a row
at a time, or (``--interleave``) the batches of every method in turn, or (``--lockstep``)
their decode steps in turn."""

from __future__ import annotations

from ..sampling import SamplingParams
from . import metrics
from .datasets import dataset_label
from .methods import Method


class RowMeasure:
    """The raw numbers of one row as its batches are measured.

    ``batch(start)`` runs prompts[start:start + batch_size] once; ``end_repeat()`` closes a
    pass over all batches (tokens/s is the median over passes); ``finish()`` the row."""

    def __init__(self, method: Method, spec: str, items, prompts, temperature: float, batch_size: int, cfg):
        self.method, self.prompts, self.batch_size, self.cfg = method, prompts, batch_size, cfg
        self.row = {"drafter": method.spec, "kind": method.kind, "dataset": dataset_label(spec),
                    "temperature": float(temperature), "batch_size": int(batch_size), **method.info,
                    "prompts": len(prompts), "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens,
                    "mt_bench_turn": 2 if any(it.follow_up for it in items) else 1}
        self.reason = method.unsupported(batch_size) or (
            "transformers' generate() has no ignore_eos" if cfg.ignore_eos and method.kind == "peer" else None)
        self.params = [SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=temperature, top_p=cfg.top_p,
                                      top_k=cfg.top_k, seed=cfg.seed + i, ignore_eos=cfg.ignore_eos).validate()
                       for i in range(len(prompts))]
        self.per_prompt = [{"id": it.id, "prompt_tokens": len(p), "new_tokens": [], "steps": [], "seconds": [],
                            "finish_reason": None, "accepted_hist": {}, "token_ids": None}
                           for it, p in zip(items, prompts)]
        self.starts = list(range(0, len(prompts), batch_size))
        self.tokens, self.seconds, self.stages = [], [], None
        self._tok, self._sec = 0, 0.0
        if hasattr(method, "reset_drafting"):
            method.reset_drafting()

    def batch(self, start: int) -> None:
        """Run batch ``start`` whole and record it."""
        end = start + self.batch_size
        self.record(start, self.method.generate(self.prompts[start:end], self.params[start:end]))

    def begin(self, start: int):
        """Batch ``start`` prefilled, to be decoded a step at a time (``methods.Stepping``,
        then ``record``); None for a method that cannot step (transformers' peers)."""
        if not hasattr(self.method, "begin"):
            return None
        end = start + self.batch_size
        return self.method.begin(self.prompts[start:end], self.params[start:end])

    def record(self, start: int, out) -> None:
        """Add batch ``start``'s outcome to the current repeat."""
        end = start + self.batch_size
        self._sec += out.seconds
        self._tok += record_batch(self.per_prompt[start:end], out.prompts)
        if out.stages is not None:
            self.stages = metrics.add_stages(self.stages or {}, out.stages)

    def end_repeat(self) -> None:
        self.tokens.append(self._tok)
        self.seconds.append(self._sec)
        self._tok, self._sec = 0, 0.0

    def finish(self, memory: dict, target) -> dict:
        if self.reason:
            return {**self.row, "status": "unsupported", "reason": self.reason, **empty_figures()}
        row = dict(self.row)
        if hasattr(self.method, "drafting"):
            row["drafting"] = self.method.drafting()
        return {**row, "status": "ok", **memory,
                **figures(self.per_prompt, self.tokens, self.seconds, self.stages, self.cfg.repeats, self.method.info,
                          target),
                "per_prompt": self.per_prompt}


def record_batch(rows: list[dict], outcomes) -> int:
    """Append one repeat's per-request numbers; return the batch's new tokens."""
    for row, o in zip(rows, outcomes):
        row["new_tokens"].append(len(o.token_ids))
        row["steps"].append(o.steps)
        row["seconds"].append(o.seconds)
        row["finish_reason"] = o.finish_reason
        if row["token_ids"] is None:
            row["token_ids"] = list(o.token_ids)
        if o.hist is not None:
            row["accepted_hist"] = {str(k): v for k, v in
                                    sorted(metrics.merge_hists([row["accepted_hist"], o.hist]).items())}
    return sum(len(o.token_ids) for o in outcomes)


def figures(per_prompt: list[dict], tokens: list[int], seconds: list[float], stages, repeats: int,
            info: dict, target) -> dict:
    """The row's derived numbers from its raw per-prompt measurements."""
    total_tokens = sum(sum(p["new_tokens"]) for p in per_prompt)
    step_lists = [s for p in per_prompt for s in p["steps"]]
    total_steps = sum(step_lists) if step_lists and None not in step_lists else 0
    tau = metrics.block_efficiency(total_tokens, total_steps)
    hists = [p["accepted_hist"] for p in per_prompt if p["accepted_hist"]]
    hist = metrics.merge_hists(hists) if hists else {}
    depth = metrics.acceptance_by_depth(hist, len(per_prompt) * repeats) if hist else {}
    n_target = info.get("target_params")
    mean_stages = {k: v / repeats for k, v in stages.items()} if stages else None
    return {**metrics.rate_summary(tokens, seconds), "seconds_repeats": seconds, "new_tokens_repeats": tokens,
            "new_tokens": total_tokens, "target_forwards": total_steps or None,
            "tokens_per_step": tau, "block_efficiency": tau,
            "tau_source": None if tau is None else ("engine" if hists else "forward-hook"),
            "accepted_hist": {str(k): v for k, v in hist.items()},
            "acceptance_by_depth": {str(k): v for k, v in depth.items()},
            "mbsu": metrics.mbsu(tau, info.get("gamma"), info.get("draft_params"), n_target) if n_target else None,
            "stage_seconds": mean_stages,
            "stage_fractions": metrics.stage_fractions(mean_stages) if mean_stages else None}


def empty_figures() -> dict:
    """The figure fields of a row that could not be measured, all empty."""
    return {"tokens_per_second": None, "tokens_per_second_min": None, "tokens_per_second_max": None,
            "tokens_per_step": None, "block_efficiency": None, "speedup_vs_ar": None, "speedup_vs_hf_ar": None,
            "mbsu": None, "stage_seconds": None, "per_prompt": []}
