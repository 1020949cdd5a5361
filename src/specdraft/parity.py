"""Greedy parity against transformers' ``generate()``, with numerical near-ties told apart.

Speculative decoding runs the target on several tokens at once, so its floating-point
sums differ from one-token decoding. That may change a greedy token only where the two
candidates' logits are within rounding of each other. At the first divergence of the
engine's output from ``generate()``'s (same model, same dtype), both candidate tokens'
logits are recomputed in float32 on the shared prefix (the float32 model, not the one
that diverged); the divergence is a **near-tie** when they differ by less than

    ε = eps(dtype) · sqrt(L) · max_v |z_v|

and an **error** otherwise. eps(dtype) is the dtype's resolution (``torch.finfo().eps``:
2^-23 float32, 2^-10 float16, 2^-7 bfloat16), L the number of decoder layers (rounding
errors of L residual blocks add up like a random walk) and z the float32 logits at that
position (the error of a dot product scales with its size). For SmolLM2-135M (L = 30,
max logit ≈ 20-30): ε ≈ 1e-5 in float32, ≈ 1 in bfloat16. ``run_parity`` runs a set of
prompts; ``specdraft parity`` is its command line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

IDENTICAL, NEAR_TIE, ERROR = "identical", "near-tie", "error"


@dataclass
class ParityOutcome:
    """How one prompt's greedy output compares with the reference's."""

    status: str  # IDENTICAL, NEAR_TIE or ERROR
    index: int | None = None  # first differing generated position
    ours: int | None = None  # the engine's token there (None: it had stopped)
    reference: int | None = None  # generate()'s token there (None: it had stopped)
    gap: float | None = None  # |z(ours) - z(reference)| in float32 on the shared prefix
    epsilon: float | None = None  # the near-tie threshold at that position

    @property
    def ok(self) -> bool:
        return self.status != ERROR

    def __str__(self) -> str:
        if self.status == IDENTICAL:
            return IDENTICAL
        if self.gap is None:
            return f"{self.status} at generated token {self.index} (one output stopped where the other went on)"
        rel = "<" if self.status == NEAR_TIE else "≥"
        return (f"{self.status} at generated token {self.index}: tokens {self.ours} vs {self.reference}, "
                f"float32 logit gap {self.gap:.3g} {rel} ε {self.epsilon:.3g}")


def tie_epsilon(dtype: torch.dtype, num_layers: int, logits: torch.Tensor) -> float:
    """The near-tie threshold ε for a divergence of two ``dtype`` computations (module
    docstring); logits (V,) float32 at the divergence."""
    return torch.finfo(dtype).eps * math.sqrt(num_layers) * float(logits.abs().max())


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids: Iterable[int] | None = None) -> list[int]:
    """transformers' own greedy decoding of one prompt (the reference for parity), stopping
    at ``eos_ids`` (default: the model's generation config) like the engine does."""
    ids = torch.tensor([prompt], device=model.device)
    eos = sorted(eos_ids) if eos_ids else None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, temperature=None,
                             top_p=None, top_k=None, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=eos[0] if eos else model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def float32_logits(model, tokens: list[int]) -> torch.Tensor:
    """(V,) float32 logits of ``model`` (a float32 model) for the token after ``tokens``."""
    return model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """Index of the first generated position where the outputs differ (one ending there
    while the other goes on counts), or None when they are identical."""
    n = min(len(ours), len(reference))
    diff = next((i for i in range(n) if ours[i] != reference[i]), None)
    if diff is None and len(ours) != len(reference):
        diff = n
    return diff


def compare_greedy(model32, prompt: list[int], ours: list[int], reference: list[int],
                   dtype: torch.dtype = torch.float32) -> ParityOutcome:
    """Classify the engine's greedy output ``ours`` against ``reference`` (generate()'s),
    both computed at ``dtype``: identical, near-tie or error (module docstring).

    model32: the same model in float32 (for a float32 run, the very model that ran)."""
    diff = first_difference(ours, reference)
    if diff is None:
        return ParityOutcome(IDENTICAL)
    a = ours[diff] if diff < len(ours) else None
    b = reference[diff] if diff < len(reference) else None
    if a is None or b is None:  # a stop where the other continued: no pair of logits to weigh
        return ParityOutcome(ERROR, diff, a, b)
    logits = float32_logits(model32, prompt + reference[:diff])
    gap = float((logits[a] - logits[b]).abs())
    eps = tie_epsilon(dtype, model32.config.num_hidden_layers, logits)
    return ParityOutcome(NEAR_TIE if gap < eps else ERROR, diff, a, b, gap, eps)


@dataclass
class ParityRecord:
    """One prompt's parity result, as ``specdraft parity --json`` prints it."""

    id: object
    outcome: ParityOutcome
    new_tokens: int
    tokens_per_step: float

    def to_dict(self) -> dict:
        return {"id": self.id, **asdict(self.outcome), "new_tokens": self.new_tokens,
                "tokens_per_step": self.tokens_per_step}


def run_parity(engine, model32, prompts: list[list[int]], ids: list, max_new_tokens: int, batch_size: int = 1,
               on_record: Callable[[ParityRecord], None] | None = None) -> list[ParityRecord]:
    """Greedy output of ``engine`` (in batches of ``batch_size``) against ``generate()`` on
    the engine's own target model (always one prompt at a time, unpadded), per prompt.

    model32: the target in float32 for the near-tie test (``engine.target.model`` itself
    when the target runs in float32). ``on_record`` sees each record as it is made."""
    from .sampling import SamplingParams

    target = engine.target
    params = SamplingParams(max_new_tokens=max_new_tokens)
    records = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start: start + batch_size]
        results = engine.generate(group, params)
        for rid, prompt, res in zip(ids[start: start + batch_size], group, results):
            ref = hf_greedy(target.model, prompt, max_new_tokens, target.eos_ids)
            outcome = compare_greedy(model32, prompt, res.token_ids, ref, target.dtype)
            record = ParityRecord(rid, outcome, res.new_tokens, res.tokens_per_step)
            records.append(record)
            if on_record:
                on_record(record)
    return records


def summary(records: list[ParityRecord]) -> str:
    """``parity: I identical, T near-ties, E errors``."""
    count = {s: sum(r.outcome.status == s for r in records) for s in (IDENTICAL, NEAR_TIE, ERROR)}
    return f"parity: {count[IDENTICAL]} identical, {count[NEAR_TIE]} near-ties, {count[ERROR]} errors"
