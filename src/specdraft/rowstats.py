"""One request's acceptance evidence, as the adaptive policy (``adaptive.py``) reads it.

a_j = P(the drafted token at depth j is accepted | depth j - 1 was), from decayed counts
with a Beta prior of PRIOR_STRENGTH pseudo-trials: depth 1's prior mean is the drafter's
pooled evidence over the requests so far (``AdaptivePolicy.pooled``), depth j's is depth
j - 1's estimate. Example: prior 0.3, 10 depth-1 trials with 2 hits -> a_1 = (2 x 0.3 + 2) /
(2 + 10) = 0.217. Depth 1's prior weighs more than PRIOR_STRENGTH trials where the drafter's
rate is known to vary little from stretch to stretch of text (``RateSpread``). Beside the
a_j: the offer rate (how often a drafter call drafts anything for this row; the a_j are
given an offer) and kappa, the calibration of the drafter's own per-token confidences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_STRENGTH = 2.0  # pseudo-trials of the Beta prior per depth
# A new request's prior: the drafter's pooled depth-1 evidence so far (this decay per drafted
# row-step, ~the last 200), from its ``acceptance_prior``; a fixed prior cost every request
# ~20 drafted steps to unlearn (the shipped draft model: 0.6 against 0.13 measured).
POOL_DECAY = 0.995
DECAY = 0.95  # evidence weight kept per drafted step: about the last 20 steps count
PROBE_START, PROBE_MAX = 8, 128  # steps off before a probe; doubles after a failed probe
MAX_DEPTH = 16
# Depth 1's prior strength, learnt (RateSpread): depth-1 rates over windows of WINDOW trials, their
# spread beyond binomial noise gives the Beta prior's strength (method of moments), between
# PRIOR_STRENGTH and STRENGTH_MAX, once SPREAD_MIN windows are in (each window weighs SPREAD_DECAY
# per later window). Why: the shipped draft model's per-request rates spread 0.05 around 0.21 on
# MT-Bench (a Beta of strength ~60), but at strength 2 a new request's first 8 misses put it at
# 0.04, drafting went off for ~25 steps on 2 of 10 requests, and adaptive lost to fixed gamma = 1.
WINDOW, SPREAD_MIN, SPREAD_DECAY, STRENGTH_MAX = 20, 8, 0.97, 32.0


@dataclass
class RowStats:
    """One request's decayed acceptance counts and what the policy chose for it.

    hits[j-1], trials[j-1]: drafted tokens at depth j accepted / tried (parent accepted)
    seen, predicted: accepted children vs the sum of their confidences (for kappa)
    """

    prior: float
    strength: float = PRIOR_STRENGTH  # depth 1's prior, in trials (RateSpread.strength)
    base: float = 0.5  # the drafter's own prior (``pooled`` starts from it)
    fixed: bool = False  # seeded sampling with drafts that may be sampled: keep the fixed shape (new_row)
    hits: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    trials: list[float] = field(default_factory=lambda: [0.0] * MAX_DEPTH)
    seen: float = 0.0
    predicted: float = 0.0
    off_streak: int = 0
    probe_every: int = PROBE_START
    off_steps: int = 0
    offers: float = 0.0  # decayed drafter calls that drafted something for this row, of ...
    calls: float = 0.0  # ... decayed calls (a lookup finds no match on most steps)
    look_saved: float = 0.0  # seconds the looks of the current trial saved (negative: lost)
    look_count: int = 0  # looks in the current trial
    look_pause: int = 0  # steps until this row may look again
    window: list[int] = field(default_factory=lambda: [0, 0])  # depth-1 (hits, trials) since the last WINDOW

    @property
    def offer_rate(self) -> float:
        """P(a drafter call drafts anything for this row): prior 1 (every call), decayed
        evidence. The a_j are rates given an offer; a plan weighs them by this."""
        return (PRIOR_STRENGTH + self.offers) / (PRIOR_STRENGTH + self.calls)

    def rates(self, depth: int, spread: float = 0.0) -> list[float]:
        """a_1..a_depth: depth j's posterior mean, its prior mean being depth j-1's; with
        ``spread`` z, depth 1's mean plus z posterior standard deviations (capped at 1)."""
        out, mean = [], self.prior
        for j in range(min(depth, MAX_DEPTH)):
            strength = self.strength if j == 0 else PRIOR_STRENGTH
            n = strength + self.trials[j]
            mean = (strength * mean + self.hits[j]) / n
            if j == 0 and spread:
                mean = min(mean + spread * math.sqrt(mean * (1 - mean) / (n + 1)), 1.0)
            out.append(mean)
        return out + [out[-1] if out else self.prior] * (depth - len(out))

    @property
    def kappa(self) -> float:
        """Calibration of the drafter's confidences: accepted / predicted, prior 1."""
        return (PRIOR_STRENGTH + self.seen) / (PRIOR_STRENGTH + self.predicted)

    @property
    def probe_due(self) -> bool:
        return self.off_streak >= self.probe_every

    def forget(self) -> None:
        """Decay the evidence one step. Also on steps off: a row whose rates dipped below
        break-even would otherwise keep them (no drafting, no evidence) until a probe, and
        at 4 rows, where the shipped head's one-token drafts gain 3-7% on average, the
        policy sat off on 39% of row-steps; aged evidence returns to the pooled prior."""
        for j in range(MAX_DEPTH):
            self.hits[j] *= DECAY
            self.trials[j] *= DECAY
        self.seen *= DECAY
        self.predicted *= DECAY

    def count(self, offered: int, accepted: int, predicted: list[float] | None) -> None:
        """A drafted step: ``offered`` depths verified, ``accepted`` kept; predicted[j]: the
        summed confidence of depth j's candidates under the accepted path (NaN: none)."""
        self.forget()
        for j in range(min(accepted + 1, offered, MAX_DEPTH)):  # depths 1..k+1 were tried
            hit = float(j < accepted)
            self.hits[j] += hit
            self.trials[j] += 1
            if predicted is not None and j + 1 < len(predicted) and not math.isnan(predicted[j + 1]):
                self.seen += hit
                self.predicted += predicted[j + 1]
        if offered:
            self.window[0] += accepted > 0
            self.window[1] += 1

    def full_window(self) -> tuple[int, int] | None:
        """Depth 1's (hits, trials) of the last WINDOW trials once there are that many (then
        starts a new window), else None."""
        if self.window[1] < WINDOW:
            return None
        full, self.window = tuple(self.window), [0, 0]
        return full


