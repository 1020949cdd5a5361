"""Greedy parity against transformers' ``generate()``, with numerical ties told apart.

Speculative decoding runs the target on several tokens at once, so its floating-point
sums differ in the last bits from one-token decoding. That can only change a greedy
token where the top two logits are within rounding of each other. ``compare_greedy``
accepts a divergence only there (gap below ``tol``, default 1e-4) and reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ParityOutcome:
    status: str  # "identical", "tie" (diverged at a numerical tie: tolerated) or "diverged"
    index: int | None = None  # first differing generated position
    gap: float | None = None  # top-1 minus top-2 logit of the target at that position

    @property
    def ok(self) -> bool:
        return self.status in ("identical", "tie")

    def __str__(self) -> str:
        if self.status == "identical":
            return "identical"
        return f"{self.status} at generated token {self.index} (top-2 logit gap {self.gap:.2e})"


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding: the reference for parity."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def top2_gap(model, tokens: list[int]) -> float:
    """Logit gap between the target's two best next tokens after ``tokens``."""
    logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare_greedy(model, prompt: list[int], ours: list[int], reference: list[int],
                   tol: float = 1e-4) -> ParityOutcome:
    """Identical, or a divergence that starts at a numerical tie, or a real divergence."""
    n = min(len(ours), len(reference))
    diff = next((i for i in range(n) if ours[i] != reference[i]), None)
    if diff is None:
        if len(ours) == len(reference):
            return ParityOutcome("identical")
        diff = n  # one stopped (EOS) where the other went on: compare the choice there
    gap = top2_gap(model, prompt + reference[:diff])
    return ParityOutcome("tie" if gap < tol else "diverged", diff, gap)
