"""``specdraft bench``: measure every requested method on the same prompts, in one process.

Loop order: method -> dataset -> temperature -> batch size, with our plain decoding
(``none``) always measured first and ``hf-ar`` next, so that every later row has both
references. A row is all prompts x all repeats of one method in one setting;
results.json is rewritten (atomically) as soon as a row finishes, and ``--resume``
skips rows that are already there.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SpecdraftError
from ..sampling import SamplingParams
from . import metrics
from .datasets import BenchPrompt, dataset_label, encode_first_turns, load_prompts, second_turn_ids
from .methods import Method
from .specs import build_method, split_shape
from .store import RESULTS, load_for_resume, row_key, write_json_atomic

AR, HF_AR = "none", "hf-ar"


ADAPTIVE_CHOICES = ("on", "off", "refresh")


@dataclass
class BenchConfig:
    """Everything a benchmark run is parameterised by (the CLI's options)."""

    out: Path
    drafters: list[str] = field(default_factory=lambda: ["none", "lookup"])
    datasets: list[str] = field(default_factory=lambda: ["mt-bench"])
    target: str = "default"
    device: str = "cpu"
    dtype: str | None = None  # None or "auto": models.resolve_dtype's choice for the device
    trust_remote_code: bool = False
    limit: int | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    top_k: int = 0
    repeats: int = 1
    max_new_tokens: int = 128
    beam_width: int | None = None
    beam_length: int | None = None
    gamma: int | None = None
    seed: int = 0
    chat: bool = True
    mt_bench_turns: int = 1
    resume: bool = False
    warmup: bool = True
    progress: bool = True
    command: str = ""
    adaptive: str = "on"  # on | off (fixed shapes) | refresh (re-measure the cost model first)

    def resolved_dtype(self) -> str:
        from ..models import resolve_dtype

        return resolve_dtype(self.dtype or "auto", self.device)

    def settings(self) -> dict:
        """What every row of one results.json shares; --resume refuses a mismatch."""
        keys = ("target", "device", "limit", "top_p", "top_k", "repeats", "max_new_tokens", "beam_width",
                "beam_length", "gamma", "seed", "chat", "mt_bench_turns", "adaptive")
        s = {k: getattr(self, k) for k in keys}
        s["dtype"] = self.resolved_dtype()
        return json.loads(json.dumps(s))

    def method_order(self) -> list[str]:
        """none first (always measured: every speed-up needs it), hf-ar next, then the rest."""
        asked = list(dict.fromkeys(self.drafters))
        head = [AR] + ([HF_AR] if HF_AR in asked else [])
        return head + [d for d in asked if d not in head]

    def validate(self) -> None:
        from .specs import check_spec

        for name, values in (("--drafters", self.drafters), ("--dataset", self.datasets),
                             ("--batch-sizes", self.batch_sizes), ("--temperatures", self.temperatures)):
            if not values:
                raise SpecdraftError(f"{name} is empty")
        for spec in self.drafters:
            check_spec(spec)
        if self.repeats < 1:
            raise SpecdraftError(f"--repeats must be >= 1, got {self.repeats}")
        if self.adaptive not in ADAPTIVE_CHOICES:
            raise SpecdraftError(f"--adaptive must be one of {', '.join(ADAPTIVE_CHOICES)}, got {self.adaptive!r}")
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"--limit must be >= 1, got {self.limit}")
        if any(b < 1 for b in self.batch_sizes):
            raise SpecdraftError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        for t in self.temperatures:
            SamplingParams(max_new_tokens=self.max_new_tokens, temperature=t, top_p=self.top_p,
                           top_k=self.top_k).validate()


