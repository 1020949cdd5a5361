"""The ``none`` drafter: no candidates, so each step is one plain autoregressive step.

Running the baseline through the same engine means every speed-up we report compares
like with like: same cache, same sampling code, same stopping.
"""

from __future__ import annotations

from .base import DraftContext, Drafter, Proposal, single_beam


class NoDrafter(Drafter):
    name = "none"
    acceptance_prior = 0.0  # it never drafts: adaptive drafting keeps every step plain

    def max_depth(self, ctx=None) -> int:
        return 0

    def propose(self, ctx: DraftContext) -> Proposal:
        return single_beam(ctx.g0)
