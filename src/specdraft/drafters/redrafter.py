"""The ``redrafter:PATH`` drafter: beam search over a recurrent draft head.

Each step: h (the target's hidden state whose logits chose g0) and g0 go through the
ReDrafter head's beam search; its W beams of L tokens (g0 included, so L - 1 drafted
tokens) are verified together by the engine's dynamic tree attention. Candidates are
deterministic (no q): under sampling the engine's recursive rejection keeps the output
distributed exactly as the target's. The drafter keeps no state between steps; a head with
context attention reads each row's latest target states from the engine (``ctx.recent``)
and replaces h by a_t before the search.
"""

from __future__ import annotations

import torch

from .. import fastpath
from ..heads.beam_search import redrafter_beam_search
from ..heads.model import ReDrafterHead
from .base import DraftContext, Drafter, Proposal, check_shapes


def beam_shape(config, beam_width: int | None, beam_length: int | None) -> tuple[int, int]:
    """(W, L): the arguments where given, else the checkpoint's recorded defaults."""
    W = config.beam_width if beam_width is None else beam_width
    L = config.beam_length if beam_length is None else beam_length
    check_shapes(W, L)
    return W, L


def beam_confidence(result) -> torch.Tensor:
    """(B, W, L) per-token probabilities of a beam search's tokens (g0: 1)."""
    probs = result.token_logprobs.float().exp()
    return torch.nn.functional.pad(probs, (1, 0), value=1.0)


class ReDrafter(Drafter):
    name = "redrafter"
    acceptance_prior = 0.5

    def __init__(self, head: ReDrafterHead, beam_width: int | None = None, beam_length: int | None = None):
        self.head = head
        fastpath.small_batch_linear(head)  # its few-row linears, like the target's (CPU)
        self.W, self.L = beam_shape(head.config, beam_width, beam_length)
        self.context_window = head.config.context
        self.feature_layers = tuple(head.config.feature_layers)

    @classmethod
    def load(cls, path, target, beam_width: int | None = None, beam_length: int | None = None) -> "ReDrafter":
        """A drafter from a checkpoint folder; W and L default to the checkpoint's
        beam_width / beam_length (W=4, L=5 unless it records others)."""
        return cls(ReDrafterHead.load(path, target), beam_width, beam_length)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        # No row may use more than its budget: drafting deeper would only be clipped away.
        L = min(self.L, int(ctx.budget.max()))
        with fastpath.active():
            hidden = self.root_states(ctx)
            result = redrafter_beam_search(self.head, hidden, ctx.g0, self.W, L)
        return Proposal(beams=result.beams, valid=result.valid, confidence=beam_confidence(result))

    def root_states(self, ctx: DraftContext) -> torch.Tensor:
        """(B, d) what the head starts from: h, fused with the target's states after its
        feature layers (``ctx.features``) if the head reads them, then with context attention
        a_t over the row's latest states paired with the tokens after them (its last C
        tokens, g0 last)."""
        hidden = self.head.fuse_features(ctx.hidden, ctx.features) if self.feature_layers else ctx.hidden
        if not self.context_window:
            return hidden
        recent, C = ctx.recent, ctx.recent.window
        after = torch.stack([torch.nn.functional.pad(t[-C:], (C - min(C, len(t)), 0)) for t in ctx.tokens])
        return self.head.contextualize_recent(hidden, recent.states, after, recent.lengths)