class RateSpread:
    """How much a drafter's depth-1 rate varies between stretches of text, beyond chance: the
    strength of the Beta prior a row's own evidence is weighed against (empirical Bayes).

    Windows of n = WINDOW trials with rates r_i (weights w_i decaying per window): mean m,
    reliability-weighted variance v; binomial noise m (1 - m) / n of v is chance, the rest
    the spread of the true rates, and a Beta(m k, (1 - m) k) has variance m (1 - m) / (k + 1):
        k = m (1 - m) / (v - m (1 - m) / n) - 1, clamped to [PRIOR_STRENGTH, STRENGTH_MAX].
    Example: windows all at 0.2 +- chance -> v ~ 0.008 = noise -> STRENGTH_MAX; lookup
    (windows at 0.05 or 0.8) -> v ~ 0.14 -> ~PRIOR_STRENGTH."""

    def __init__(self):
        self.w = self.w2 = self.s1 = self.s2 = 0.0  # decayed sums of w, w^2, w r, w r^2

    def add(self, hits: int, trials: int) -> None:
        r = hits / trials
        d = SPREAD_DECAY
        self.w, self.w2 = d * self.w + 1.0, d * d * self.w2 + 1.0
        self.s1, self.s2 = d * self.s1 + r, d * self.s2 + r * r

    def strength(self) -> float:
        if self.w < SPREAD_MIN:
            return PRIOR_STRENGTH
        m = self.s1 / self.w
        v = (self.s2 / self.w - m * m) * self.w ** 2 / (self.w ** 2 - self.w2)  # unbiased for few windows
        between = v - m * (1 - m) / WINDOW
        if between <= 0:
            return STRENGTH_MAX
        return min(max(m * (1 - m) / between - 1, PRIOR_STRENGTH), STRENGTH_MAX)
