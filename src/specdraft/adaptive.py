"""Adaptive drafting: per step, draft only as much as pays on this machine (issue 15).

Three parts, all plain objects the engine takes (tests pass synthetic ones):

- ``costmodel.CostModel``: seconds of one target forward of B rows x N padded tree tokens
  (the packed tree is padded to its longest row, and every padded slot is computed), plus an
  attention term growing with the cached width. Measured once per target / dtype / device /
  threads with the ``bench --verify-cost`` code (and at a few batch sizes) and cached on disk
  (``costmodel.load_cost_model``). ``steptime.StepCostRatio`` corrects it on line: per step kind
  (plain, tree) and batch size, measured step seconds over the curve's, so the overheads of
  tree steps (packing, masks, acceptance) and a machine busier than when the curve was
  measured are paid for.
- ``rowstats.RowStats``: one request's acceptance evidence. a_j = P(the drafted token at depth j is
  accepted | depth j - 1 was) from decayed counts with a Beta prior (depth 1: the drafter's
  pooled evidence over the requests so far, from its ``acceptance_prior``; depth j's prior
  mean is depth j - 1's estimate), the row's offer rate (how often a drafter call drafts
  anything for it: the a_j are given an offer), and kappa, the calibration of the
  drafter's own per-token confidences c (``Proposal.confidence``).
- ``AdaptivePolicy``: before drafting, ``plan`` picks the batch's depth n from the a_j alone
  (n = 0: no drafter call, the plain one-token step; but a cheap drafter with confidences
  is asked anyway, a "look": see LOOK_SHARE); after drafting, ``choose`` keeps per
  row the n most valuable tree nodes, n chosen for the batch. A node's value is the
  probability that it is accepted: the product along its path of p = min(1, kappa c), or
  a_j (1 - a_j)^rank without a confidence (rank = its index among siblings). With
  rates v and padded cost,

      n* = argmax_n  (B + sum_b sum_{top min(n, count_b) nodes of b} v)
                     / (cost(B (1 + n), width, B) r(n > 0) + draft(n))

  (r: the step-cost ratio of the step's kind; in a static batch each row's sum is weighed
  by its chance to finish last, ``finish_weights``), exact for the padded cost model: since v
  never grows along a path (p <= 1), each row's top-k nodes form a prefix-closed subtree,
  and every row may fill up to n at no extra cost. Ties pick the smaller n (cheaper).

The policy only shapes proposals, never acceptance, so exactness is unchanged. One rule
keeps it so for *sampled* drafts (a proposal with q): their depth must not depend on the
drawn tokens (cutting a chain after seeing x_j ~ q_j biases min(1, p/q)), so for those
rows confidences are ignored and only the history-based a_j count.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import replace
from itertools import accumulate

import torch

from .costmodel import CostModel
from .rowstats import DECAY, MAX_DEPTH, POOL_DECAY, PRIOR_STRENGTH, PROBE_MAX, PROBE_START, RateSpread, RowStats
from .steptime import DraftTimer, StepCostRatio
from .tree import node_values, row_owners

# Probes draft where the estimates say it does not pay, to find out whether that changed. One pads
# the whole batch's tree (at 16 rows taking turns: 0.85x plain decoding), so due rows probe together,
# paid from a credit of EXPLORE_SHARE of the decode time, falling to EXPLORE_MIN while probes fail.
EXPLORE_SHARE, EXPLORE_MIN, PROBE_DECAY = 0.03, 0.005, 0.9
PLAUSIBLE_RATE = 0.9  # the best rate a probe may find (lookup on repeated text); see probe_could_pay
# A drafter with confidences whose call costs at most this share of a plain step may be asked where
# the rates say drafting does not pay ("a look"): ``choose`` keeps what its calibrated confidences
# find worth verifying (often nothing): the head at batch 1 without looks: 0.95x its fixed 1x3. A
# ceiling only (looks are judged per request); at 0.1 the head's call (~4.3 ms of 32-44) sat on the line.
LOOK_SHARE = 0.25
# A look step making B + G tokens in s seconds saved (B + G) / B * t_plain - s (t_plain: the modelled
# plain step); every LOOK_TRIAL looks of a request, a net loss pauses its looks for LOOK_PAUSE steps.
LOOK_TRIAL, LOOK_PAUSE = 8, 32
# Looks only for batches of at most this many rows (MT-Bench 16 x 128, bf16): at batch 1 looks took
# the head from 0.95x to 0.99x of its best fixed shape; at 16, ``choose`` deciding every step, its
# trees did not pay (cost(32) ~1.6x cost(16), optimistic values): 0.76x plain decoding.
LOOK_MAX_ROWS = 1
# Batches that cannot look turn drafting on only where its expected rate beats a plain step's by
# this much: at 16 rows a 16 x 2 tree modelled at 1.47x a plain step (really 1.55x) met fresh rows'
# pooled rate 0.5: marginal plans lost, the head 0.955x (server) with drafting off on 91% of steps.
ON_MARGIN = 0.05
# Drafters may draft SLACK deeper than planned, where confidences may justify it: in batches that
# may look (at 4 rows, one more token on every step cost the head 1.7x its fixed shape's drafting
# time), and only if one more depth costs at most SLACK_SHARE of a plain step (``slack``).
SLACK, SLACK_SHARE = 1, 0.05
STAY_ON_SPREAD = 1.0  # posterior deviations a drafting row's rate must fall below break-even (stays_on)


def best_size(gains: list[list[float]], counts: list[int], seconds, weights: list[float] | None = None) -> int:
    """The batch's node count n maximising expected tokens per second.

    gains[b][k] = expected accepted drafted tokens of row b's best k nodes (gains[b][0] = 0,
    non-decreasing, k <= counts[b]); seconds(n): step time when the longest row verifies
    1 + n tokens; weights[b] (summing to B, default 1 each): what row b's tokens are worth
    (``finish_weights``). Ties: smallest n. Plain Python: B x (n + 1) <= 16 x 17 additions
    cost less than the torch ops that would do them (each ~10 us on the host). The scan
    stops once even every row's whole gain over seconds(n) cannot beat the best (seconds
    never falls with n): at 16 rows with drafting off it ends at n = 1, not 16."""
    B, last = len(gains), max(counts, default=0)
    ceiling = B + expected_gain(gains, counts, weights, last)
    best, best_rate, step = 0, -1.0, seconds(0)
    for n in range(last + 1):
        rate = (B + expected_gain(gains, counts, weights, n)) / step
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
        if n == last:
            break
        step = seconds(n + 1)
        if ceiling / step <= best_rate * (1 + 1e-9):
            break
    return best


def expected_gain(gains: list[list[float]], counts: list[int], weights: list[float] | None, n: int) -> float:
    """The batch's expected accepted drafted tokens at size ``n`` (``best_size``'s terms)."""
    weights = weights or [1.0] * len(gains)
    return sum(w * g[min(n, c)] for g, c, w in zip(gains, counts, weights))


def pays_clearly(gains: list[list[float]], counts: list[int], seconds, weights: list[float] | None, n: int) -> bool:
    """Whether size ``n``'s expected tokens per second (``best_size``'s terms) beat a plain
    step's by ON_MARGIN."""
    B = len(gains)
    return (B + expected_gain(gains, counts, weights, n)) / seconds(n) >= (1 + ON_MARGIN) * B / seconds(0)


