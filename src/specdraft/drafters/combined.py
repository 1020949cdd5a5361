"""``A+B``: the union of two (or more) drafters' candidates, verified as one tree.

Different drafters are right in different places: prompt lookup when the text repeats
(code, quotes, the loops small models fall into), a trained head elsewhere. Verifying
both sets of beams in the same target pass costs a few tree tokens more (shared
prefixes are packed once) and keeps the longer accepted path of the two.

Beams are concatenated along the beam axis, shorter ones padded (invalid) to the longest
length; every part's beams start with g0, so the union is a valid proposal. The union is
of deterministic candidates (no ``q``, ``Drafter.propose_deterministic``): sampling rows are
then verified by recursive rejection over the whole tree, which keeps the target's
distribution exactly. When every row of the batch samples and a part draws its drafts from
its own distribution (``samples_drafts``: a ReDrafter head at W = 1), that part proposes
alone: speculative sampling with q accepts more than the union's point masses.
"""

from __future__ import annotations

import torch

from ..errors import SpecdraftError
from .base import DraftContext, Drafter, Proposal


class CombinedDrafter(Drafter):
    name = "combined"

    def __init__(self, parts: list[Drafter]):
        if len(parts) < 2:
            raise SpecdraftError("a combined drafter needs at least two parts, e.g. lookup+redrafter:PATH")
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        self.acceptance_prior = max(p.acceptance_prior for p in parts)
        self.context_window = max(p.context_window for p in parts)  # each part reads the slots it needs
        layers = {p.feature_layers for p in parts if p.feature_layers}
        if len(layers) > 1:
            raise SpecdraftError("the parts of a combined drafter read different target layers")
        self.feature_layers = layers.pop() if layers else ()

    def start(self, ctx: DraftContext) -> None:
        for p in self.parts:
            p.start(ctx)

    def add_rows(self, ctx: DraftContext) -> None:
        for p in self.parts:
            p.add_rows(ctx)

    def compile(self, backend: str = "inductor") -> bool:
        self.compiled = any([p.compile(backend) for p in self.parts])  # a list: every part compiles
        return self.compiled

    def quantize(self) -> bool:
        self.int8 = any([p.quantize() for p in self.parts])  # a list: every part quantises
        return self.int8

    def warmed(self) -> None:
        for p in self.parts:
            p.warmed()

    def samples_drafts(self, ctx: DraftContext) -> bool:
        return self._sampler(ctx) is not None

    def max_depth(self, ctx: DraftContext | None = None) -> int | None:
        sampler = None if ctx is None else self._sampler(ctx)
        if sampler is not None:  # it proposes alone this step
            return sampler.max_depth(ctx)
        depths = [p.max_depth(ctx) for p in self.parts]
        return None if None in depths else max(depths)

    def fit_shape(self, cost) -> None:
        for p in self.parts:
            p.fit_shape(cost)

    def may_sample_drafts(self) -> bool:
        return any(p.may_sample_drafts() for p in self.parts)

    def _sampler(self, ctx: DraftContext):
        """The part that proposes alone, drawing its drafts, if any.

        When every row samples, a part that draws its drafts from its own q does better alone
        than the union of point-mass beams (MT-Bench, T = 1, the shipped head: τ 1.51 sampled
        against 1.28 for lookup + the head's beams; docs/redrafter.md). A seeded row gets that
        part alone whatever its neighbours (greedy ones take its argmax chain), or its text
        would depend on whether its batch holds a greedy row."""
        if bool(ctx.greedy.any()) and not any(p.seeded for p in ctx.params or []):
            return None
        return next((p for p in self.parts if p.samples_drafts(ctx)), None)

    def propose(self, ctx: DraftContext) -> Proposal:
        sampler = self._sampler(ctx)
        if sampler is not None:
            return sampler.propose(ctx)
        proposals = [p.propose_deterministic(ctx) for p in self.parts]
        if any(p.q is not None for p in proposals):
            raise SpecdraftError("a combined drafter needs deterministic candidates from every part "
                                 "(a draft model that samples its drafts cannot be combined)")
        L = max(p.beams.shape[2] for p in proposals)
        beams = torch.cat([_pad_length(p.beams, L, 0) for p in proposals], dim=1)
        valid = torch.cat([_pad_length(p.valid, L, False) for p in proposals], dim=1)
        confidence = None
        if any(p.confidence is not None for p in proposals):  # NaN where a part has none
            confidence = torch.cat([_pad_length(p.confidence if p.confidence is not None else
                                                torch.full(p.beams.shape, float("nan"), device=p.beams.device),
                                                L, float("nan")) for p in proposals], dim=1)
        return Proposal(beams=beams, valid=valid, confidence=confidence)

    def observe(self, ctx: DraftContext, accepted: torch.Tensor, n_accepted: torch.Tensor) -> None:
        for p in self.parts:
            p.observe(ctx, accepted, n_accepted)

    def select_rows(self, keep: torch.Tensor) -> None:
        for p in self.parts:
            p.select_rows(keep)


def _pad_length(t: torch.Tensor, length: int, value) -> torch.Tensor:
    """(B, W, l) -> (B, W, length), filled with ``value``."""
    if t.shape[2] == length:
        return t
    return torch.nn.functional.pad(t, (0, length - t.shape[2]), value=value)
