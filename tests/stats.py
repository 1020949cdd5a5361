"""Helpers for the exactness tests: goodness of fit (no scipy: the chi-square tail comes
from torch.special.gammaincc) and a plain reference of recursive rejection.

``g_test(counts, probs)`` compares observed outcomes with an exact distribution by a
likelihood-ratio (G) test. Categories whose expected count is below ``min_expected`` are
pooled into one bucket (the usual validity condition of the chi-square approximation);
an observed outcome the exact distribution gives probability 0 makes the p-value 0.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Mapping

import torch

from specdraft.acceptance import Acceptance


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the upper regularised gamma Q(df/2, x/2)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(x, 0.0) / 2, dtype=torch.float64)))


@dataclass
class GTest:
    G: float
    df: int
    p_value: float
    n: int
    tv: float  # total variation between the empirical and the exact distribution (max over strata)
    impossible: int  # observations of outcomes with exact probability 0
    bins: int  # categories after pooling

    def __str__(self) -> str:
        return (f"G={self.G:.1f} df={self.df} p={self.p_value:.3g} n={self.n} "
                f"TV={self.tv:.4f} bins={self.bins} impossible={self.impossible}")


def g_test(counts: Mapping[Hashable, int], probs: Mapping[Hashable, float], min_expected: float = 5.0) -> GTest:
    counts = Counter(counts)
    n = sum(counts.values())
    support = {k: p for k, p in probs.items() if p > 0}
    total = sum(support.values())
    assert abs(total - 1) < 1e-4, f"exact distribution sums to {total}"
    impossible = sum(c for k, c in counts.items() if k not in support)
    tv = 0.5 * (sum(abs(counts.get(k, 0) / n - p / total) for k, p in support.items()) + impossible / n)

    bins: list[tuple[float, int]] = []  # (expected, observed)
    pooled_e, pooled_o = 0.0, 0
    for k, p in sorted(support.items(), key=lambda kv: kv[1], reverse=True):
        e = n * p / total
        if e >= min_expected:
            bins.append((e, counts.get(k, 0)))
        else:
            pooled_e += e
            pooled_o += counts.get(k, 0)
    if pooled_e > 0:
        if pooled_e >= min_expected or not bins:
            bins.append((pooled_e, pooled_o))
        else:  # too small on its own: merge into the smallest remaining bin
            e, o = bins.pop()
            bins.append((e + pooled_e, o + pooled_o))
    G = 2 * sum(o * math.log(o / e) for e, o in bins if o > 0)
    df = len(bins) - 1
    p_value = 0.0 if impossible else chi2_sf(G, df)
    return GTest(G=G, df=df, p_value=p_value, n=n, tv=tv, impossible=impossible, bins=len(bins))


def g_test_strata(strata: list[tuple[Mapping[Hashable, int], Mapping[Hashable, float]]],
                  min_expected: float = 5.0) -> GTest:
    """One G-test over independent groups (e.g. rows that shared a candidate tree): each
    group is compared with its own exact distribution; G and df add up."""
    parts = [g_test(c, p, min_expected) for c, p in strata]
    G, df = sum(t.G for t in parts), sum(t.df for t in parts)
    n = sum(t.n for t in parts)
    impossible = sum(t.impossible for t in parts)
    return GTest(G=G, df=df, p_value=0.0 if impossible else chi2_sf(G, df), n=n,
                 tv=max(t.tv for t in parts), impossible=impossible, bins=sum(t.bins for t in parts))


def naive_tree_sampling(tree, beams, probs, generators, renormalise: bool = True) -> Acceptance:
    """Recursive rejection written plainly, one row and one child at a time. With
    ``renormalise=False`` it has a classic bug: child c_k is accepted with probability
    p(c_k) instead of p(c_k) / (mass not yet rejected)."""
    B, W, L = beams.shape
    path = torch.zeros(B, L, dtype=torch.long)
    n = torch.ones(B, dtype=torch.long)
    nxt = torch.zeros(B, dtype=torch.long)
    beam = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        g, node, alive, j = generators[b], 0, list(range(W)), 0
        while True:
            r = probs[b, node].clone()
            children = [w for w in alive if j + 1 < L and tree.valid[b, w, j + 1] and tree.owner[b, w, j + 1] == w]
            chosen = None
            for w in children:
                tok = beams[b, w, j + 1]
                mass = float(r.sum()) if renormalise else 1.0
                if float(torch.rand((), generator=g)) * mass < float(r[tok]):
                    chosen = w
                    break
                r[tok] = 0
            if chosen is None:
                nxt[b] = torch.multinomial(r if r.sum() > 0 else probs[b, node], 1, generator=g)[0]
                break
            alive = [w for w in alive if tree.owner[b, w, j + 1] == chosen]
            node, j = int(tree.unpack[b, chosen, j + 1]), j + 1
            beam[b], n[b] = chosen, j + 1
        path[b] = tree.unpack[b, beam[b]]
    return Acceptance(path=path, n=n, next_token=nxt, beam=beam)