def finish_weights(remaining: list[int]) -> list[float]:
    """What each row's accepted tokens are worth in a *static* batch (``engine.generate``:
    the call returns when its last row finishes), as weights summing to B.

    remaining[b]: tokens row b may still generate. A row well ahead of the one with the most
    left will not be the last to finish, so what it accepts does not shorten the call; the
    rows that lag decide. Row b's lead d_b = r_max - r_b is weighed against the spread of
    the rows' finishing points, sigma = sqrt(r_max) / 2 (each step's accepted count is a
    draw of variance <= 1/4 per drafted token): w_b ∝ exp(-d_b / sigma). Rows that are
    level (a batch just started) weigh 1 each: the throughput objective. Example: remaining
    [100, 100, 80] -> sigma 5, weights ≈ [1.49, 1.49, 0.03]. It assumes rows run to their
    limits (a row that will stop at an end-of-sequence token sooner is not known to); under
    continuous batching (the server) a finished row's slot is refilled at once and every
    token counts: no weights."""
    top = max(remaining, default=0)
    sigma = max(math.sqrt(top) / 2, 0.5)
    raw = [math.exp(-(top - r) / sigma) for r in remaining]
    scale = len(raw) / sum(raw) if raw else 0.0
    return [w * scale for w in raw]


def chain_gains(values: list[float], offered: float = 1.0) -> list[float]:
    """[0, v1, v1 + v1 v2, ...]: expected accepted tokens of a chain's first k tokens, each
    accepted with conditional probability v_j once its parent is; times ``offered``, the
    chance that the drafter drafts at all (``RowStats.offer_rate``)."""
    return [offered * g for g in accumulate(accumulate(values, operator.mul), initial=0.0)]


