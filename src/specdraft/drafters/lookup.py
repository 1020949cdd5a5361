"""Prompt lookup: propose what followed earlier occurrences of the latest n-gram.

For each row, the last n tokens (n from ``max_ngram`` down to ``min_ngram``) are searched
in the prompt and output so far; the tokens that followed the most recent matches become
up to W distinct candidate continuations of length L - 1 after g0. Where nothing matches,
the row's only candidate is g0 itself (one plain step). Deterministic candidates: under
sampling the engine verifies them by recursive rejection, which keeps p exact.
"""

from __future__ import annotations

import json

import torch

from ..models import cache_dir
from .base import DraftContext, Drafter, Proposal, candidates_proposal, check_shapes


DEFAULT_BEAM_WIDTH, DEFAULT_BEAM_LENGTH = 1, 6  # (W, L) when no sweep recorded a shape; 1 x 6 beat 1 x 4 under `auto` (docs/results.md)
DEFAULT_MAX_NGRAM = 3


class LookupDrafter(Drafter):
    name = "lookup"
    acceptance_prior = 0.6  # given a match

    def __init__(self, beam_width: int = DEFAULT_BEAM_WIDTH, beam_length: int = DEFAULT_BEAM_LENGTH,
                 max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1):
        check_shapes(beam_width, beam_length)
        self.W, self.L = beam_width, beam_length
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def max_depth(self, ctx=None) -> int:
        return self.L - 1

    def continuations(self, history: torch.Tensor) -> list[torch.Tensor]:
        """Up to W distinct continuations (each <= L-1 tokens) of ``history`` (T,).

        The longest n-gram with a match wins. Among its matches, those followed by a full
        L-1 tokens come first (a match near the end of the history has a cut-off
        continuation, e.g. inside a repetition), each group most recent first.
        """
        return self.match(history)[1]

    def match(self, history: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        """(n, continuations): the matched n-gram's length (0: none) and ``continuations``."""
        T, D = history.shape[0], self.L - 1
        if D == 0:
            return 0, []
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            windows = history[: T - 1].unfold(0, n, 1)  # windows ending before the last token
            starts = (windows == history[T - n:]).all(dim=1).nonzero()[:, 0].flip(0).tolist()
            if not starts:
                continue
            starts.sort(key=lambda s: s + n + D > T)  # stable: full continuations first
            found: list[torch.Tensor] = []
            for s in starts:
                cont = history[s + n: s + n + D]
                if not any(c.shape == cont.shape and bool((c == cont).all()) for c in found):
                    found.append(cont)
                if len(found) == self.W:
                    break
            return n, found
        return 0, []

    @staticmethod
    def default_shape() -> tuple[int, int]:
        """(W, L) of ``lookup`` when none is given: a sweep's choice, else the defaults."""
        return LookupDrafter.recorded_shape() or (DEFAULT_BEAM_WIDTH, DEFAULT_BEAM_LENGTH)

    @staticmethod
    def recorded_shape() -> tuple[int, int] | None:
        """(W, L) that `specdraft sweep` recorded for this machine, if any."""
        path = cache_dir() / "lookup.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
            return int(cfg["beam_width"]), int(cfg["beam_length"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def propose(self, ctx: DraftContext) -> Proposal:
        rows = []
        for history in ctx.tokens:
            n, found = self.match(history)
            # A longer matched n-gram is likelier to go on the same way; adaptive drafting
            # calibrates the scale per request.
            rows.append([(cont.tolist(), [n / (n + 1)] * len(cont)) for cont in found])
        return candidates_proposal(ctx.g0, self.W, self.L, rows)
