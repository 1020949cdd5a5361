"""One request's acceptance evidence, as the adaptive policy (``adaptive.py``) reads it.

a_j = P(the drafted token at depth j is accepted | depth j - 1 was), from decayed counts
with a Beta prior of PRIOR_STRENGTH pseudo-trials: depth 1's prior mean is the drafter's
pooled evidence over the requests so far (``AdaptivePolicy.pooled``), depth j's is depth
j - 1's estimate. Example: prior 0.3, 10 depth-1 trials with 2 hits -> a_1 = (2 x 0.3 + 2) /
(2 + 10) = 0.217. Beside the a_j: the offer rate (how often a drafter call drafts anything
for this row; the a_j are given an offer) and kappa, the calibration of the drafter's own
per-token confidences.
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


@dataclass
class RowStats:
    """One request's decayed acceptance counts and what the policy chose for it.

    hits[j-1], trials[j-1]: drafted tokens at depth j accepted / tried (parent accepted)
    seen, predicted: accepted children vs the sum of their confidences (for kappa)
    """

    prior: float
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
            n = PRIOR_STRENGTH + self.trials[j]
            mean = (PRIOR_STRENGTH * mean + self.hits[j]) / n
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
