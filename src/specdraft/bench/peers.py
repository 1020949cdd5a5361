"""transformers' own decoding as benchmark peers, on the very same target model object.

- ``hf-ar``: ``model.generate()``, greedy or sampling at the same temperature / top-k /
  top-p (the same warper order as ours). Batches are left-padded.
- ``hf-assisted:PATH``: assisted generation with a draft model (``assistant_model=``),
  γ = ``--gamma`` (else the folder's config ``gamma``, else 4) drafted tokens per step,
  held constant (schedule "constant", confidence early-exit off) so that it drafts as
  our ``draft:PATH`` does. transformers runs it at batch 1 only.
- ``hf-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens`` = L - 1 with L =
  ``--beam-length`` or the length our ``lookup`` would use: a sweep's recorded shape, else
  its default; n-grams up to its ``max_ngram``). Batch 1 only. Both rows state their L.

τ of a peer: transformers reports no count of target forwards, so it is counted here
with a forward hook on the target module (each call is one target forward, prefill
included, the engine's definition). Only at batch 1: a padded batch keeps finished
rows in every forward, so a per-request count would not be comparable.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..drafters.lookup import DEFAULT_MAX_NGRAM, LookupDrafter
from ..errors import SpecdraftError, first_line
from ..sampling import SamplingParams
from ..timing import synchronize
from .methods import BatchOutcome, Method, PromptOutcome

class ForwardCounter:
    """Counts calls of a module's forward while active (a context manager)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls, self.handle = module, 0, None

    def _hook(self, *_):
        self.calls += 1

    def __enter__(self) -> "ForwardCounter":
        self.calls = 0
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


class HFPeer(Method):
    """``target.model.generate()`` with extra keyword arguments per peer."""

    def __init__(self, spec: str, target, extra: dict | None = None, batch1_only: bool = False,
                 info: dict | None = None):
        super().__init__(spec=spec, kind="peer", info=info or {})
        self.target, self.extra, self.batch1_only = target, extra or {}, batch1_only

    def unsupported(self, batch_size: int) -> str | None:
        if self.batch1_only and batch_size > 1:
            return "transformers runs assisted generation and prompt lookup at batch size 1 only"
        return None

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> BatchOutcome:
        model, device = self.target.model, self.target.device
        input_ids, attention = left_pad(prompts, self.pad_id, device)
        kwargs = {**sampling_kwargs(params), **self.extra}
        if not params[0].greedy and params[0].seed is not None:
            torch.manual_seed(params[0].seed)  # one global stream: generate() has no per-row seeds
        with ForwardCounter(model) as counter:
            synchronize(device)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=attention, max_new_tokens=params[0].max_new_tokens,
                                     eos_token_id=sorted(self.target.eos_ids), pad_token_id=self.pad_id, **kwargs)
            synchronize(device)
            wall = time.perf_counter() - start
        steps = counter.calls if len(prompts) == 1 else None
        rows = [self._outcome(row, wall, steps) for row in out[:, input_ids.shape[1]:].tolist()]
        return BatchOutcome(seconds=wall, prompts=rows)

    @property
    def pad_id(self) -> int:
        return min(self.target.eos_ids) if self.target.eos_ids else 0

    def _outcome(self, new: list[int], wall: float, steps: int | None) -> PromptOutcome:
        """A row's tokens up to and including its first EOS (what follows is padding)."""
        eos = self.target.eos_ids
        end = next((i + 1 for i, t in enumerate(new) if t in eos), None)
        ids = new[:end] if end else new
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        return PromptOutcome(token_ids=ids, text=text, seconds=wall, finish_reason="stop" if end else "length",
                             steps=steps)


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) input ids padded on the left, and the attention mask."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


def sampling_kwargs(params: list[SamplingParams]) -> dict:
    """generate() arguments for the batch's (shared) sampling settings. Every knob is
    passed explicitly: a model's generation_config may carry its own defaults (top_k=50
    is common), which would change the distribution."""
    p = params[0]
    if any((q.temperature, q.top_p, q.top_k) != (p.temperature, p.top_p, p.top_k) for q in params):
        raise SpecdraftError("transformers' generate() needs one sampling setting per batch")
    if p.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}


def build_peer(spec: str, target, beam_length: int | None = None, gamma: int | None = None) -> HFPeer:
    """hf-ar | hf-assisted:PATH | hf-lookup."""
    kind, _, path = spec.partition(":")
    if kind == "hf-ar" and not path:
        return HFPeer(spec, target)
    if kind == "hf-lookup" and not path:
        n = (beam_length or LookupDrafter.default_shape()[1]) - 1  # the L our lookup would draft
        if n < 1:
            raise SpecdraftError("hf-lookup needs --beam-length >= 2 (it drafts L - 1 tokens)")
        return HFPeer(spec, target, {"prompt_lookup_num_tokens": n, "max_matching_ngram_size": DEFAULT_MAX_NGRAM},
                      batch1_only=True, info={"beam_width": 1, "beam_length": n + 1})
    if kind == "hf-assisted" and path:
        return assisted_peer(spec, path, target, gamma)
    raise SpecdraftError(f"unknown peer {spec!r}; choose hf-ar, hf-assisted:PATH or hf-lookup")


def assisted_peer(spec: str, path: str, target, gamma: int | None) -> HFPeer:
    """hf-assisted:PATH with the draft model loaded (safetensors only) on the target's
    device and dtype, drafting a constant γ tokens per step."""
    from ..drafters.draft_folder import load_draft_folder, shared_parameters
    from ..drafters.draft_model import DEFAULT_GAMMA
    from ..drafters.registry import checkpoint_path
    from ..models import parameter_count

    folder = Path(checkpoint_path(spec.partition(":")[0], path)).expanduser()
    # The same checks as draft:PATH; transformers drafts over the whole vocabulary, so a
    # draft vocabulary in the folder is not used here (the peer reports its own τ).
    draft, _, cfg, _ = load_draft_folder(folder, target, target.dtype)
    gamma = gamma or cfg.get("gamma") or DEFAULT_GAMMA
    gc = draft.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = int(gamma), "constant"
    gc.assistant_confidence_threshold = 0.0  # draft exactly γ tokens, as draft:PATH does
    info = {"gamma": int(gamma), "beam_width": 1, "beam_length": int(gamma) + 1,
            "draft_params": parameter_count(draft) - shared_parameters(draft), "target_params": parameter_count(target.model)}
    return HFPeer(spec, target, {"assistant_model": draft}, batch1_only=True, info=info)
