"""Goodness-of-fit helpers for the exactness tests (no scipy: the chi-square tail comes
from torch.special.gammaincc).

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
