"""The ``medusa:PATH`` drafter: a top-W candidate tree from K independent heads.

Head k predicts the token k positions after g0 from h alone. The candidates are the W
sequences [g0, y_1, ..., y_{L-1}] with the highest Σ_k log q_k(y_k) (the top-W of the
cartesian product of the heads' distributions; L - 1 <= K). Deterministic candidates,
verified by the engine's tree attention like ReDrafter's beams.
"""

from __future__ import annotations

import torch

from .. import fastpath
from ..errors import SpecdraftError
from ..heads.beam_search import independent_beam_search
from ..heads.medusa import MedusaHeads
from .base import DraftContext, Drafter, Proposal
from .redrafter import beam_confidence, beam_shape


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeads, beam_width: int | None = None, beam_length: int | None = None):
        self.heads = heads
        fastpath.small_batch_linear(heads)  # its few-row linears, like the target's (CPU)
        self.W, self.L = beam_shape(heads.config, beam_width, beam_length)
        K = heads.config.num_heads
        if self.L > K + 1:
            raise SpecdraftError(f"beam length {self.L} needs {self.L - 1} Medusa heads; the checkpoint has {K} "
                                 f"(beam length at most {K + 1})")

    @classmethod
    def load(cls, path, target, beam_width: int | None = None, beam_length: int | None = None) -> "MedusaDrafter":
        return cls(MedusaHeads.load(path, target), beam_width, beam_length)

    def max_depth(self, ctx=None) -> int:
        return self.L - 1

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        L = min(self.L, int(ctx.budget.max()))
        # Heads past depth L - 1 would not be used: skip them.
        with fastpath.active():
            log_probs = torch.log_softmax(self.heads.logits(ctx.hidden, num_heads=max(L - 1, 1)), dim=-1)
        result = independent_beam_search(log_probs, ctx.g0, self.W, L)
        return Proposal(beams=result.beams, valid=result.valid, confidence=beam_confidence(result))