# ---- the policy --------------------------------------------------------------------------


class AdaptivePolicy:
    """Chooses each step's drafting depth for the whole batch (see the module docstring)."""

    def __init__(self, cost: CostModel, prior: float | None = None):
        """``prior``: acceptance prior for every drafter (default: the drafter's own
        ``acceptance_prior``)."""
        self.cost, self.prior = cost, prior
        self.draft_time = DraftTimer()
        self.step_ratio = StepCostRatio()
        self.extra = 0  # depth the engine drafts beyond the plan this step (``slack``)
        self.reach = MAX_DEPTH  # the deepest the drafter can draft this step (``plan``'s budget)
        self.probe_credit = 0.0  # seconds of exploration earned (explore_share of each step)
        self.probe_bill: tuple[float, float] | None = None  # a probe's (charged, plain) seconds (settle_probe)
        self.probe_record: dict[int, tuple[float, float]] = {}  # batch bucket -> decayed (wins, probes)
        self.probed_rows = 0  # rows of the last plan's probe, judged at the next plan (0: none)
        self.probing = False  # the last plan drafted only because a probe was due and paid for
        self.looking = False  # the last plan drafted only to let the confidences choose
        self.staying = False  # the last plan drafted only because its row had been (stays_on)
        self.confident = False  # the last proposal had confidences the policy could use
        self.pool_hits = self.pool_trials = 0.0  # decayed depth-1 evidence of every request (POOL_DECAY)
        self.spread = RateSpread()  # how far a request's depth-1 rate strays from the pool

    def new_row(self, drafter, params=None) -> RowStats:
        """Stats for a new request. A seeded request keeps the fixed shape if its drafts
        may be sampled: how deep they are verified changes its text (deterministic drafts
        never do, docs/engine.md), so adapting would tie a seed's output to timings.
        Depth 1's prior: the pooled evidence of the requests so far (``POOL_DECAY``), as
        strong as the rates' spread between windows of text says (``RateSpread``)."""
        base = self.prior if self.prior is not None else getattr(drafter, "acceptance_prior", 0.5)
        base = min(max(float(base), 0.0), 1.0)
        fixed = params is not None and params.seeded and drafter.may_sample_drafts()
        return RowStats(prior=self.pooled(base), strength=self.spread.strength(), base=base, fixed=fixed)

    def pooled(self, base: float) -> float:
        """The drafter's pooled depth-1 rate so far, its own prior ``base`` counting as
        PRIOR_STRENGTH trials."""
        return (PRIOR_STRENGTH * base + self.pool_hits) / (PRIOR_STRENGTH + self.pool_trials)

    def seconds(self, rows: int, width: int, draft_depth: int = 0, drafted: float | None = None,
                catch_up: bool = False, offered: float = 1.0):
        """n -> seconds of a step whose longest row verifies 1 + n tokens. Drafting: the
        ``drafted`` seconds already spent this step (the same for every n), else the timer's
        estimate for the depth the step would draft, n + slack but at most ``self.reach`` (a call
        after plain steps' if ``catch_up``).
        ``offered``: P(the call drafts for any row); if it drafts for none, the step runs plain
        (a lookup without a match at 4 rows: priced as trees, its plans lost to its fixed shape)."""
        timer = self.draft_time.catch_up if catch_up else self.draft_time
        plain = self.cost(rows, width, rows) * self.step_ratio(False, rows)
        extra = self.slack(rows, plain)
        # Never below the curve's tree / plain relation: a ratio learnt on 3-token-a-row trees a
        # noisy curve put at 1.95x plain (really 1.6x) priced 2 a row at 1.26x (really 1.55x).
        tree = max(self.step_ratio(True, rows), self.step_ratio(False, rows))

        def step(n: int) -> float:
            draft = drafted if drafted is not None else timer(draft_depth or (n and self.call_depth(n, extra)))
            # a tree step is never cheaper than a plain one (the ratios are estimates)
            verify = max(self.cost(rows * (1 + n), width, rows) * tree, plain) if n else plain
            return offered * verify + (1 - offered) * plain + draft
        return step

    def call_depth(self, n: int, extra: int | None = None) -> int:
        """How deep the drafter call of a step planned at ``n`` drafts: n + slack (``extra``,
        default the plan's), at most the reach ``plan`` saw (timed under that depth: ``DraftTimer``)."""
        return min(n + (self.extra if extra is None else extra), self.reach)

    def slack(self, rows: int, plain: float) -> int:
        """Depth to draft beyond the plan (SLACK or 0), a plain step taking ``plain`` seconds: a
        head's extra beam step ~1 ms (3% of a bf16 SmolLM2 step); a draft model's extra forward
        ~5 ms (15%), which kept drafting off on 48% of MT-Bench steps at batch 1."""
        if rows > LOOK_MAX_ROWS:
            return 0
        return SLACK if self.draft_time.per_depth() <= SLACK_SHARE * plain else 0

    def observe_step(self, tree: bool, rows: int, tokens: int, width: int, seconds: float) -> None:
        """A finished step of ``rows`` rows: ``tokens`` padded tree tokens over the batch (rows
        for a plain step) with ``width`` cached slots took ``seconds`` of wall time, drafting
        excluded."""
        self.step_ratio.record(tree, rows, seconds, self.cost(tokens, width, rows))
        self.probe_credit += self.explore_share(rows) * seconds
        self.settle_probe(seconds)

    def settle_probe(self, seconds: float) -> None:
        """After a probe step that took ``seconds`` (drafting excluded; its drafter call is the
        timer's latest): bill the credit what the probe really added to the modelled plain step,
        beyond what ``afford_probe`` charged, so probes cost their share of the decode time
        whatever the estimates said (a draft model's call after a long plain stretch feeds
        every token it missed, at 16 rows ~100 each)."""
        if self.probe_bill is None:
            return
        charged, plain = self.probe_bill
        self.probe_bill = None
        self.probe_credit -= max(seconds + self.draft_time.last - plain, 0.0) - charged

    def explore_share(self, rows: int) -> float:
        """Share of step time earned as probe credit at this batch size: EXPLORE_SHARE while
        probes turn drafting on, falling towards EXPLORE_MIN while they do not."""
        wins, probes = self.probe_record.get(StepCostRatio.bucket(rows), (0.0, 0.0))
        return EXPLORE_MIN + (EXPLORE_SHARE - EXPLORE_MIN) * (1 + wins) / (1 + probes)

    def judge_probe(self, n: int) -> None:
        """The plan after a probe step chose ``n`` from the rates the probe updated: a win
        if it drafts (the probe found that drafting pays)."""
        if self.probed_rows:
            key = StepCostRatio.bucket(self.probed_rows)
            wins, probes = self.probe_record.get(key, (0.0, 0.0))
            self.probe_record[key] = (PROBE_DECAY * wins + (n > 0), PROBE_DECAY * probes + 1)
            self.probed_rows = 0

    def plan(self, stats: list[RowStats], budget: torch.Tensor, width: int,
             weights: list[float] | None = None, reach: int | None = None) -> int:
        """Depth to draft this step (0: drafting off, no drafter call), from the rates alone.

        budget (B,): tokens a row may hold, g0 included (so it drafts <= budget - 1);
        reach: the deepest one drafter call can draft (``Drafter.max_depth``, None: no bound),
        so deeper gains, which are not there, are never priced;
        weights: what each row's tokens are worth (``finish_weights``; None: 1 each).
        ``self.probing`` says whether the depth is a probe's (``afford_probe``)."""
        self.probing = self.looking = self.staying = False
        self.extra = 0
        self.draft_time.gap = max((s.off_streak for s in stats), default=0)  # what a call now catches up on
        counts = (budget - 1).clamp(min=0, max=MAX_DEPTH if reach is None else min(reach, MAX_DEPTH)).tolist()
        depth = self.reach = max(counts, default=0)
        if any(s.fixed for s in stats):  # never off: a fixed row's verification must not change
            return max(depth, 1)
        if depth == 0 or self.step_ratio.plain_due(len(stats)):  # steptime.PLAIN_EVERY
            return 0
        # A row's expected gain counts only calls that draft for it (a lookup's rows without
        # a match add nothing but still pad the tree): the rates are given an offer.
        gains = [chain_gains(s.rates(depth), s.offer_rate) for s in stats]
        seconds = self.seconds(len(stats), width, offered=1 - math.prod(1 - s.offer_rate for s in stats))
        self.extra = self.slack(len(stats), seconds(0))  # the engine drafts to depth + extra
        n = best_size(gains, counts, seconds, weights)
        # After a probe the rows were not "on": a failed probe must not stay on (nor count as a win).
        self.staying = n == 0 and not self.probed_rows and self.stays_on(stats, counts, seconds, weights)
        n = 1 if self.staying else n
        if n and len(stats) > LOOK_MAX_ROWS and not pays_clearly(gains, counts, seconds, weights, n):
            n = 0
        self.judge_probe(n)
        if n == 0 and len(stats) <= LOOK_MAX_ROWS and not any(s.look_pause for s in stats) and \
                self.look_is_cheap(seconds, depth):
            self.looking = True
            return depth
        probe_seconds = self.seconds(len(stats), width, catch_up=True)
        self.probing = n == 0 and self.afford_probe(stats, counts, seconds, weights, probe_seconds)
        self.probed_rows = len(stats) if self.probing else 0
        return 1 if self.probing else n

    @staticmethod
    def stays_on(stats: list[RowStats], counts: list[int], seconds, weights=None) -> bool:
        """Whether a batch that may look (one row) and drafted on its last step drafts on
        though its rates' means say off: it stops once depth 1's rate is below break-even by
        STAY_ON_SPREAD posterior deviations. A rate rests on ~20 decayed trials (sd ~0.1): the
        shipped draft model (0.26 against a 0.17 break-even at batch 1) dipped below on 38% of
        MT-Bench steps, and the steps it kept accepted no more (0.265) than fixed gamma = 1's
        all did (0.26): noise, not evidence, and 0.96x the fixed shape. Not right after a
        probe (``plan`` checks): a row that drafted only to probe was not on."""
        if len(stats) > LOOK_MAX_ROWS or not all(s.off_streak == 0 and s.trials[0] for s in stats):
            return False
        depth = max(counts, default=0)
        gains = [chain_gains(s.rates(depth, STAY_ON_SPREAD), s.offer_rate) for s in stats]
        return best_size(gains, counts, seconds, weights) > 0

    @property
    def must_verify(self) -> bool:
        """Whether this step's proposal must keep a drafted token (``choose``'s ``probe``):
        the plan drafted to learn (a probe) or to stay on (``stays_on``), not for its means."""
        return self.probing or self.staying

    def look_is_cheap(self, seconds, depth: int) -> bool:
        """Whether drafting to ``depth`` only to let the confidences choose costs at most
        ``LOOK_SHARE`` of a plain step (see LOOK_SHARE). Needs a drafter call timed before
        and a last proposal with usable confidences."""
        if not self.confident or not self.draft_time.seconds:
            return False
        return self.draft_time(depth) <= LOOK_SHARE * seconds(0)  # a look drafts to the reach

    def observe_look(self, stats: list[RowStats], gained: int, seconds: float, width: int) -> None:
        """A look step (``self.looking``) made B + ``gained`` tokens in ``seconds`` (wall,
        drafting included): add what it saved against plain decoding to each row's trial;
        a trial of LOOK_TRIAL looks that lost time pauses the rows' looks (LOOK_PAUSE steps)."""
        B = len(stats)
        plain = self.seconds(B, width)(0)  # the modelled plain step
        saved = (B + gained) / max(B, 1) * plain - seconds
        for s in stats:
            s.look_saved += saved
            s.look_count += 1
            if s.look_count >= LOOK_TRIAL:
                s.look_pause = LOOK_PAUSE if s.look_saved < 0 else 0
                s.look_saved, s.look_count = 0.0, 0

    @staticmethod
    def probe_could_pay(stats: list[RowStats], counts: list[int], seconds, weights=None) -> bool:
        """Whether drafting would pay were every due row's rates at PLAUSIBLE_RATE (still
        weighed by its offer rate): a probe can only find out what could change the plan.
        At 4 rows, lookup's rows (offered on a minority of calls) rarely could, and a logged
        run spent 9% of its steps on probes (each pads every row's tree)."""
        depth = max(counts, default=0)
        gains = [chain_gains([PLAUSIBLE_RATE] * depth if s.probe_due else s.rates(depth), s.offer_rate)
                 for s in stats]
        return best_size(gains, counts, seconds, weights) > 0

    def afford_probe(self, stats: list[RowStats], counts: list[int], seconds, weights=None,
                     probe_seconds=None) -> bool:
        """Whether some row is due for a probe, the credit pays for what it adds to this step
        (probe_seconds(1) - seconds(0): the padded tree and a catch-up drafter call) and the
        probe could change the plan (``probe_could_pay``); if so, spend the credit."""
        if not any(s.probe_due for s in stats):
            return False
        extra = max((probe_seconds or seconds)(1) - seconds(0), 0.0)
        self.probe_credit = min(self.probe_credit, 2 * extra)  # no burst after a long quiet stretch
        if self.probe_credit < extra or not self.probe_could_pay(stats, counts, seconds, weights):
            return False
        self.probe_credit -= extra
        self.probe_bill = (extra, seconds(0))
        self.draft_time.last = 0.0  # a probe step whose drafter call is not timed bills no call
        return True

    def choose(self, proposal, stats: list[RowStats], use_conf: torch.Tensor, width: int,
               draft_seconds: float, probe: bool, weights: list[float] | None = None) -> torch.Tensor:
        """The proposal's valid mask cut to the best n nodes per row (prefix-closed);
        ``weights`` as in ``plan``."""
        W = proposal.beams.shape[1]
        self.confident = proposal.confidence is not None and bool(use_conf.any())
        seconds = self.seconds(proposal.beams.shape[0], width, drafted=draft_seconds)
        if W == 1:
            return self.choose_chain(proposal, stats, use_conf, seconds, probe, weights)
        if proposal.q is not None:
            return self.choose_chains(proposal, stats, use_conf, seconds, probe, weights)
        return self.choose_tree(proposal, stats, use_conf, seconds, probe, weights)

    def choose_tree(self, proposal, stats: list[RowStats], use_conf: torch.Tensor, seconds,
                    probe: bool, weights: list[float] | None = None) -> torch.Tensor:
        """``choose`` for W deterministic beams per row (``proposal.valid`` prefix-closed).
        A node is a distinct prefix, kept by its owner beam (``tree.row_owners``); its value
        is the product of p along its path (``tree.node_values``). Each row ranks its nodes by
        value, parents first on ties (depth-major: depth, then owner beam), so every row's
        best k nodes form a prefix-closed subtree; n is chosen for the batch (``best_size``)
        and a beam keeps a token if the token's node is among its row's best n.

        On the host, in Python: a tree of a few nodes a row (the head's 2 x 3 at batch 1)
        took 0.4-0.6 ms a step as ~40 small torch ops (1-1.5% of a bfloat16 SmolLM2 step), 0.07 ms so."""
        B, W, L = proposal.beams.shape
        valid = proposal.valid.to(torch.int8).cumprod(dim=2).bool()
        beams, closed = proposal.beams.tolist(), valid.tolist()
        conf = proposal.confidence.float().tolist() if proposal.confidence is not None else [None] * B
        ranked_rows, gains = [], []
        for s, row_beams, row_valid, c, use in zip(stats, beams, closed, conf, use_conf.tolist()):
            owner = row_owners(row_beams, row_valid)
            values = node_values(owner, row_valid, s.rates(L - 1), s.kappa, c if use else None)
            ranked = sorted(values, key=lambda node: (-values[node], node))  # node = (depth, beam)
            ranked_rows.append((owner, ranked))
            gains.append(list(accumulate((values[node] for node in ranked), initial=0.0)))
        n = best_size(gains, [len(r) for _, r in ranked_rows], seconds, weights)
        n = max(n, 1) if probe and n == 0 else n
        keep = [[[True] * L for _ in range(W)] for _ in range(B)]
        for b, ((owner, ranked), s) in enumerate(zip(ranked_rows, stats)):
            if s.fixed:  # seeded sampling rows verify the whole proposal
                continue
            best = set(ranked[:n])
            for w in range(W):
                for j in range(1, L):
                    keep[b][w][j] = (j, owner[w][j]) in best
        kept = torch.tensor(keep, device=valid.device)
        return (valid & kept).to(torch.int8).cumprod(dim=2).bool()

    def choose_chain(self, proposal, stats: list[RowStats], use_conf: torch.Tensor, seconds,
                     probe: bool, weights: list[float] | None = None) -> torch.Tensor:
        """``choose`` for one beam per row (W = 1, the shipped head's and lookup's default
        shapes), with the same result: a chain's node values never grow along it, so its
        best k nodes are its first k, and no sibling ranks or prefix owners are needed. On
        the host, in Python: at batch 1 the general path's ~40 small torch ops cost ~1 ms a
        step (2% of a bf16 SmolLM2 step on the 2-core EPYC)."""
        B, _, L = proposal.beams.shape
        chain = proposal.valid.to(torch.int8).cumprod(dim=2).bool()  # prefix-closed, as choose's
        drafted = (chain[:, 0].sum(dim=1) - 1).tolist()
        conf = proposal.confidence
        conf = conf[:, 0].float().tolist() if conf is not None else [None] * B
        use = use_conf.tolist()
        gains = []
        for s, k, c, u in zip(stats, drafted, conf, use):
            a = s.rates(k)
            if c is not None and u:  # NaN (no confidence for that token) falls back to a_j
                kappa = s.kappa
                a = [r if math.isnan(x) else min(max(kappa * x, 0.0), 1.0) for r, x in zip(a, c[1:])]
            gains.append(chain_gains(a))
        n = best_size(gains, drafted, seconds, weights)
        n = max(n, 1) if probe and n == 0 else n
        keep = torch.arange(L, device=proposal.valid.device) <= n
        fixed = torch.tensor([s.fixed for s in stats], device=keep.device)[:, None, None]
        return chain & (keep | fixed)

    def choose_chains(self, proposal, stats: list[RowStats], use_conf: torch.Tensor, seconds,
                      probe: bool, weights: list[float] | None = None) -> torch.Tensor:
        """``choose`` for W sampled chains (q set): one depth for all of a row's chains, as
        ``choose_chain`` picks it for the first, depth n costing every chain's tokens cut
        there (the rates, learnt from what steps accepted, hold what the others add). Not
        by the drawn tokens (shared prefixes): a draw kept for its value is not from q."""
        first = replace(proposal, beams=proposal.beams[:, :1], valid=proposal.valid[:, :1],
                        confidence=None if proposal.confidence is None else proposal.confidence[:, :1])
        drafted = (proposal.valid.to(torch.int8).cumprod(dim=2).sum(dim=2) - 1).tolist()  # (B, W) per chain

        def tree_seconds(n: int) -> float:  # the longest row's drafted tokens over all its chains, cut at n
            return seconds(max(sum(min(n, d) for d in row) for row in drafted))
        depth = self.choose_chain(first, stats, use_conf, tree_seconds, probe, weights)[:, 0].sum(dim=1)
        keep = torch.arange(proposal.beams.shape[2], device=depth.device)[None, None, :] < depth[:, None, None]
        return proposal.valid.to(torch.int8).cumprod(dim=2).bool() & keep

    @staticmethod
    def observe_offers(stats: list[RowStats], drafted: list[bool]) -> None:
        """After a drafter call (before the policy cut its proposal): which rows it drafted
        anything for."""
        for s, d in zip(stats, drafted):
            s.offers = DECAY * s.offers + float(d)
            s.calls = DECAY * s.calls + 1.0

    def observe(self, stats: list[RowStats], offered: list[int], accepted: list[int],
                predicted: torch.Tensor | None, off: bool) -> None:
        """Update each row after a step: offered[b] drafted depth verified, accepted[b]
        drafted tokens kept; predicted (B, L) the summed confidence of the children of the
        accepted path's node at depth j - 1 (NaN: none), or None; ``off``: drafting was off."""
        for b, s in enumerate(stats):
            s.look_pause = max(s.look_pause - 1, 0)
            if offered[b] == 0:
                # Drafting allowed but nothing drafted (e.g. no lookup match): the row had its
                # probe. Without the reset such a row stays due and forces a tree on the whole
                # batch at every step (seen at batch 16: 39% of steps drafted, slower than none).
                s.off_streak = s.off_streak + 1 if off else 0
                s.off_steps += off
                if off:  # evidence ages with the text, towards what the drafter does now (_forget)
                    s.forget()
                    s.prior, s.strength = self.pooled(s.base), self.spread.strength()
                continue
            probed = s.probe_due
            s.probe_every = PROBE_START if accepted[b] else (min(2 * s.probe_every, PROBE_MAX) if probed
                                                              else s.probe_every)
            s.off_streak = 0
            s.count(offered[b], accepted[b], None if predicted is None else predicted[b].tolist())
            if (window := s.full_window()) is not None:
                self.spread.add(*window)
                s.strength = self.spread.strength()  # a long request (the server's) learns it too
            self.pool_hits = POOL_DECAY * self.pool_hits + float(accepted[b] > 0)
            self.pool_trials = POOL_DECAY * self.pool_trials + 1.0

def depth_summary(hist: Counter | dict, off_steps: int) -> str:
    """'off 62% | depth 0:40 1:20 3:5' for stats lines."""
    steps = sum(hist.values())
    shown = " ".join(f"{d}:{n}" for d, n in sorted(hist.items()))
    return f"off {100 * off_steps / max(steps, 1):.0f}% | depth {shown}"
