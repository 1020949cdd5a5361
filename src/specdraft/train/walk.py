"""Greedy block efficiency from teacher-forced guesses: the engine's walk, replayed.

On the target's own greedy answer x, a drafter whose guesses are right exactly where
teacher forcing says they are right gets, from the engine at temperature 0, the same
accepted tokens at every step: while its guesses are right it is fed the tokens teacher
forcing feeds it. So one teacher-forced pass over held-out answers gives the engine's
greedy τ without running the engine:

    the prefill emits the answer's first token x_first; then a step at position t (the
    target has just chosen x_{t+1}) emits a_t = min(r_t, depth) drafted tokens and the
    target's own next one, where r_t = how many of the drafter's guesses for x_{t+2},
    x_{t+3}, ... are right in a row; the next step is at t + 1 + a_t. τ = tokens / steps
    (target forwards, the prefill included, as the engine counts them).

``depth``: L − 1 for a single beam of length L, γ for a draft model.
"""

from __future__ import annotations

import torch

from ..data.chat import IGNORE


def labelled_spans(labels: list[int]) -> list[tuple[int, int]]:
    """(first, last) index of each maximal run of trained tokens (an answer)."""
    spans, first = [], None
    for t, y in enumerate(list(labels) + [IGNORE]):
        if y != IGNORE and first is None:
            first = t
        elif y == IGNORE and first is not None:
            spans.append((first, t - 1))
            first = None
    return spans


def streaks(right: torch.Tensor) -> torch.Tensor:
    """right (T,) bool -> (T,) long: how many flags are True in a row from each index on."""
    out = torch.zeros(right.shape[0] + 1, dtype=torch.long)
    flags = right.tolist()
    for p in range(len(flags) - 1, -1, -1):
        out[p] = out[p + 1] + 1 if flags[p] else 0
    return out[:-1]


def greedy_walk(runs: torch.Tensor, first: int, last: int, depth: int) -> tuple[int, int]:
    """(tokens, steps) of the engine's walk over the answer x_first..x_last; runs[t] = r_t
    (T,). Step one is the prefill (x_first alone); a step at t emits x_{t+2}..x_{t+2+a}:
    a = min(r_t, depth) accepted drafts and the target's own next token, never past x_last
    (the engine's token budget)."""
    t, tokens, steps = first - 1, 1, 1
    while t + 2 <= last:
        advance = 1 + min(int(runs[t]), depth, last - t - 2)
        tokens, steps, t = tokens + advance, steps + 1, t + advance
    return tokens, steps
