"""The drafter interface: every drafting method proposes candidate beams the same way.

A step of the engine gives the drafter a ``DraftContext`` and receives a ``Proposal``:
beams (B, W, L) whose first column is g0 (the token the target chose last, already
final), the rest candidate continuations. The engine verifies all beams in one target
pass, keeps the longest acceptable prefix, and calls ``observe`` with the outcome so that
stateful drafters (a draft model's KV cache, a recurrent head's inputs) stay in step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ..errors import SpecdraftError


@dataclass
class DraftContext:
    """What a drafter may read at a step. B rows in the engine's current batch order.

    tokens:  list of B 1D long tensors, each row's prompt + generated tokens (g0 last)
    g0:      (B,) long, the token the target chose last (= tokens[b][-1])
    hidden:  (B, d) float, the target's last-layer hidden state (after its final norm) at
             the token before g0: the state whose logits chose g0
    budget:  (B,) long, at most how many tokens (g0 included) a beam may usefully hold
    greedy:  (B,) bool, rows decoded greedily (others sample)
    request_ids: list of B request ids, stable while a request is in flight
    params:  list of B SamplingParams: drafters that sample must draw at the row's
             temperature/top-k/top-p (see sampling.target_probs) and report q
    recent:  for drafters with ``context_window`` > 0, each row's latest target states
             (``specdraft.recent.RecentStates``: states (B, C, d), hidden[b] in the last
             slot, paired with tokens[b][-C:]); None otherwise
    features: for drafters with ``feature_layers``, (B, n, d) the target's states after
             those layers at the token before g0 (where ``hidden`` is); None otherwise
    """

    tokens: list[torch.Tensor]
    g0: torch.Tensor
    hidden: torch.Tensor
    budget: torch.Tensor
    greedy: torch.Tensor
    request_ids: list[int] = field(default_factory=list)
    params: list = field(default_factory=list)
    recent: object | None = None
    features: torch.Tensor | None = None


@dataclass
class Proposal:
    """beams (B, W, L) long with beams[:, :, 0] == g0; valid (B, W, L) bool, prefix-closed.

    ``q`` is set only by drafters that *sample* their drafts: (B, W, L-1, V), the
    distribution each drafted token was drawn from, given its beam's earlier tokens (the
    W beams are then W chains drawn independently, so chains that share a prefix share q
    there). Drafters with deterministic candidates leave it None, and sampling rows use
    recursive rejection.

    ``confidence`` (B, W, L) float, optional: the drafter's own probability that token
    (w, j) is right given that its beam's earlier tokens are (beam log-probabilities,
    draft-model probabilities, lookup match length); column 0 (g0) is 1, NaN = unknown.
    Only adaptive drafting reads it (to decide how much to verify), never acceptance;
    it need not be calibrated (the policy learns a scale per request).
    """

    beams: torch.Tensor
    valid: torch.Tensor
    q: torch.Tensor | None = None
    confidence: torch.Tensor | None = None


class Drafter(ABC):
    """One small interface for every drafting method."""

    name: str = "drafter"
    # Adaptive drafting's prior for P(a drafted token is accepted | its parent was), before
    # a request has evidence of its own (specdraft.adaptive).
    acceptance_prior: float = 0.5
    # How many of each row's latest target states the drafter reads (DraftContext.recent);
    # the engine keeps them only when this is > 0.
    context_window: int = 0
    # Target layers whose outputs the drafter reads (DraftContext.features); () for none.
    feature_layers: tuple[int, ...] = ()
    compiled: bool = False  # its model code runs through torch.compile (``compile``)
    int8: bool = False  # its large linears run in int8 (``quantize``)

    def start(self, ctx: DraftContext) -> None:
        """A new batch was prefilled: ``ctx`` holds all its rows, in order."""

    def add_rows(self, ctx: DraftContext) -> None:
        """Continuous batching: the rows of ``ctx`` were appended to the running batch."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> Proposal:
        """Candidates to verify for each row of ``ctx``."""

    def observe(self, ctx: DraftContext, accepted: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """After verification: row b kept accepted[b, :n_accepted[b]] (g0 first).

        Called after every ``propose``; a step where adaptive drafting turned drafting off
        calls neither, so stateful drafters must catch up from ``ctx.tokens``."""

    def select_rows(self, keep: torch.Tensor) -> None:
        """Rows not in ``keep`` (1D long, new order) have left the batch."""

    def samples_drafts(self, ctx: DraftContext) -> bool:
        """Whether ``propose(ctx)`` would draw its drafts and report ``q`` (default: never)."""
        return False

    def may_sample_drafts(self) -> bool:
        """Whether ``samples_drafts`` can hold for some batch. Only then does a seeded row's
        text depend on how deep its drafts go (deterministic drafts leave it plain seeded
        decoding's), so only then must the adaptive policy keep its shape fixed."""
        return False

    def max_depth(self, ctx: DraftContext | None = None) -> int | None:
        """The deepest drafted token (g0 not counted) one call can propose, whatever the
        budget; None: as deep as the budget allows. ``ctx``: the step's context, for a
        drafter whose reach depends on it (a head's sampled chain may be deeper than its
        beams); None: the deepest over any step. Adaptive drafting plans and times calls
        by depth, so it must not price depths a drafter cannot reach: a 1 x 3 head was
        planned 5 and 11 deep on a 256-token answer, and the same 2-deep call was timed
        under a dozen depths (docs/engine.md, "A drafter's reach")."""
        return None

    def fit_shape(self, cost) -> None:
        """Adaptive drafting is on, over ``cost`` (the target's ``costmodel.CostModel`` on
        this machine): a drafter may widen the default shape it proposes from, since the
        policy only verifies what pays. A shape the user gave is kept. Default: nothing."""

    def propose_deterministic(self, ctx: DraftContext) -> Proposal:
        """Candidates that are a fixed function of the history (no ``q``), for drafters
        that can give them even where ``propose`` would sample (a combination's parts:
        their union is verified by recursive rejection). Default: ``propose``."""
        return self.propose(ctx)

    def compile(self, backend: str = "inductor") -> bool:
        """Compile the drafter's own model code with ``torch.compile`` (``backend``) where
        that makes drafting cheaper; True if anything was compiled (default: nothing).
        Exactness does not depend on it: the target decides what is accepted, and a
        sampled draft's q is the distribution its tokens were drawn from, compiled or not.
        The first calls of each shape compile (seconds to minutes): ``build.warm_up``."""
        return False

    def warmed(self) -> None:
        """``build.warm_up`` is done: compiled code should no longer stop to compile."""

    def quantize(self) -> bool:
        """Run the drafter's large linears in int8 (``specdraft.int8``) where that makes
        drafting cheaper; True if anything was quantised (default: nothing). Exact either
        way, as for ``compile``: only the drafter's weights change, never the target's."""
        return False


def candidates_proposal(g0: torch.Tensor, W: int, L: int, rows: list[list[tuple[list[int], list[float]]]]) -> Proposal:
    """A (B, W, L) proposal from each row's candidates: rows[b] holds up to W (tokens,
    confidences) pairs of at most L - 1 tokens each, written after g0; the rest of a beam,
    and beams a row has no candidate for, are invalid (g0 alone: a plain step)."""
    B, device = g0.shape[0], g0.device
    beams = g0[:, None, None].repeat(1, W, L)
    valid = torch.zeros(B, W, L, dtype=torch.bool, device=device)
    valid[:, :, 0] = True
    confidence = torch.ones(B, W, L, device=device)
    for b, candidates in enumerate(rows):
        for w, (tokens, conf) in enumerate(candidates):
            end = 1 + len(tokens)
            beams[b, w, 1:end] = torch.as_tensor(tokens, device=device)
            valid[b, w, 1:end] = True
            confidence[b, w, 1:end] = torch.as_tensor(conf, dtype=confidence.dtype, device=device)
    return Proposal(beams=beams, valid=valid, confidence=confidence)


def single_beam(g0: torch.Tensor) -> Proposal:
    """The trivial proposal: just g0, i.e. one autoregressive step."""
    beams = g0[:, None, None]
    return Proposal(beams=beams, valid=torch.ones_like(beams, dtype=torch.bool))


# The largest beam width, beam length or gamma accepted: far beyond any tree one forward can
# verify, so a larger value is a typo, and one beyond 2**63 failed deep inside torch.
MAX_SHAPE = 1024


def check_shapes(beam_width: int | None = None, beam_length: int | None = None, gamma: int | None = None) -> None:
    """Drafting shapes must be integers from 1 to MAX_SHAPE where given: the one check of
    every drafter, also run by the command line before any model loads."""
    for name, value in (("beam width", beam_width), ("beam length", beam_length), ("gamma", gamma)):
        # bool is an int subclass: True would pass as a width of 1.
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 1 <= value <= MAX_SHAPE):
            raise SpecdraftError(f"{name} must be an integer from 1 to {MAX_SHAPE}, got {value!r}")
