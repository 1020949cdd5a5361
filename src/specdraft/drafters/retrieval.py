"""``retrieval:PATH``: propose what most often followed the latest n-gram in a datastore of
the target's own answers (``specdraft.datastore``; REST, He et al. 2024).

Each row's continuations from the datastore (up to MAX_MATCHES places where its last n
tokens occur, L - 1 tokens each) are merged as a trie and read greedily by count: beam w
starts with the w-th most frequent next token and then follows, depth by depth, the most
frequent token among the continuations that agree with it so far. A beam stops where no
continuation goes on. Its confidence at depth j is the share of the continuations agreeing up
to j - 1 that also agree at j, an estimate of P(token j | tokens before it), which adaptive
drafting reads to decide how deep to verify.

Worked example (W = 1, L = 4): continuations [a b c], [a b d], [a e f], [g h i] give the beam
g0 a b c (or g0 a b d: ties go to the smaller id) with confidences 3/4, 2/3, 1/2.

Deterministic candidates: under sampling the engine verifies them by recursive rejection,
which keeps p exact. Where it pays: beside prompt lookup (``lookup+retrieval:PATH``), drafting
where the request's own text has no match; beside a head trained on the same answers it adds
τ but not speed (docs/retrieval.md).
"""

from __future__ import annotations

import torch

from ..datastore import SEPARATOR, Datastore
from ..errors import SpecdraftError
from .base import DraftContext, Drafter, Proposal, candidates_proposal, check_shapes

DEFAULT_BEAM_WIDTH, DEFAULT_BEAM_LENGTH = 1, 4


class RetrievalDrafter(Drafter):
    name = "retrieval"
    acceptance_prior = 0.4

    def __init__(self, store: Datastore, beam_width: int = DEFAULT_BEAM_WIDTH,
                 beam_length: int = DEFAULT_BEAM_LENGTH):
        check_shapes(beam_width, beam_length)
        self.store, self.W, self.L = store, beam_width, beam_length

    @classmethod
    def load(cls, path: str, target, beam_width: int | None = None, beam_length: int | None = None):
        """The datastore in ``path``, checked against ``target``'s vocabulary; shape: the given
        one, else ``beam_width`` / ``beam_length`` of its config.json, else 1 x 4."""
        store = Datastore.load(path)
        if store.vocab_size != target.vocab_size:
            raise SpecdraftError(f"the datastore in {path} holds ids of a {store.vocab_size}-token vocabulary, "
                                 f"the target has {target.vocab_size}")
        config = store.config or {}  # a shape recorded in the datastore's config.json, else the defaults
        return cls(store, beam_width or int(config.get("beam_width", DEFAULT_BEAM_WIDTH)),
                   beam_length or int(config.get("beam_length", DEFAULT_BEAM_LENGTH)))

    def max_depth(self, ctx=None) -> int:
        return self.L - 1

    def chains(self, history: torch.Tensor) -> list[tuple[list[int], list[float]]]:
        """Up to W (tokens, confidences) of ≤ L - 1 tokens each continuing ``history`` (T,)."""
        _, conts = self.store.continuations(history, self.L - 1)
        if conts.numel() == 0:
            return []
        firsts, counts = _ranked(conts[:, 0])
        return [_follow(conts[conts[:, 0] == t], t, c / conts.shape[0]) for t, c in zip(firsts[: self.W], counts)]

    def propose(self, ctx: DraftContext) -> Proposal:
        return candidates_proposal(ctx.g0, self.W, self.L, [self.chains(history.cpu()) for history in ctx.tokens])


def _ranked(column: torch.Tensor) -> tuple[list[int], list[int]]:
    """The distinct tokens of ``column`` (M,) other than SEPARATOR, most frequent first
    (ties: smaller id first), and their counts."""
    column = column[column != SEPARATOR]
    if column.numel() == 0:
        return [], []
    values, counts = torch.unique(column, return_counts=True)  # values ascending
    order = torch.argsort(counts, descending=True, stable=True)
    return values[order].tolist(), counts[order].tolist()


def _follow(agree: torch.Tensor, first: int, first_share: float) -> tuple[list[int], list[float]]:
    """The greedy path through ``agree`` (M, D), every row starting with ``first``."""
    tokens, conf = [first], [first_share]
    for d in range(1, agree.shape[1]):
        ranked, counts = _ranked(agree[:, d])
        if not ranked:
            break
        tokens.append(ranked[0])
        conf.append(counts[0] / agree.shape[0])
        agree = agree[agree[:, d] == ranked[0]]
    return tokens, conf