def environment(target, cfg: BenchConfig) -> dict:
    """Where and with what the numbers were measured."""
    import transformers

    from .. import __version__
    from ..models import parameter_count

    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return {"specdraft": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": str(dev),
            "device_name": name, "threads": torch.get_num_threads(),
            "dtype": str(target.dtype).removeprefix("torch."),
            "target": target.name, "target_params": parameter_count(target.model)}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Bench:
    """One benchmark run: the loaded target, its methods, and the results so far."""

    def __init__(self, cfg: BenchConfig, target=None):
        from ..models import load_target, quiet_loading

        cfg.validate()
        self.cfg = cfg
        if target is None:
            with quiet_loading():
                target = load_target(cfg.target, cfg.device, cfg.resolved_dtype(), cfg.trust_remote_code)
        target.check_new_tokens(cfg.max_new_tokens)
        self.target = target
        self.datasets: dict[str, tuple] = {}  # spec -> (prompts, first-turn ids)
        self.turn2: dict[tuple, list[int]] = {}  # (method, dataset, prompt index) -> turn-2 prompt ids
        self.memory = metrics.PeakMemory(self.target.device)
        previous = load_for_resume(cfg.out, cfg.settings()) if cfg.resume else None
        self.results = previous or {"settings": cfg.settings(), "runs": []}
        self.results.update(environment=environment(self.target, cfg), command=cfg.command,
                            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        self.done = {row_key(r) for r in self.results["runs"]}
        self.cost = None  # the target's cost model, loaded at the first adaptive method

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        """Measure every missing row; results.json is current after each.

        Methods are the outer loop: each is loaded once, measured in every setting, and
        released before the next, so its peak memory holds only the target and itself."""
        cfg = self.cfg
        for name in cfg.method_order():
            todo = [(spec, float(t), int(b)) for spec in cfg.datasets for t in cfg.temperatures
                    for b in cfg.batch_sizes if (name, dataset_label(spec), float(t), int(b)) not in self.done]
            if not todo:
                continue
            method = self.build(name, self.prompts(todo[0][0])[1][0])
            for spec, temperature, batch_size in todo:
                items, first = self.prompts(spec)
                measurable = method.unsupported(batch_size) is None
                prompts = self.prompt_ids(method, spec, items, first) if measurable else first
                self.add(self.measure(method, spec, items, prompts, temperature, batch_size))
            del method
            self.release()
        return self.results

    def prompts(self, spec: str) -> tuple[list[BenchPrompt], list[list[int]]]:
        """A dataset's prompts and their first-turn token ids (loaded once)."""
        if spec not in self.datasets:
            items = load_prompts(spec, self.cfg.limit, self.cfg.chat, self.cfg.mt_bench_turns)
            self.datasets[spec] = (items, encode_first_turns(self.target, items, self.cfg.chat))
        return self.datasets[spec]

    def build(self, spec: str, warm_prompt: list[int]) -> Method:
        """The method named ``spec``, built and warmed up (untimed)."""
        from ..models import quiet_loading

        cfg = self.cfg
        base, shape = split_shape(spec)
        # @fixed / @adaptive override --adaptive; plain decoding has nothing to adapt.
        adaptive = shape.get("adaptive", cfg.adaptive != "off") and base != AR
        with quiet_loading():
            method = build_method(spec, self.target, cfg.beam_width, cfg.beam_length, cfg.gamma,
                                  self.policy() if adaptive else None)
        if cfg.warmup:  # first calls pay for allocations and kernel selection
            method.generate([warm_prompt], [SamplingParams(max_new_tokens=min(8, cfg.max_new_tokens))])
        return method

    def policy(self):
        """A fresh adaptive policy (the cost model measured or read once per run)."""
        from ..adaptive import AdaptivePolicy, load_cost_model

        if self.cost is None:
            self.cost = load_cost_model(self.target, refresh=self.cfg.adaptive == "refresh")
        return AdaptivePolicy(self.cost)

    def release(self) -> None:
        """Free what the last method held (its draft model, its turn-2 prompts)."""
        self.turn2.clear()
        gc.collect()
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()

    def prompt_ids(self, method: Method, spec: str, items: list[BenchPrompt], first: list[list[int]]):
        """The measured prompts: first turns, or (MT-Bench turn 2) the conversation with
        this method's own greedy answer to the first turn (generated once, untimed)."""
        if not any(it.follow_up for it in items):
            return first
        ids = []
        for i, (item, prompt) in enumerate(zip(items, first)):
            key = (method.spec, spec, i)
            if key not in self.turn2:
                answer = method.generate([prompt], [SamplingParams(max_new_tokens=self.cfg.max_new_tokens)])
                self.turn2[key] = second_turn_ids(self.target, item, answer.prompts[0].text)
            ids.append(self.turn2[key])
        return ids

    def add(self, row: dict) -> None:
        """Keep a finished row, refresh the speed-ups, and save."""
        self.results["runs"].append(row)
        self.done.add(row_key(row))
        derive_speedups(self.results["runs"])
        write_json_atomic(Path(self.cfg.out) / RESULTS, self.results)

    # ---- one row ----------------------------------------------------------------------------

    def measure(self, method: Method, spec: str, items, prompts, temperature: float, batch_size: int) -> dict:
        """All prompts x repeats of one method at one (temperature, batch size)."""
        cfg = self.cfg
        row = {"drafter": method.spec, "kind": method.kind, "dataset": dataset_label(spec),
               "temperature": float(temperature), "batch_size": int(batch_size), **method.info,
               "prompts": len(prompts), "repeats": cfg.repeats, "max_new_tokens": cfg.max_new_tokens,
               "mt_bench_turn": 2 if any(it.follow_up for it in items) else 1}
        reason = method.unsupported(batch_size)
        if reason:
            return {**row, "status": "unsupported", "reason": reason, **empty_figures()}
        params = [SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k, seed=cfg.seed + i).validate() for i in range(len(prompts))]
        per_prompt = [{"id": it.id, "prompt_tokens": len(p), "new_tokens": [], "steps": [], "seconds": [],
                       "finish_reason": None, "accepted_hist": {}, "token_ids": None}
                      for it, p in zip(items, prompts)]
        batches = range(0, len(prompts), batch_size)
        tokens, seconds, stages = [], [], None
        if hasattr(method, "reset_drafting"):
            method.reset_drafting()
        self.memory.reset()
        with progress_bar(len(batches) * cfg.repeats, f"{row['dataset']} T={temperature:g} B={batch_size} "
                                                      f"{method.spec}", cfg.progress) as bar:
            for _ in range(cfg.repeats):
                n_tok, n_sec = 0, 0.0
                for start in batches:
                    out = method.generate(prompts[start:start + batch_size], params[start:start + batch_size])
                    n_sec += out.seconds
                    n_tok += record_batch(per_prompt[start:start + batch_size], out.prompts)
                    if out.stages is not None:
                        stages = metrics.add_stages(stages or {}, out.stages)
                    bar.update(1)
                tokens.append(n_tok)
                seconds.append(n_sec)
        if hasattr(method, "drafting"):
            row["drafting"] = method.drafting()
        return {**row, "status": "ok", **self.memory.read(),
                **figures(per_prompt, tokens, seconds, stages, cfg.repeats, method.info, self.target),
                "per_prompt": per_prompt}


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


def derive_speedups(runs: list[dict]) -> None:
    """speedup_vs_ar / speedup_vs_hf_ar of every row: its median tokens/s over that of
    ``none`` / ``hf-ar`` in the same (dataset, temperature, batch size)."""
    settings: dict[tuple, dict[str, dict]] = {}
    for row in runs:
        settings.setdefault(row_key(row)[1:], {})[row["drafter"]] = row
    for rows in settings.values():
        ar, hf = rows.get(AR, {}), rows.get(HF_AR, {})
        for row in rows.values():
            rate = row.get("tokens_per_second")
            row["speedup_vs_ar"] = metrics.speedup(rate, ar.get("tokens_per_second"))
            row["speedup_vs_hf_ar"] = metrics.speedup(rate, hf.get("tokens_per_second"))


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr (a no-op when disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", disable=not enabled, file=sys.stderr, leave=True)


def run_bench(cfg: BenchConfig, target=None) -> dict:
    """Measure, then write report.md and the plots; a Ctrl-C still leaves a report of
    the rows that finished."""
    from .report import write_report

    bench = Bench(cfg, target)
    try:
        bench.run()
    finally:
        if bench.results["runs"]:
            write_report(bench.results, Path(cfg.out))
    return bench.results

