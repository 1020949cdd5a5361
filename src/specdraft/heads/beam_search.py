"""Beam search over a drafter head: W candidate continuations of g0, scored by the sum
of the head's log-probabilities.

Definitions (B rows, W beams, L tokens per beam, V vocabulary):

- A beam is L tokens [g0, y_1, ..., y_{L-1}]: **L counts g0**, so a beam drafts L - 1
  tokens (the reference ReDrafter's convention; its default L = 5 drafts 4 tokens).
- score(beam) = sum_{j=1}^{L-1} log q(y_j | g0, y_1..y_{j-1}), with log q a normalised
  log_softmax in float32.
- Search: every row starts from the single beam [g0], so only that beam expands at the
  first step. At each depth, every live beam is extended by every token, and the W best
  (beam, token) pairs by score survive (an exact top-W over live beams × V: no top-k
  truncation of the vocabulary). Distinct (parent, token) pairs give distinct beams, so
  no two valid beams are equal.
- Fewer than W candidates can exist (the first step offers V continuations; a head may
  give a token probability 0, i.e. log q = -inf). Such slots are **invalid**: their
  tokens are meaningless, valid[b, w] is [True, False, ...] (g0 only, which every tree
  has anyway), and their score is -inf. Valid beams have finite scores.
- Beams come out sorted by score, best first (invalid ones last).

The search is vectorised over rows and beams; Python loops run over depth only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class BeamResult:
    """beams (B, W, L) long with beams[:, :, 0] == g0; valid (B, W, L) bool (prefix-closed:
    a valid slot is valid at every depth, an invalid slot only at depth 0);
    scores (B, W) float32, the sum of log q of the drafted tokens (-inf when invalid);
    token_logprobs (B, W, L-1) float32, log q of each drafted token."""

    beams: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    token_logprobs: torch.Tensor


# log_probs(state, depth) -> (B, w, V) or (B, 1, V) float32 normalised log-probs of the
# next token of each of the w current beams (depth j = 1 .. L-1 is the depth of that token).
LogProbs = Callable[[object, int], torch.Tensor]
# advance(state, parent (B, W) long, token (B, W) long) -> the state of the new beams.
Advance = Callable[[object, torch.Tensor, torch.Tensor], object]


def select_top(scores: torch.Tensor, log_probs: torch.Tensor, alive: torch.Tensor, width: int):
    """One beam-search step.

    scores (B, w) and alive (B, w) of the current beams; log_probs (B, w or 1, V).
    Returns parent (B, W), token (B, W), new scores (B, W), step log-probs (B, W) and
    new alive (B, W) for the W best extensions. Dead beams are never extended; a selected
    extension is alive only if its score is finite.
    """
    B, w = scores.shape
    V = log_probs.shape[-1]
    log_probs = log_probs.expand(B, w, V)
    cand = torch.where(alive[:, :, None], scores[:, :, None] + log_probs,
                       torch.full_like(log_probs, float("-inf")))
    k = min(width, w * V)
    top, flat = cand.flatten(1).topk(k, dim=1)  # sorted, best first
    parent, token = flat // V, flat % V
    step = log_probs.reshape(B, w * V).gather(1, flat)  # log q of each chosen token
    if k < width:  # not enough (beam, token) pairs exist: pad with dead slots
        pad = width - k
        parent = torch.cat([parent, parent.new_zeros(B, pad)], dim=1)
        token = torch.cat([token, token.new_zeros(B, pad)], dim=1)
        top = torch.cat([top, top.new_full((B, pad), float("-inf"))], dim=1)
        step = torch.cat([step, step.new_full((B, pad), float("-inf"))], dim=1)
    return parent, token, top, step, torch.isfinite(top)


def beam_search(g0: torch.Tensor, state: object, log_probs: LogProbs, advance: Advance,
                width: int, length: int) -> BeamResult:
    """Generic beam search from the single beam [g0] per row.

    g0 (B,) long; ``state`` describes the single root beam of each row (as ``log_probs``
    expects for w = 1). ``advance`` is not called after the last depth.
    """
    if width < 1 or length < 1:
        raise ValueError(f"beam width and length must be >= 1, got W={width}, L={length}")
    B, device = g0.shape[0], g0.device
    seqs = g0[:, None, None]  # (B, w, j): w = 1 at the start
    scores = torch.zeros(B, 1, dtype=torch.float32, device=device)
    alive = torch.ones(B, 1, dtype=torch.bool, device=device)
    steps = torch.zeros(B, 1, 0, dtype=torch.float32, device=device)
    for depth in range(1, length):
        lp = log_probs(state, depth).float()
        parent, token, scores, step, alive = select_top(scores, lp, alive, width)
        seqs = torch.cat([_gather_beams(seqs, parent), token[:, :, None]], dim=2)
        steps = torch.cat([_gather_beams(steps, parent), step[:, :, None]], dim=2)
        if depth < length - 1:
            state = advance(state, parent, token)
    return _finish(seqs, scores, steps, alive, g0, width)


def _gather_beams(x: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """x (B, w, ...) reordered to the parents (B, W) -> (B, W, ...)."""
    index = parent.view(*parent.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def _finish(seqs, scores, steps, alive, g0, width) -> BeamResult:
    """Broadcast the L = 1 case to W beams and mark dead slots invalid."""
    B, w, L = seqs.shape
    if w < width:  # only when L == 1: the root beam, W - 1 empty slots
        seqs = seqs.expand(B, width, L)
        steps = steps.expand(B, width, L - 1)
        scores = torch.cat([scores, scores.new_full((B, width - w), float("-inf"))], dim=1)
        alive = torch.cat([alive, alive.new_zeros(B, width - w)], dim=1)
    valid = alive[:, :, None].expand(B, width, L).clone()
    valid[:, :, 0] = True
    beams = torch.where(valid, seqs, torch.zeros_like(seqs))
    beams[:, :, 0] = g0[:, None]
    scores = torch.where(alive, scores, torch.full_like(scores, float("-inf")))
    steps = torch.where(alive[:, :, None], steps, torch.full_like(steps, float("-inf")))
    return BeamResult(beams=beams, valid=valid, scores=scores, token_logprobs=steps)


def redrafter_beam_search(head, hidden: torch.Tensor, g0: torch.Tensor, width: int,
                          length: int) -> BeamResult:
    """Beam search with a ``ReDrafterHead``: hidden (B, d) is h, g0 (B,) the root token.

    The state of a beam is its RNN state s_j (after feeding g0, y_1, ..., y_{j-1}). With a
    draft vocabulary of N tokens the search runs over the N draft ids (the other V - N
    tokens have probability 0: the same beams, without a softmax and top-k over V per
    depth) and the drafted tokens are mapped to target ids on the way (the recurrence
    embeds target ids) and in the result.
    """
    h = hidden[:, None, :]  # (B, 1, d), broadcast over beams
    bias = head.recurrence_bias(h)  # (B, 1, d) or 0: the same for every beam and depth
    s1 = head.step(head.initial_state((g0.shape[0], 1), device=g0.device), g0[:, None], bias)
    vocab = head.draft_vocab
    to_target = (lambda t: t) if vocab is None else vocab.to_target

    def log_probs(state, depth):
        return torch.log_softmax(head.draft_logits(h, state), dim=-1)

    def advance(state, parent, token):
        return head.step(_gather_beams(state, parent), to_target(token), bias)

    result = beam_search(g0, s1, log_probs, advance, width, length)
    if vocab is not None:
        drafted = torch.where(result.valid[:, :, 1:], to_target(result.beams[:, :, 1:]), 0)
        result.beams = torch.cat([result.beams[:, :, :1], drafted], dim=2)
    return result


def independent_beam_search(log_probs_by_depth: torch.Tensor, g0: torch.Tensor, width: int,
                            length: int) -> BeamResult:
    """Top-W sequences when each depth has its own distribution, independent of the
    earlier drafted tokens (Medusa heads): log_probs_by_depth (B, K, V) with K >= L - 1.

    Scores are separable sums, so beam search of width W is exact here: it returns the W
    best sequences of the full cartesian product (any prefix of a top-W sequence is
    itself among the top-W prefixes).
    """

    def log_probs(state, depth):
        return log_probs_by_depth[:, depth - 1: depth]  # (B, 1, V), shared by every beam

    return beam_search(g0, None, log_probs, lambda state, parent, token: None, width, length)
