"""What drafter calls and engine steps really cost, learnt on line (the adaptive policy's clocks).

``costmodel.CostModel`` times bare target forwards once, on a quiet machine. A real step also
packs the tree, builds masks, accepts and commits, a drafter call has its own cost, and the
machine may be busier now than when the curve was measured. Two small estimators correct
for that as steps run:

- ``DraftTimer``: seconds of a drafter call, by the depth it was allowed.
- ``StepCostRatio``: measured step seconds over the curve's, per step kind (plain, tree)
  and batch size, factored into a machine level shared by both kinds and a per-kind
  relation, so a kind the policy stopped choosing still follows the machine.
"""

from __future__ import annotations

import math


class DraftTimer:
    """Seconds a drafter call takes, by the depth it was allowed: an EWMA per depth.

    The first call is not recorded: it pays one-time costs (allocations, kernel selection;
    the shipped ReDrafter head: 13-19 ms against ~4.3 ms for every later call), and a depth
    the policy then stops asking for would keep that reading for good.

    Calls in steady state (the previous step drafted too) and calls that catch up (after
    plain steps, or rows joining) are kept apart: a draft model first feeds every token made
    since its last call, so at 16 rows a catch-up call took ~40 ms where a steady one takes
    ~5, and more the longer the rows were off. ``catch_up()`` prices a call after ``gap``
    plain steps (a probe) as the steady call plus ``per_step`` seconds per step missed,
    learnt from calls after plain steps (calls after rows joined feed whole prompts, once:
    not recorded); a plan to draft from now on is priced by the steady calls.

    Depths are the depths calls really drafted to (``AdaptivePolicy.call_depth``, never
    beyond ``Drafter.max_depth``), and one reading moves an estimate by at most MAX_JUMP x
    before weighting: the plan stops asking for a depth that looks dear, and then never
    re-times it."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.seconds = weight, {}
        self.per_step = 0.0  # EWMA: a catch-up call's seconds beyond a steady one, per plain step missed
        self.gap = 0  # plain steps the next call catches up on (set by the policy's plan)
        self.calls = 0
        self.last = 0.0  # seconds of the latest call (a probe is billed with it)

    def record(self, depth: int, seconds: float, steady: bool = True) -> None:
        self.calls += 1
        self.last = seconds
        if self.calls == 1:
            return
        if not steady:
            if self.gap > 0:  # after plain steps, not (only) rows joining
                reading = max(seconds - self(depth), 0.0) / self.gap
                self.per_step = (1 - self.weight) * self.per_step + self.weight * reading if self.per_step else reading
            return
        old = self.seconds.get(depth)
        if old is None:
            self.seconds[depth] = seconds
        else:  # a stalled call moves the estimate by at most MAX_JUMP x: the plan may stop asking for that depth
            self.seconds[depth] = (1 - self.weight) * old + self.weight * min(seconds, MAX_JUMP * old)

    def catch_up(self, depth: int) -> float:
        """Estimate for a call at ``depth`` after ``gap`` plain steps: the steady call's plus
        ``per_step`` per step missed."""
        return self(depth) + self.per_step * self.gap if depth > 0 else 0.0

    def per_depth(self) -> float:
        """Seconds one more depth adds: the slope between the two shallowest depths seen,
        else the one seen depth's seconds over its depth (as if cost grew with depth); 0
        before any call was timed."""
        seen = sorted(self.seconds.items())
        if len(seen) >= 2:
            (d0, s0), (d1, s1) = seen[:2]
            return max(s1 - s0, 0.0) / (d1 - d0)
        return seen[0][1] / seen[0][0] if seen else 0.0

    def __call__(self, depth: int) -> float:
        """Estimate for ``depth`` (0: no call). Unseen depths scale the nearest seen one; never
        below a shallower depth's (drafting deeper is never cheaper: ``best_size`` relies on
        step seconds that do not fall with n)."""
        if depth <= 0 or not self.seconds:
            return 0.0
        near = min(self.seconds, key=lambda d: (abs(d - depth), d))
        shallower = max((v for d, v in self.seconds.items() if d <= depth), default=0.0)
        return max(self.seconds[near] * max(1.0, depth / near), shallower)


RATIO_RANGE = (0.01, 100.0)  # a reading outside is clamped: one wild reading cannot dominate
# One reading moves the estimate by at most this factor before weighting: a stall (another
# process, a page fault) of one step must not outweigh the next twenty normal ones.
MAX_JUMP = 2.0
# A plain step is taken after this many tree steps at a batch size without one: a policy that
# drafts on every step never sees the plain kind, so a curve whose tree / plain relation is
# wrong (a cost model measured beside another job: a 16 x 2 tree 1.09x a plain step, really
# 1.54x) would stand for good. One plain step in 64 costs at most 1/64 of drafting's gain;
# until a plain step has been recorded at a batch size (the first of a kind never is), one
# in 16, so that a 100-step batch is corrected in its first half.
PLAIN_EVERY, PLAIN_FIRST = 64, 16


class StepCostRatio:
    """Measured step seconds (drafting excluded) over the cost model's forward, per step
    kind (tree or plain) and batch size (rows, in power-of-two buckets b).

    In logs: ratio(kind, b) = level[b] + relation[kind, b]. A reading of either kind at b
    moves level[b] (the machine's state at that size: another job slows both kinds) and
    its own kind's relation (what that kind costs beyond the curve: tree packing, masks,
    acceptance), each by ``weight / 2`` of the clipped log error, so the reading's own
    kind moves by ``weight`` and the other kind by half that. Why: the policy compares
    the kinds at one batch size and, once one kind wins, stops seeing the other. With one
    independent EWMA per kind, a stall that inflated the plain ratio (x2 in one bench) was
    never corrected, trees looked cheaper than plain steps, and the batch drafted on every
    step (docs/engine.md, "Step-cost ratios").

    Per batch size because one ratio per kind once made 16-row trees look cheap (a 4-row
    batch's tree steps against 16-row plain steps). Unseen keys: a kind never seen at b
    takes the other kind's ratio times the tree / plain relation of the nearest size where
    both were seen (1 if none: the curve's own relation stands); an unseen size takes the
    nearest seen size's figures. The first step of each kind is not recorded (one-time
    costs, as ``DraftTimer``)."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.level: dict[int, float] = {}  # b -> log level
        self.relation: dict[tuple[bool, int], float] = {}  # (tree, b) -> log relation
        self.skipped: set[bool] = set()
        self.since_plain: dict[int, int] = {}  # b -> tree readings since the last plain one

    @staticmethod
    def bucket(rows: int) -> int:
        """1, 2, 4, 8, ...: the smallest power of two >= rows."""
        return 1 << max(int(rows) - 1, 0).bit_length()

    @property
    def ratio(self) -> dict[tuple[bool, int], float]:
        """Every seen (tree, b) -> its current ratio."""
        return {key: math.exp(self.level[key[1]] + rel) for key, rel in self.relation.items()}

    def plain_due(self, rows: int) -> bool:
        """Whether the batch size of ``rows`` has gone PLAIN_EVERY tree steps without a plain
        one (PLAIN_FIRST while no plain step is recorded there)."""
        b = self.bucket(rows)
        return self.since_plain.get(b, 0) >= (PLAIN_EVERY if (False, b) in self.relation else PLAIN_FIRST)

    def record(self, tree: bool, rows: int, measured: float, modelled: float) -> None:
        b = self.bucket(rows)
        key = (tree, b)
        self.since_plain[b] = self.since_plain.get(b, 0) + 1 if tree else 0
        if tree not in self.skipped:
            self.skipped.add(tree)
            return
        reading = math.log(min(max(measured / max(modelled, 1e-12), RATIO_RANGE[0]), RATIO_RANGE[1]))
        if key not in self.relation:  # a first reading is taken as it is
            self.level.setdefault(b, reading)
            self.relation[key] = reading - self.level[b]
            return
        error = reading - (self.level[b] + self.relation[key])
        error = min(max(error, -math.log(MAX_JUMP)), math.log(MAX_JUMP))
        self.level[b] += self.weight / 2 * error
        self.relation[key] += self.weight / 2 * error

    def __call__(self, tree: bool, rows: int = 1) -> float:
        b = self.bucket(rows)
        if (tree, b) in self.relation:
            return math.exp(self.level[b] + self.relation[(tree, b)])
        if (not tree, b) in self.relation:
            return self(not tree, b) * self._relation(tree, b)
        if not self.level:
            return 1.0
        near = min(self.level, key=lambda size: (abs(size.bit_length() - b.bit_length()), size))
        return self(tree, near)

    def _relation(self, tree: bool, b: int) -> float:
        """ratio(tree) / ratio(not tree) at the nearest size where both kinds were seen (1: none)."""
        both = [size for (kind, size) in self.relation if kind and (False, size) in self.relation]
        if not both:
            return 1.0
        near = min(both, key=lambda size: (abs(size.bit_length() - b.bit_length()), size))
        return math.exp(self.relation[(tree, near)] - self.relation[(not tree, near)])
