"""Adaptive drafting (specdraft.adaptive): the policy's choices on synthetic cost curves and
acceptance rates against brute force, drafting switching off for a drafter that is always
wrong, and exactness (greedy parity, sampling law) with the policy on."""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections import Counter
from functools import partial
from itertools import accumulate

import pytest
import torch

import test_sampling_exact as exact
from drafters_for_tests import RandomBeamsDrafter
from specdraft.adaptive import (ON_MARGIN, EXPLORE_MIN, EXPLORE_SHARE, LOOK_MAX_ROWS, LOOK_PAUSE, LOOK_SHARE, LOOK_TRIAL, SLACK, AdaptivePolicy,
                                best_size, chain_gains, finish_weights)
from specdraft.rowstats import PRIOR_STRENGTH, PROBE_START, STRENGTH_MAX, WINDOW, RateSpread, RowStats
from specdraft.costmodel import CostModel, cost_model_key, cost_model_path, load_cost_model
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.drafters.base import DraftContext, Drafter, Proposal
from specdraft.engine import SpeculativeEngine
from specdraft.sampling import SamplingParams
from specdraft.tree import children_confidence, node_values, prefix_owner, row_owners, row_ranks
from stats import g_test

LINEAR = CostModel([1, 2, 4, 8, 16, 32, 64], [1.0 + 0.1 * (t - 1) for t in [1, 2, 4, 8, 16, 32, 64]])
FLAT4 = CostModel([1, 4, 5, 8, 64], [1.0, 1.0, 2.0, 2.2, 10.0])  # up to 4 tokens for the price of 1
STEEP = CostModel([1, 2, 64], [1.0, 2.0, 64.0])  # every token costs a full forward


def stats_with(rates: list[float]) -> RowStats:
    """A row whose per-depth estimates are ``rates`` (a very strong prior on each depth)."""
    s = RowStats(prior=rates[0])
    for j, a in enumerate(rates):
        s.trials[j], s.hits[j] = 1e6, 1e6 * a
    return s


def brute_force_rate(cost, rates_by_row: list[list[float]], max_depth: int) -> float:
    """Best expected tokens per second over every per-row choice of depth (0..max_depth),
    with the padded cost: time = cost(B x (1 + the deepest row))."""
    best = 0.0
    for depths in itertools.product(range(max_depth + 1), repeat=len(rates_by_row)):
        tokens = 0.0
        for rates, d in zip(rates_by_row, depths):
            prod, tokens = 1.0, tokens + 1
            for a in rates[:d]:
                prod *= a
                tokens += prod
        best = max(best, tokens / cost(len(depths) * (1 + max(depths))))
    return best


def policy_rate(cost, rates_by_row, n: int) -> float:
    tokens = sum(1 + sum(torch.tensor(r[:n], dtype=torch.float64).cumprod(0).tolist()) for r in rates_by_row)
    return tokens / cost(len(rates_by_row) * (1 + n))


@pytest.mark.parametrize("cost", [LINEAR, FLAT4, STEEP], ids=["linear", "flat4", "steep"])
@pytest.mark.parametrize("rates_by_row", [
    [[0.5] * 6], [[0.9] * 6], [[0.05] * 6], [[0.95, 0.9, 0.3, 0.3, 0.3, 0.3]],
    [[0.8] * 6, [0.1] * 6], [[0.6] * 6, [0.7, 0.7, 0.2, 0.9, 0.9, 0.9], [0.99] * 6]])
def test_plan_finds_the_brute_force_optimum(cost, rates_by_row):
    policy = AdaptivePolicy(cost)
    budget = torch.full((len(rates_by_row),), 7)  # up to 6 drafted tokens per row
    n = policy.plan([stats_with(r) for r in rates_by_row], budget, width=0)
    want = brute_force_rate(cost, rates_by_row, 6)
    plain = len(rates_by_row) / cost(len(rates_by_row))
    if len(rates_by_row) > LOOK_MAX_ROWS and want < (1 + ON_MARGIN) * plain:
        want = plain  # batches that cannot look draft only where it clearly pays (ON_MARGIN)
    assert policy_rate(cost, rates_by_row, n) == pytest.approx(want, rel=1e-5)  # the prior's trace in stats_with


def test_a_batch_drafts_only_where_it_beats_plain_decoding_by_the_margin():
    """Two rows at a rate whose best tree beats a plain step by less than ON_MARGIN: off;
    one row (which may look) and a clearly paying rate: on."""
    policy = AdaptivePolicy(LINEAR)  # 1 + 0.1 per extra token: at a = 0.2, depth 1 gains ~1.5%
    budget = torch.tensor([9, 9])
    assert 2 / LINEAR(2) < brute_force_rate(LINEAR, [[0.2] * 8] * 2, 1) < 1.05 * 2 / LINEAR(2)
    assert policy.plan([stats_with([0.2] * 8) for _ in range(2)], budget, 0) == 0
    assert policy.plan([stats_with([0.5] * 8) for _ in range(2)], budget, 0) > 0


def test_plan_known_cases():
    policy = lambda cost: AdaptivePolicy(cost)  # noqa: E731
    budget = torch.tensor([9])
    # Linear 0.1 per extra token, a = 0.5: (1 + 0.5 + 0.25) / 1.2 beats depth 1 and 3.
    assert policy(LINEAR).plan([stats_with([0.5] * 8)], budget, 0) == 2
    assert policy(FLAT4).plan([stats_with([0.3] * 8)], budget, 0) == 3  # free up to 3 drafted tokens
    assert policy(STEEP).plan([stats_with([0.9] * 8)], budget, 0) == 0  # never pays: drafting off
    assert policy(LINEAR).plan([stats_with([0.0] * 8)], budget, 0) == 0
    assert policy(LINEAR).plan([stats_with([0.9] * 8)], torch.tensor([1]), 0) == 0  # no room left


def test_a_plain_step_is_taken_after_many_tree_steps_at_a_batch_size():
    """A policy that drafts on every step never sees a plain step, so a cost curve whose tree /
    plain relation is wrong would stand: after PLAIN_FIRST (then PLAIN_EVERY) tree steps at a
    batch size without a plain one the plan is a plain step, then drafting resumes; other
    batch sizes are not due."""
    from specdraft.steptime import PLAIN_EVERY, PLAIN_FIRST

    policy, budget = AdaptivePolicy(LINEAR), torch.tensor([9, 9, 9, 9])
    rows = [stats_with([0.9] * 8) for _ in range(4)]
    for _ in range(2):  # until a plain step is recorded (the first is skipped): every PLAIN_FIRST
        for _ in range(PLAIN_FIRST):
            assert policy.plan(rows, budget, 0) > 0
            policy.observe_step(True, 4, 12, 0, 0.1)
        assert policy.plan(rows, budget, 0) == 0
        policy.observe_step(False, 4, 4, 0, 0.05)
    assert (False, 4) in policy.step_ratio.relation
    for _ in range(PLAIN_EVERY - 1):
        policy.observe_step(True, 4, 12, 0, 0.1)
    assert policy.plan(rows, budget, 0) > 0 and not policy.step_ratio.plain_due(4)
    policy.observe_step(True, 4, 12, 0, 0.1)
    assert policy.step_ratio.plain_due(4) and not policy.step_ratio.plain_due(16)
    assert policy.plan(rows, budget, 0) == 0  # rates that would draft deep: plain anyway, once
    policy.observe_step(False, 4, 4, 0, 0.05)
    assert policy.plan(rows, budget, 0) > 0


def test_best_size_ties_pick_the_cheaper_size():
    assert best_size([[0.0, 0.0, 0.0]], [2], lambda n: 1.0) == 0


def test_finish_weights_follow_the_rows_that_lag():
    assert finish_weights([128, 128, 128, 128]) == pytest.approx([1.0] * 4)  # level: throughput
    w = finish_weights([100, 100, 80])  # sigma = sqrt(100) / 2 = 5: 20 tokens ahead is 4 sigma
    assert sum(w) == pytest.approx(3.0)
    assert w == pytest.approx([1.4864, 1.4864, 0.0272], abs=1e-3)
    assert finish_weights([7]) == [1.0]
    assert finish_weights([]) == []


def test_a_static_batch_drafts_by_the_rows_that_finish_last():
    """Two rows, one the drafter is good at (0.9) and one it is bad at (0.1): by throughput,
    depth 1 pays on LINEAR ((2 + 1.0) / 1.3 against 2 / 1.1); when the bad row lags, its
    progress alone decides and drafting is off; when the good row lags, it drafts."""
    rows = lambda: [stats_with([0.9] * 4), stats_with([0.1] * 4)]  # noqa: E731
    budget = torch.tensor([5, 5])
    assert AdaptivePolicy(LINEAR).plan(rows(), budget, 0) > 0
    assert AdaptivePolicy(LINEAR).plan(rows(), budget, 0, finish_weights([20, 60])) == 0
    assert AdaptivePolicy(LINEAR).plan(rows(), budget, 0, finish_weights([60, 20])) > 0


def test_generate_weighs_rows_by_finish_and_continuous_batching_does_not(tiny_target):
    """``generate`` (a static batch) gives the policy finish weights; a batch that admits
    requests (the server's loop: ``start`` + ``step``) gives none."""
    seen = []

    class Spy(AdaptivePolicy):
        def plan(self, stats, budget, width, weights=None, reach=None):
            seen.append(weights)
            return super().plan(stats, budget, width, weights, reach)

    engine = SpeculativeEngine(tiny_target, LookupDrafter(1, 4), policy=Spy(LINEAR))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 6)]
    engine.generate(PROMPTS[:2], params)
    assert seen and all(w is not None for w in seen)
    assert seen[0] == pytest.approx(finish_weights([11, 5]))  # prefill gave each row its first token
    seen.clear()
    batch, _ = engine.start(PROMPTS[:2], params)
    while batch.rows:
        engine.step(batch)
    assert seen and all(w is None for w in seen)


class FixedTree(Drafter):
    """Two beams after g0=7: [7, 1, 2] and [7, 3, 4], with confidences."""

    def __init__(self, confidence):
        self.confidence = torch.tensor(confidence)

    def propose(self, ctx):
        beams = torch.tensor([[[7, 1, 2], [7, 3, 4]]])
        return Proposal(beams, torch.ones_like(beams, dtype=torch.bool), confidence=self.confidence[None])


@pytest.mark.parametrize("conf, n_nodes, kept", [
    # node values: 1: .9, 2: .81, 3: .05 -> with FLAT4 (3 drafted nodes free) keep the best 3
    ([[1, 0.9, 0.9], [1, 0.05, 0.9]], 3, [[1, 1, 1], [1, 1, 0]]),
    # values .9, .45, .5, .05: best three are 1, 3, 2
    ([[1, 0.9, 0.5], [1, 0.5, 0.1]], 3, [[1, 1, 1], [1, 1, 0]]),
    # low confidence everywhere: on LINEAR nothing pays
    ([[1, 0.05, 0.05], [1, 0.02, 0.05]], 0, [[1, 0, 0], [1, 0, 0]]),
])
def test_choose_keeps_the_most_valuable_nodes(conf, n_nodes, kept):
    cost = FLAT4 if n_nodes else LINEAR
    drafter = FixedTree(conf)
    proposal = drafter.propose(None)
    valid = AdaptivePolicy(cost).choose(proposal, [RowStats(prior=0.5)], torch.tensor([True]), 0, 0.0, False)
    assert valid[0].long().tolist() == kept


def test_chain_path_matches_the_general_path():
    """choose's W = 1 shortcut keeps exactly the nodes the general (tree) path keeps: a chain
    duplicated as a second beam goes through the general path (the copy owns nothing)."""
    g = torch.Generator().manual_seed(0)
    curves = [LINEAR, FLAT4, STEEP, CostModel([1, 2, 8], [1.0, 1.02, 1.3])]
    for case in range(300):
        B, L = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g))
        beams = torch.randint(0, 50, (B, 1, L), generator=g)
        lengths = torch.randint(1, L + 1, (B,), generator=g)
        valid = torch.arange(L)[None, :] < lengths[:, None]
        conf = torch.rand(B, 1, L, generator=g) ** 2
        conf[torch.rand(B, 1, L, generator=g) < 0.1] = float("nan")
        confidence = None if case % 5 == 0 else conf
        stats = [stats_with(torch.rand(8, generator=g).tolist()) for _ in range(B)]
        for s in stats:  # kappa between ~0.5 and ~2
            s.seen, s.predicted = 10 * torch.rand(2, generator=g).tolist()[0], 5 + 5 * torch.rand(1, generator=g).item()
        use_conf = torch.rand(B, generator=g) < 0.7
        policy = AdaptivePolicy(curves[case % len(curves)])
        chain = Proposal(beams, valid[:, None, :], confidence=confidence)
        twin = Proposal(beams.repeat(1, 2, 1), valid[:, None, :].repeat(1, 2, 1),
                        confidence=None if confidence is None else confidence.repeat(1, 2, 1))
        probe = case % 7 == 0
        fast = policy.choose(chain, stats, use_conf, 0, 0.01, probe)
        general = policy.choose(twin, stats, use_conf, 0, 0.01, probe)
        assert fast[:, 0].tolist() == general[:, 0].tolist(), case
        if confidence is not None:  # what observe learns from: the same on both paths
            owner = prefix_owner(twin.beams, twin.valid)
            beam = torch.zeros(B, dtype=torch.long)
            got = children_confidence(owner[:, :1], valid[:, None, :], confidence, beam)
            want = children_confidence(owner, twin.valid, twin.confidence, beam)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(-1), want.nan_to_num(-1)), case


def random_tree_proposals(g: torch.Generator, cases: int):
    """Random (beams, prefix-closed valid) of 1-4 rows, 2-5 beams of 2-5 tokens over a
    3-token alphabet, so that beams often share prefixes."""
    for _ in range(cases):
        B, W, L = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 5), (2, 6), (2, 6)))
        beams = torch.randint(0, 3, (B, W, L), generator=g)
        beams[:, :, 0] = 7  # one root per row
        lengths = torch.randint(1, L + 1, (B, W), generator=g)
        yield beams, torch.arange(L)[None, None, :] < lengths[:, :, None]


def test_row_owners_and_ranks_match_the_tensor_geometry():
    """The host tree geometry (``row_owners``) is ``prefix_owner``'s, and ``row_ranks``
    counts each node's distinct earlier siblings."""
    g = torch.Generator().manual_seed(3)
    for beams, valid in random_tree_proposals(g, 300):
        owner = prefix_owner(beams, valid)
        for b in range(beams.shape[0]):
            rows = row_owners(beams[b].tolist(), valid[b].tolist())
            assert rows == owner[b].tolist()
            ranks = row_ranks(rows, valid[b].tolist())
            W, L = beams.shape[1:]
            for w in range(W):
                for j in range(1, L):
                    if not valid[b, w, j]:
                        continue
                    prefix = beams[b, w, :j].tolist()
                    siblings = {beams[b, k, j].item() for k in range(rows[w][j])
                                if valid[b, k, j] and beams[b, k, :j].tolist() == prefix} - {beams[b, w, j].item()}
                    assert ranks[w][j] == len(siblings)


def test_tree_choice_keeps_every_rows_best_nodes():
    """``choose`` on trees (W > 1): a prefix-closed part of the valid mask; every row that is
    not fixed keeps its min(n, nodes) most valuable nodes for one n, none worth less than
    a node it dropped; fixed rows keep everything."""
    g = torch.Generator().manual_seed(4)
    curves = [LINEAR, FLAT4, STEEP]
    for case, (beams, valid) in enumerate(random_tree_proposals(g, 300)):
        B, W, L = beams.shape
        conf = torch.rand(B, W, L, generator=g) ** 2
        conf[torch.rand(B, W, L, generator=g) < 0.1] = float("nan")
        stats = [stats_with(torch.rand(8, generator=g).tolist()) for _ in range(B)]
        for s in stats:
            s.fixed = bool(torch.rand(1, generator=g) < 0.15)
        use_conf = torch.rand(B, generator=g) < 0.7
        policy = AdaptivePolicy(curves[case % len(curves)])
        kept = policy.choose(Proposal(beams, valid, confidence=None if case % 4 == 0 else conf), stats,
                             use_conf, 0, 0.01, case % 5 == 0)
        assert not (kept & ~valid).any() and torch.equal(kept, kept.to(torch.int8).cumprod(dim=2).bool())
        sizes = set()
        for b in range(B):
            owner = row_owners(beams[b].tolist(), valid[b].tolist())
            values = node_values(owner, valid[b].tolist(), stats[b].rates(L - 1), stats[b].kappa,
                                 conf[b].tolist() if case % 4 and use_conf[b] else None)
            chosen = {(j, owner[w][j]) for w in range(W) for j in range(1, L) if kept[b, w, j]}
            if stats[b].fixed:
                assert chosen == set(values)
                continue
            dropped = set(values) - chosen
            assert not dropped or not chosen or min(values[x] for x in chosen) >= max(values[x] for x in dropped)
            sizes.add(len(chosen) if dropped else None)  # a row that kept all says only n >= its size
        assert len(sizes - {None}) <= 1, case


def test_cost_model_is_monotone_and_interpolates():
    cost = CostModel([1, 2, 4, 8], [1.0, 0.9, 1.2, 2.0], prefix=100, per_kv=0.001)
    assert cost.seconds == pytest.approx([0.95, 0.95, 1.2, 2.0])  # a cheaper reading is noise
    assert cost(3) == pytest.approx(1.075)
    assert cost(16) == pytest.approx(2.0 + 0.2 * 8)  # last slope extended
    assert cost(2, width=150) == pytest.approx(0.95 + 0.001 * 2 * 50)
    # One high reading is averaged with the sizes after it, not carried on to all of them.
    spike = CostModel([1, 2, 3, 4, 6, 8], [31.8, 36.8, 52.7, 40.0, 41.0, 45.0])
    assert spike.seconds == pytest.approx([31.8, 36.8, 44.5666, 44.5666, 44.5666, 45.0], abs=1e-3)
    with pytest.raises(Exception):
        CostModel([2, 4], [1.0, 2.0])


def test_cost_model_prices_batched_layouts_with_its_batch_curves():
    """T tokens over B rows cost the batch curves' figure (interpolated in B), not the
    one-row chain of T tokens: 4 x 4 is cheaper than 1 x 16 on a real CPU."""
    cost = CostModel([1, 4, 16, 64], [1.0, 1.2, 2.4, 8.0], batch_tokens=[1, 2, 4],
                     batch={4: [1.1, 1.3, 1.6], 16: [1.6, 2.2, 3.4]})
    assert cost(16) == cost(16, rows=1) == pytest.approx(2.4)  # one row: the chain curve
    assert cost(16, rows=4) == pytest.approx(1.6)  # 4 x 4: the 4-row curve
    assert cost(16, rows=16) == pytest.approx(1.6) and cost(32, rows=16) == pytest.approx(2.2)
    one = 1.0 + 0.2 / 3  # the chain curve at 2 tokens
    assert cost(4, rows=2) == pytest.approx(one + (1.3 - one) / 3)  # 2 x 2: a third of the way from 1 row to 4
    assert cost(64, rows=32) == pytest.approx(2.2 + (2.2 - 1.3) / 12 * 16)  # 32 x 2, beyond 16: the last slope in B
    assert cost(8, rows=4) < cost(8)  # the layouts the policy weighs are priced apart
    back = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back(16, rows=4) == cost(16, rows=4) and back.batch == cost.batch
    with pytest.raises(Exception):
        CostModel([1, 2], [1.0, 2.0], batch_tokens=[1, 2], batch={4: [1.0]})


def test_cost_model_measures_batch_curves(tiny_target):
    from specdraft.costmodel import BATCH_ROWS, measure_cost_model

    model = measure_cost_model(tiny_target, tokens=(1, 2, 4), trials=1)
    assert sorted(model.batch) == list(BATCH_ROWS) and model.batch_tokens[0] == 1
    assert all(len(ys) == len(model.batch_tokens) for ys in model.batch.values())
    assert model(8, rows=4) > 0


def test_cost_model_cache_folder_follows_the_environment(tiny_target, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDRAFT_COST_CACHE", raising=False)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "models"))
    assert cost_model_path(tiny_target).parent == tmp_path / "models" / "cost"
    monkeypatch.setenv("SPECDRAFT_COST_CACHE", str(tmp_path / "curves"))
    assert cost_model_path(tiny_target).parent == tmp_path / "curves"


def test_cost_model_is_cached_on_disk(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_COST_CACHE", str(tmp_path))
    calls = []

    def fake_measure(target):
        calls.append(1)
        return CostModel([1, 2], [0.01, 0.02], key=cost_model_key(target))

    first = load_cost_model(tiny_target, measure=fake_measure)
    again = load_cost_model(tiny_target, measure=fake_measure)
    assert len(calls) == 1 and again.seconds == first.seconds
    assert json.loads(cost_model_path(tiny_target).read_text())["tokens"] == [1, 2]
    load_cost_model(tiny_target, refresh=True, measure=fake_measure)
    assert len(calls) == 2
    cost_model_path(tiny_target).write_text("{broken")
    load_cost_model(tiny_target, measure=fake_measure)
    assert len(calls) == 3


def test_a_cost_model_measured_beside_another_job_is_not_cached(tiny_target, tmp_path, monkeypatch, caplog):
    """A curve timed while other processes load the CPU prices every later run wrongly
    (a busy spell's 4-row curve put a 2-token tree at 1.18x a plain step, a quiet one at
    1.31x): it serves the run that measured it and is not cached (logged, not printed:
    the CLI's stderr stays clean)."""
    from specdraft import timing

    monkeypatch.setenv("SPECDRAFT_COST_CACHE", str(tmp_path))
    calls = []

    def fake_measure(target):
        calls.append(1)
        return CostModel([1, 2], [0.01, 0.02], key=cost_model_key(target))

    monkeypatch.setattr(timing.OtherLoad, "share", lambda self: 0.4)
    with caplog.at_level("INFO", logger="specdraft.costmodel"):
        model = load_cost_model(tiny_target, measure=fake_measure)
    assert model.seconds == [0.01, 0.02] and not cost_model_path(tiny_target).exists()
    assert "other processes used 40% of the CPU" in caplog.text
    load_cost_model(tiny_target, measure=fake_measure)
    assert len(calls) == 2  # measured again: nothing was kept
    monkeypatch.setattr(timing.OtherLoad, "share", lambda self: 0.02)  # a quiet machine
    load_cost_model(tiny_target, measure=fake_measure)
    load_cost_model(tiny_target, measure=fake_measure)
    assert len(calls) == 3 and cost_model_path(tiny_target).exists()


def test_other_processes_cpu_share_is_read_from_the_machines_counters(tmp_path):
    """/proc/stat's busy ticks (user ... steal, not idle or iowait) less this process's own
    CPU time, over wall time x CPUs."""
    from specdraft.timing import OtherLoad, machine_busy_seconds

    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def write(busy_ticks: int) -> None:  # 2 CPUs; idle and iowait grow too and must not count
        stat.write_text(f"cpu  {busy_ticks} 0 0 {5 * busy_ticks} {busy_ticks} 0 0 0 0 0\n"
                        "cpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\nintr 0\n")

    write(100 * hz)
    assert machine_busy_seconds(str(stat)) == (pytest.approx(100.0), 2)
    assert machine_busy_seconds(str(tmp_path / "absent")) is None
    (tmp_path / "odd").write_text("")
    assert machine_busy_seconds(str(tmp_path / "odd")) is None
    load = OtherLoad(str(stat))
    assert load.share() is None  # too soon to say
    write(101 * hz)  # one busy CPU second of others' during the wait below
    start = time.perf_counter()
    time.sleep(0.6)
    wall = time.perf_counter() - start
    share = load.share()
    assert 1.0 / (2 * (wall + 0.5)) < share <= 1.0 / (2 * wall)  # ~0.8 at 0.6 s; own sleep costs ~no CPU


# ---- through the engine -------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 2, 3, 4], [5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9]]


class AlwaysWrong(Drafter):
    """Drafts 4 tokens that are never the target's greedy choice (it knows the answers)."""

    acceptance_prior = 0.5

    def __init__(self, answers: dict[int, list[int]], vocab: int):
        self.answers, self.V, self.calls = answers, vocab, []

    def propose(self, ctx: DraftContext) -> Proposal:
        B = len(ctx.tokens)
        beams = ctx.g0[:, None, None].repeat(1, 1, 5)
        for b, hist in enumerate(ctx.tokens):
            truth = self.answers[ctx.request_ids[b]][len(hist): len(hist) + 4]
            truth += [0] * (4 - len(truth))
            beams[b, 0, 1:] = (torch.tensor(truth) + 1) % self.V
            self.calls.append(len(hist))
        return Proposal(beams, torch.ones_like(beams, dtype=torch.bool))


def test_always_wrong_drafter_ends_at_plain_decoding(tiny_target, steady_clock):
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    plain = SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS[:1], params)[0]
    drafter = AlwaysWrong({0: PROMPTS[0] + plain.token_ids}, tiny_target.vocab_size)
    res = SpeculativeEngine(tiny_target, drafter, policy=AdaptivePolicy(LINEAR)).generate(PROMPTS[:1], params)[0]
    assert res.token_ids == plain.token_ids
    assert res.steps == plain.steps  # one token per step either way
    # A few drafts to learn, then probes only (after 8, 16, 32, 64 steps off).
    late = [n for n in drafter.calls if n >= len(PROMPTS[0]) + 30]
    assert len(drafter.calls) <= 20 and len(late) <= 3, drafter.calls
    assert res.off_steps >= 0.8 * (res.steps - 1)
    assert sum(res.drafted_hist.values()) == res.steps - 1


def test_draft_calls_after_plain_steps_are_timed_apart(tiny_target):
    """A drafter call right after a plain step (a draft model first feeds the tokens plain
    steps made) or on a batch's first step is a catch-up call, timed apart from calls on
    consecutive drafting steps: the plan weighs what drafting step after step costs, a
    probe what a call after plain steps costs."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    policy = AdaptivePolicy(LINEAR)
    plans = iter([1, 1, 0, 1, 1, 1, 0, 0, 1] + [0] * 20)
    policy.plan = lambda *a, **k: next(plans)
    kinds = []
    record = policy.draft_time.record
    policy.draft_time.record = lambda depth, seconds, steady=True: kinds.append(steady) or record(depth, seconds, steady)
    SpeculativeEngine(tiny_target, LookupDrafter(1, 4), policy=policy).generate(PROMPTS[:1], params)
    # drafting steps 1, 2 | plain | 4, 5, 6 | plain, plain | 9
    assert kinds == [False, True, False, True, True, False]


def test_drafters_say_how_deep_one_call_can_draft():
    from specdraft.drafters.combined import CombinedDrafter

    assert LookupDrafter(1, 4).max_depth() == 3 and NoDrafter().max_depth() == 0
    assert CombinedDrafter([LookupDrafter(1, 4), LookupDrafter(2, 6)]).max_depth() == 5
    assert CombinedDrafter([LookupDrafter(1, 4), RandomBeamsDrafter(5)]).max_depth() is None  # no bound known


def test_the_plan_prices_only_depths_the_drafter_can_reach(tiny_target, steady_clock):
    """A 1 x 3 drafter drafts 2 tokens at most: plans deeper than that priced gains that
    are not there, and its timer filed the same 2-deep call under a dozen depths (a 1 x 3
    head on MT-Bench was planned 5 and 11 deep, timed under depths 2-12), where one stale
    depth could switch the slack off for good. Plans, slack and timings stay within reach."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    policy = AdaptivePolicy(FLAT4)
    plans, plan = [], policy.plan
    policy.plan = lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1]
    SpeculativeEngine(tiny_target, LookupDrafter(1, 3), policy=policy).generate(PROMPTS[1:2], params)
    assert plans and max(plans) <= 2 and max(plans) >= 1, plans
    assert policy.draft_time.seconds and set(policy.draft_time.seconds) <= {1, 2}, policy.draft_time.seconds


def test_one_stalled_drafter_call_barely_moves_its_depths_time():
    """A drafter call that stalled (another process, a page fault) counts as at most twice
    the estimate: a depth the plan then stops asking for is never re-timed, so one stall of
    a 2-deep call must not price one more depth above the slack's share for good."""
    from specdraft.steptime import DraftTimer, MAX_JUMP

    timer = DraftTimer()
    for seconds in (0.02, 0.001, 0.002):  # the first call is not counted
        timer.record(1 + (seconds > 0.0015), seconds)
    timer.record(2, 0.1)  # 50x the estimate
    assert timer(2) == pytest.approx(0.8 * 0.002 + 0.2 * MAX_JUMP * 0.002)
    assert timer.per_depth() < 0.0015
    for _ in range(30):  # a real slow-down still comes through
        timer.record(2, 0.01)
    assert timer(2) > 0.009


def test_a_probe_is_priced_with_the_catch_up_call():
    """Steady calls cost 1 ms; a call after 10 plain steps 51 ms (a draft model feeding what
    it missed): the plan's step prices use the former, a probe's the steady call plus 5 ms
    per step missed, so a credit that pays for a steady call's probe does not pay for this
    one, and a call after rows joined (gap 0: prompts, once) teaches nothing."""
    from specdraft.steptime import DraftTimer

    timer = DraftTimer()
    for seconds, steady in ((9.0, True), (0.001, True), (0.001, True)):
        timer.record(2, seconds, steady)  # the first call is never counted
    timer.gap = 10
    timer.record(2, 0.051, steady=False)
    timer.gap = 0
    timer.record(2, 0.5, steady=False)  # rows joined
    timer.gap = 20
    assert timer(2) == pytest.approx(0.001) and timer.catch_up(2) == pytest.approx(0.101) and timer.catch_up(0) == 0
    policy = AdaptivePolicy(LINEAR)
    policy.draft_time = timer
    stats, budget = [stats_with([0.05] * 8) for _ in range(2)], torch.tensor([3, 3])
    for s in stats:
        s.off_streak = PROBE_START  # due
    cheap = LINEAR(4) - LINEAR(2) + 0.001 + 1e-6
    policy.probe_credit = cheap
    assert not policy.afford_probe(stats, [2, 2], policy.seconds(2, 0), None, policy.seconds(2, 0, catch_up=True))
    assert policy.afford_probe(stats, [2, 2], policy.seconds(2, 0), None)  # priced as a steady call, it is paid


def test_seeded_sampling_keeps_the_fixed_shape(tiny_target):
    """A seed's output must not depend on the batch: seeded rows are not adapted."""
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)]
    fixed = SpeculativeEngine(tiny_target, LookupDrafter(1, 4), max_tree_tokens=None).generate(PROMPTS, params)
    for batch in ([0, 1, 2], [1]):
        res = SpeculativeEngine(tiny_target, LookupDrafter(1, 4), policy=AdaptivePolicy(STEEP)).generate(
            [PROMPTS[i] for i in batch], [params[i] for i in batch])
        assert [r.token_ids for r in res] == [fixed[i].token_ids for i in batch]


def test_plain_drafter_never_drafts_with_a_policy(tiny_target):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    res = SpeculativeEngine(tiny_target, NoDrafter(), policy=AdaptivePolicy(FLAT4)).generate(PROMPTS, params)
    assert all(r.drafted_hist == {0: r.steps - 1} for r in res)


BATCH_FLAT = CostModel([1, 12, 16, 64], [1.0, 1.0, 1.6, 4.0])  # 3 rows x 4 tokens for the price of 1


@pytest.mark.parametrize("cost", [LINEAR, BATCH_FLAT], ids=["linear", "batch-flat"])
def test_greedy_parity_with_policy(tiny_target, cost, steady_clock):
    """Greedy output with the policy on is plain decoding's, and the policy varies the depth.
    ``steady_clock``: under a full suite beside another job, real timings once kept the policy
    at depths 0 and 1."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain = SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS, params)
    oracle = {i: p + r.token_ids for i, (p, r) in enumerate(zip(PROMPTS, plain))}
    for drafter in (RandomBeamsDrafter(tiny_target.vocab_size, 3, 6, seed=2, oracle=oracle), LookupDrafter(2, 6)):
        res = SpeculativeEngine(tiny_target, drafter, policy=AdaptivePolicy(cost)).generate(PROMPTS, params)
        assert [r.token_ids for r in res] == [r.token_ids for r in plain]
        depths = Counter()
        for r in res:
            depths.update(r.drafted_hist)
        # the policy varied the depth (lookup on the tiny model's random text rarely matches,
        # and the plan weighs its rows by that: it may stay off, exactly)
        assert len(depths) > 2 or isinstance(drafter, LookupDrafter), depths


# The sampling law with the policy on: the engine of test_sampling_exact, with a cost curve
# under which the policy's choices vary with each row's evidence (thousands of rows pad).
SAMPLING_COST = CostModel([1, 6000, 48000], [1.0, 1.3, 3.4])
SAMPLING_CASES = {
    "oracle beams T=1 top-p": (lambda t: exact.OracleBeamsDrafter(t), exact.T1),
    "lookup T=1 top-p with EOS": (lambda t: LookupDrafter(beam_width=2, beam_length=4), {**exact.T1, "ignore_eos": False}),
    "sampled chain T=0.7 top-p": (lambda t: exact.SampledChainDrafter(exact.V, beam_length=4), exact.T07),
}


@pytest.fixture(scope="module")
def exact_target(tmp_path_factory):
    """test_sampling_exact's 6-token model (same seed)."""
    from conftest import make_tiny_llama
    from specdraft.models import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_tiny_llama(tmp_path_factory.mktemp("exact") / "tiny6", vocab_size=exact.V, seed=1)
    yield load_target(str(path), dtype="float32")
    torch.set_num_threads(threads)


class AdaptingSeeded(AdaptivePolicy):
    """Adapts seeded sampling rows too (the engine keeps their fixed shape so that a seed's
    output does not depend on the batch): seeds make the test reproducible, and it is the
    adaptive path whose law is tested."""

    def new_row(self, drafter, params=None):
        return super().new_row(drafter)


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_law_with_policy(exact_target, case, monkeypatch, steady_clock):
    drafter_fn, params = SAMPLING_CASES[case]
    with_policy = partial(SpeculativeEngine, policy=AdaptingSeeded(SAMPLING_COST))
    monkeypatch.setattr(exact, "SpeculativeEngine", with_policy)
    law, table = exact.exact_law(exact_target, exact.PROMPT_A, SamplingParams(**params))
    outs, results = exact.run_rows(exact_target, drafter_fn(table), [exact.PROMPT_A] * exact.N_ROWS,
                                   [SamplingParams(**{**params, "seed": s}) for s in range(exact.N_ROWS)])
    res = g_test(Counter(outs), law)
    steps = sum(r.steps for r in results) / exact.N_ROWS
    depths = Counter()
    for r in results:
        depths.update(r.drafted_hist)
    print(f"{case}: {res} steps/row={steps:.2f} depths={dict(depths)}")
    assert res.p_value > exact.ALPHA, f"{case}: {res}"
    assert steps < exact.K and len(depths) >= 2, "the policy must draft, and not always the same depth"


# ---- SmolLM2: greedy parity with transformers, policy on (the parity test's cases) ------------

SMOL_COST = CostModel([1, 4, 8, 16, 64], [1.0, 1.0, 1.1, 1.5, 4.0])  # drafting pays, within limits


@pytest.mark.parametrize("name", ["lookup", "random-beams", "shipped-redrafter", "shipped-draft"])
def test_smollm2_greedy_parity_with_policy(smol, smol_parity_cases, name):
    import test_parity_smollm2 as parity

    cases = smol_parity_cases[1::2]  # one batch of 4 (the policy-off parity test runs all 8)
    engine = SpeculativeEngine(smol, parity.make_drafter(smol, cases, name), policy=AdaptivePolicy(SMOL_COST))
    for start in range(0, len(cases), 4):
        group = cases[start: start + 4]
        if engine.drafter.name == "random-beams":
            engine.drafter.oracle = {i: prompt + ref for i, (prompt, ref) in enumerate(group)}
        params = [SamplingParams(max_new_tokens=parity.NEW_TOKENS - 8 * (i % 2)) for i in range(len(group))]
        results = engine.generate([prompt for prompt, _ in group], params)
        parity.check(smol, [(p, ref[: q.max_new_tokens]) for (p, ref), q in zip(group, params)], results)


def test_tree_steps_dearer_than_the_curve_turn_drafting_off():
    """The offline curve says drafting pays; steps measured on line say tree steps cost twice
    what it says while plain steps cost what it says: the policy learns that and stops."""
    policy = AdaptivePolicy(LINEAR)
    stats, budget = [stats_with([0.5] * 8)], torch.tensor([9])
    assert policy.plan(stats, budget, 0) == 2  # (1 + 0.5 + 0.25) / 1.2 per the curve
    for _ in range(30):
        policy.observe_step(False, 1, 1, 0, LINEAR(1))
        policy.observe_step(True, 1, 3, 0, 2 * LINEAR(3))
    assert policy.step_ratio(True) == pytest.approx(2.0) and policy.step_ratio(False) == pytest.approx(1.0)
    assert policy.plan(stats, budget, 0) == 0  # 1.75 / 2.4 < 1 / 1.0
    # the same slowdown on every step (a busier machine) changes nothing
    busy = AdaptivePolicy(LINEAR)
    for _ in range(30):
        busy.observe_step(False, 1, 1, 0, 3 * LINEAR(1))
        busy.observe_step(True, 1, 3, 0, 3 * LINEAR(3))
    assert busy.plan(stats, budget, 0) == 2


def test_step_costs_are_learnt_per_batch_size():
    """Tree steps measured cheap at 4 rows must not make 16-row trees look cheap: the ratios
    are kept per batch size (the benchmark that drafted on every 16-row step at 0.81x plain
    decoding had learnt its tree ratio at 4 rows and its plain ratio at 16)."""
    policy = AdaptivePolicy(LINEAR)
    policy.observe_step(False, 1, 1, 0, 1.0)  # first step of each kind: not recorded
    policy.observe_step(True, 1, 2, 0, 1.0)
    for _ in range(40):
        policy.observe_step(True, 4, 8, 0, 0.5 * LINEAR(8))  # 4-row trees: half the curve
        policy.observe_step(False, 4, 4, 0, LINEAR(4))
        policy.observe_step(False, 16, 16, 0, LINEAR(16))
    ratio = policy.step_ratio
    assert ratio(True, 4) == pytest.approx(0.5) and ratio(False, 16) == pytest.approx(1.0)
    assert ratio(True, 3) == ratio(True, 4)  # 3 rows: the 4-row bucket
    # 16-row trees never seen: the 16-row plain ratio times the tree/plain relation at 4 rows
    assert ratio(True, 16) == pytest.approx(0.5)
    for _ in range(60):
        policy.observe_step(True, 16, 32, 0, 1.2 * LINEAR(32))  # measured at 16 rows: dearer
    assert ratio(True, 16) == pytest.approx(1.2, rel=0.01) and ratio(True, 4) == pytest.approx(0.5)
    assert ratio(True, 64) == ratio(True, 16) and ratio(False, 1) == ratio(False, 4)  # unseen sizes: nearest


def test_rows_a_drafter_rarely_drafts_for_are_weighed_by_how_often_it_does():
    """Lookup's rates are given a match; a 16-row batch whose rows rarely match must not
    plan trees (some row matches on most steps, every row pads that tree, only matched rows
    gain): the plan weighs each row's gains by its offer rate."""
    policy = AdaptivePolicy(LINEAR)
    B = 16
    stats, budget = [stats_with([0.9] * 8) for _ in range(B)], torch.full((B,), 9)
    assert policy.plan(stats, budget, 0) > 0  # 0.9 per token, every call drafting
    for _ in range(60):
        policy.observe_offers(stats, [False] * B)
    assert stats[0].offer_rate < 0.1
    assert policy.plan(stats, budget, 0) == 0
    for _ in range(60):
        policy.observe_offers(stats, [True] * B)
    assert policy.plan(stats, budget, 0) > 0


def test_new_requests_start_from_the_drafters_pooled_acceptance():
    """A drafter whose prior says 0.6 but whose drafts are accepted 10% of the time: after
    some requests, a new request starts near 0.1 instead of paying to relearn it."""
    policy = AdaptivePolicy(LINEAR, prior=0.6)
    assert policy.new_row(None).prior == pytest.approx(0.6)
    for _ in range(30):
        stats = [policy.new_row(None) for _ in range(4)]
        for step in range(20):
            policy.observe(stats, [1] * 4, [int((step + b) % 10 == 0) for b in range(4)], None, off=False)
    assert policy.new_row(None).prior == pytest.approx(0.1, abs=0.02)


def test_a_stalled_step_does_not_leave_one_kind_looking_cheap():
    """One plain step that stalled (50x the curve) once left the plain ratio x2 while only
    tree steps followed: trees looked cheaper than plain steps and a 16-row batch drafted
    on every step. Readings are clipped, the other kind follows the machine, and a tree
    step is never priced below a plain one."""
    policy = AdaptivePolicy(LINEAR)
    ratio = policy.step_ratio
    for _ in range(40):
        policy.observe_step(False, 16, 16, 0, LINEAR(16))
        policy.observe_step(True, 16, 32, 0, LINEAR(32))
    policy.observe_step(False, 16, 16, 0, 50 * LINEAR(16))
    assert ratio(False, 16) < 1.1
    for _ in range(40):
        policy.observe_step(True, 16, 32, 0, 0.5 * LINEAR(32))  # the machine gets quieter
    assert ratio(True, 16) == pytest.approx(0.5, rel=0.05)
    assert ratio(False, 16) < 0.8  # followed, though no plain step was seen
    seconds = policy.seconds(16, 0)
    assert seconds(1) >= seconds(0)


def test_a_row_off_after_a_bad_spell_returns_to_the_pooled_rate():
    """A row whose rates dipped below break-even gets no evidence while off; its evidence
    ages on steps off too, towards the drafter's pooled rate, so where that rate pays the
    row drafts again long before a probe would have told it (at 4 rows the head sat off on
    39% of row-steps where drafting on every step gained)."""
    policy = AdaptivePolicy(LINEAR, prior=0.5)
    policy.pool_hits, policy.pool_trials = 120.0, 200.0  # pooled depth-1 rate 0.6 (~200 row-steps): pays
    stats, budget = [policy.new_row(None) for _ in range(4)], torch.tensor([3] * 4)
    assert policy.plan(stats, budget, 0) > 0
    for _ in range(10):  # a bad spell: every draft rejected
        policy.observe(stats, [2] * 4, [0] * 4, None, off=False)
    steps = 0
    while policy.plan(stats, budget, 0) == 0 and steps < 200:  # no step times: no probe credit
        policy.observe(stats, [0] * 4, [0] * 4, None, off=True)
        steps += 1
    assert 0 < steps < 60 and not policy.probing  # back by the aged rates (~40 steps at DECAY 0.95)
    never = AdaptivePolicy(LINEAR, prior=0.05)  # a drafter whose pooled rate does not pay stays off
    stats = [never.new_row(None) for _ in range(4)]
    for _ in range(100):
        assert never.plan(stats, budget, 0) == 0 or never.probing
        never.observe(stats, [0] * 4, [0] * 4, None, off=True)


def test_an_unseen_step_kind_takes_the_seen_kinds_ratio():
    """Steps far cheaper than a (synthetic) curve must not make the kind not yet seen look
    dear: until both kinds are measured, the curve's own relation stands."""
    policy = AdaptivePolicy(LINEAR)
    for _ in range(5):
        policy.observe_step(True, 1, 3, 0, 0.001 * LINEAR(3))
    assert policy.step_ratio(False) == policy.step_ratio(True) == pytest.approx(0.01)  # clamped


def test_a_row_with_nothing_to_draft_does_not_keep_the_batch_probing():
    """A probe step asks every row's drafter; a row that had nothing to offer (no lookup
    match) has had its probe too, or it would stay due and force a tree on every step."""
    policy = AdaptivePolicy(LINEAR)  # at 0.05 drafting does not pay: only probes draft
    stats, budget = [stats_with([0.05] * 8), stats_with([0.05] * 8)], torch.tensor([5, 5])
    steps = 0
    while policy.plan(stats, budget, 0) == 0 and steps < 1000:  # off until a probe is due and paid for
        policy.observe(stats, [0, 0], [0, 0], None, off=True)
        policy.observe_step(False, 2, 2, 0, LINEAR(2))  # a plain step of the two rows earns probe credit
        steps += 1
    # Due after 8 steps off; paid once 3% of the steps cover the probe's extra LINEAR(4) - LINEAR(2).
    assert policy.probing and steps == max(PROBE_START, math.ceil((LINEAR(4) - LINEAR(2)) / (EXPLORE_SHARE * LINEAR(2))))
    policy.observe(stats, [1, 0], [0, 0], None, off=False)  # row 0 drafted and missed, row 1 had nothing
    assert not any(s.probe_due for s in stats)
    assert policy.plan(stats, budget, 0) == 0


@pytest.mark.parametrize("case", ["dear", "rarely-offered"])
def test_no_probes_where_no_plausible_rate_could_pay(case):
    """A probe pads every row's tree; it is paid for only where a rate it could find
    (PLAUSIBLE_RATE) would turn drafting on: not when every token costs a full forward, and
    not for rows the drafter rarely drafts for (lookup at batch 4)."""
    cost = STEEP if case == "dear" else LINEAR
    policy = AdaptivePolicy(cost)
    stats, budget = [stats_with([0.05] * 8) for _ in range(4)], torch.tensor([5] * 4)
    if case == "rarely-offered":
        for _ in range(60):
            policy.observe_offers(stats, [False] * 4)
    for _ in range(200):
        assert policy.plan(stats, budget, 0) == 0
        policy.observe(stats, [0] * 4, [0] * 4, None, off=True)
        policy.observe_step(False, 4, 4, 0, cost(4))
    assert all(s.probe_due for s in stats) and not policy.probing


def test_a_cheap_confident_drafter_is_asked_where_its_rates_say_off():
    """Rates say drafting does not pay; a drafter whose call costs under LOOK_SHARE of a
    plain step and whose proposals carry confidences is asked anyway, and its confidences
    decide: sure candidates are verified, unsure ones give a plain step. A dear call is not
    made."""
    stats, budget, look = [stats_with([0.01] * 8)], torch.tensor([3]), torch.tensor([True])
    policy = AdaptivePolicy(LINEAR)
    assert policy.plan(stats, budget, 0) == 0 and not policy.looking  # no confidences seen yet
    sure, unsure = FixedTree([[1, 0.99, 0.99], [1, 0.01, 0.01]]), FixedTree([[1, 0.02, 0.01], [1, 0.01, 0.01]])
    timed(policy, 0.5 * LOOK_SHARE * LINEAR(1))
    kept = policy.choose(sure.propose(None), stats, look, 0, 0.0, False)
    assert kept[0].long().tolist() == [[1, 1, 1], [1, 0, 0]]  # the confidences, not the rates
    assert policy.plan(stats, budget, 0) == 2 and policy.looking and not policy.probing
    assert not policy.choose(unsure.propose(None), stats, look, 0, 0.0, False)[:, :, 1:].any()
    assert policy.plan(stats * (LOOK_MAX_ROWS + 1), budget.repeat(LOOK_MAX_ROWS + 1), 0) == 0  # batches: no looks
    dear = AdaptivePolicy(LINEAR)
    timed(dear, 2 * LOOK_SHARE * LINEAR(1))
    dear.choose(sure.propose(None), stats, look, 0, 0.0, False)
    assert dear.plan(stats, budget, 0) == 0 and not dear.looking
    # confidences the policy may not use (sampled drafts) give no looks either
    blind = AdaptivePolicy(LINEAR)
    timed(blind, 0.5 * LOOK_SHARE * LINEAR(1))
    blind.choose(sure.propose(None), stats, torch.tensor([False]), 0, 0.0, False)
    assert blind.plan(stats, budget, 0) == 0


def timed(policy, seconds, depth=2 + SLACK):
    """The drafter's calls at ``depth`` took ``seconds`` (the first call is not counted)."""
    policy.draft_time.record(depth, 100 * seconds)  # the first call's one-time costs
    policy.draft_time.record(depth, seconds)


def test_a_drafters_slow_first_call_does_not_stop_its_looks():
    """The first drafter call pays one-time costs (the shipped head: 13-19 ms against 4.3);
    remembered, it once kept looks off for a whole run at that depth."""
    policy = AdaptivePolicy(LINEAR)
    policy.draft_time.record(3, 10.0)
    assert policy.draft_time(3) == 0.0  # not recorded
    policy.draft_time.record(3, 0.004)
    assert policy.draft_time(3) == pytest.approx(0.004)
    ratio = AdaptivePolicy(LINEAR).step_ratio
    ratio.record(True, 1, 50.0, 1.0)  # the first tree step: not recorded either
    ratio.record(True, 1, 0.8, 1.0)
    assert ratio(True) == pytest.approx(0.8)


def test_looks_that_lose_time_pause_and_come_back():
    """Looks are judged per request on what they did: after LOOK_TRIAL looks that cost more
    than the plain steps they replaced, the row does not look for LOOK_PAUSE steps; looks
    that gain go on."""
    stats, budget, look = [stats_with([0.01] * 8)], torch.tensor([3]), torch.tensor([True])
    policy = AdaptivePolicy(LINEAR)
    timed(policy, 0.5 * LOOK_SHARE * LINEAR(1))
    sure = FixedTree([[1, 0.99, 0.99], [1, 0.01, 0.01]])
    policy.choose(sure.propose(None), stats, look, 0, 0.0, False)
    plain = LINEAR(1)
    for _ in range(3 * LOOK_TRIAL):  # each look: 2 tokens in less than two plain steps
        assert policy.plan(stats, budget, 0) == 2 and policy.looking
        policy.observe(stats, [2], [1], None, off=False)
        policy.observe_look(stats, 1, 1.5 * plain, 0)
    for _ in range(LOOK_TRIAL):  # now each look: no token gained, a plain step and a draft call
        assert policy.plan(stats, budget, 0) == 2 and policy.looking
        policy.observe(stats, [2], [0], None, off=False)
        policy.observe_look(stats, 0, 1.1 * plain, 0)
    for _ in range(LOOK_PAUSE):
        assert policy.plan(stats, budget, 0) == 0 and not policy.looking
        policy.observe(stats, [0], [0], None, off=True)
    assert policy.plan(stats, budget, 0) == 2 and policy.looking


def test_probes_cost_at_most_the_exploration_share_at_any_batch_size():
    """16 rows whose drafts never pay: probes (each padding the whole batch's tree) take at
    most EXPLORE_SHARE of the decode time, however the rows' probe times interleave."""
    policy = AdaptivePolicy(LINEAR)
    B = 16
    stats, budget = [stats_with([0.01] * 8) for _ in range(B)], torch.full((B,), 5)
    for i, s in enumerate(stats):
        s.off_streak = i  # due at different steps
    plain = total = 0.0
    for _ in range(2000):
        n = policy.plan(stats, budget, 0)
        seconds = LINEAR(B * (1 + n))
        total, plain = total + seconds, plain + LINEAR(B)
        policy.observe(stats, [n] * B, [0] * B, None, off=n == 0)
        policy.observe_step(n > 0, B, B * (1 + n), 0, seconds)
    assert 1.0 < total / plain <= 1 + EXPLORE_SHARE + 1e-9


def test_probes_pay_what_they_really_cost_whatever_their_estimate():
    """A draft model's probe first feeds every token made since its last call, so its call
    costs more the longer the rows were off (here 0.2 per step missed, 8% of a plain step:
    the shipped draft at 16 rows feeds 16 tokens a step missed). Priced per step missed
    (``DraftTimer.catch_up``) and billed at their measured cost (``settle_probe``), probes
    take at most EXPLORE_SHARE of the decode time; priced by the latest catch-up calls, the
    longer waits between failed probes made each one cost more than the last (1.06x plain)."""
    policy = AdaptivePolicy(LINEAR)
    B = 16
    stats, budget = [stats_with([0.01] * 8) for _ in range(B)], torch.full((B,), 5)
    plain = total = 0.0
    for _ in range(3000):
        n = policy.plan(stats, budget, 0)
        seconds = LINEAR(B * (1 + n))
        if n:
            call = 0.2 * (1 + stats[0].off_streak)
            policy.draft_time.record(n, call, steady=False)
            total += call
        total, plain = total + seconds, plain + LINEAR(B)
        policy.observe(stats, [n] * B, [0] * B, None, off=n == 0)
        policy.observe_step(n > 0, B, B * (1 + n), 0, seconds)
    assert 1.0 < total / plain <= 1 + EXPLORE_SHARE + 1e-9


def test_probes_that_never_turn_drafting_on_cost_less_and_less():
    """Probes that never find drafting worth it (16-row trees the rows' rates never pay
    for): the credit's share falls from EXPLORE_SHARE towards EXPLORE_MIN at that batch size,
    while other sizes keep theirs; a probe that turns drafting on restores it."""
    policy = AdaptivePolicy(LINEAR)
    B = 16
    stats, budget = [stats_with([0.01] * 8) for _ in range(B)], torch.full((B,), 5)
    for i, s in enumerate(stats):
        s.off_streak = i
    costs = []
    for _ in range(4000):
        n = policy.plan(stats, budget, 0)
        costs.append((LINEAR(B * (1 + n)), LINEAR(B)))
        policy.observe(stats, [n] * B, [0] * B, None, off=n == 0)
        policy.observe_step(n > 0, B, B * (1 + n), 0, costs[-1][0])
    late = [c for c, _ in costs[2000:]], [p for _, p in costs[2000:]]
    assert 1.0 < sum(late[0]) / sum(late[1]) <= 1 + 2 * EXPLORE_MIN  # still probing, at a fraction
    assert policy.explore_share(B) < 2 * EXPLORE_MIN and policy.explore_share(1) == EXPLORE_SHARE
    low = policy.explore_share(B)
    for _ in range(3):  # probes that find drafting pays (then drafting is on: no probes needed)
        policy.probed_rows = B
        policy.judge_probe(2)
    assert policy.explore_share(B) > 1.5 * low


def test_best_size_stops_early_without_changing_its_answer():
    """The scan's early stop (no n beyond can beat the best) picks what a full scan picks,
    on random concave-ish gains and non-decreasing step seconds; and it stops early."""
    import random

    rng = random.Random(0)
    calls = []
    for _ in range(300):
        B, depth = rng.randint(1, 16), rng.randint(0, 12)
        gains = [chain_gains([rng.random() for _ in range(depth)]) for _ in range(B)]
        counts = [rng.randint(0, depth) for _ in range(B)]
        weights = [rng.uniform(0.1, 2.0) for _ in range(B)]
        steps = list(accumulate([1.0] + [rng.uniform(0.0, 0.5) for _ in range(depth + 1)]))

        def seconds(n, steps=steps):
            calls.append(n)
            return steps[n]
        full = max(range(max(counts, default=0) + 1),
                   key=lambda n: ((B + sum(w * g[min(n, c)] for g, c, w in zip(gains, counts, weights))) / steps[n], -n))
        assert best_size(gains, counts, seconds, weights) == full
    stats = [stats_with([0.05] * 16) for _ in range(16)]
    calls.clear()
    assert best_size([chain_gains(s.rates(16)) for s in stats], [16] * 16, lambda n: calls.append(n) or 1.0 + 0.5 * n) == 0
    assert max(calls) <= 2


def test_drafting_beyond_the_plan_only_where_one_more_depth_is_cheap():
    """At batch 1 a drafter may draft SLACK deeper than planned (its confidences cut), but
    only if one more depth costs at most SLACK_SHARE of a plain step: a draft model's extra
    forward (~15% of a step) is priced into every plan, and it turned drafting off where
    gamma = 1 alone pays. The plan is then priced at its own depth."""
    stats, budget = [stats_with([0.2] * 8)], torch.tensor([5])
    plain = FLAT4(1)
    cheap, dear = AdaptivePolicy(FLAT4), AdaptivePolicy(FLAT4)
    timed(cheap, 0.01 * plain, 1)  # per depth: 1% of a plain step, and 15% (a draft model's forward)
    timed(dear, 0.15 * plain, 1)
    cheap.draft_time.record(2, 0.02 * plain)
    dear.draft_time.record(2, 0.30 * plain)
    assert cheap.slack(1, plain) == SLACK and dear.slack(1, plain) == 0
    assert cheap.slack(2, plain) == 0  # batches do not look, so they never draft beyond the plan
    assert dear.seconds(1, 0)(1) == pytest.approx(plain + 0.15 * plain)  # one forward, not two
    # a1 = 0.2: one drafted token for 1.15 plain steps pays (1.2 > 1.15); two forwards would not
    assert dear.plan(stats, budget, 0) == 1 and dear.extra == 0
    assert cheap.plan(stats, budget, 0) >= 1 and cheap.extra == SLACK


def test_a_drafting_row_stops_only_when_its_rate_is_clearly_below_break_even():
    """At batch 1 a row that drafted on its last step keeps drafting while its depth-1 rate
    is within STAY_ON_SPREAD posterior deviations of break-even (a dip of ~20 decayed trials
    is noise), and stops once it is clearly below; a row that was off turns on by the mean."""
    step = FLAT4(1)
    policy = AdaptivePolicy(FLAT4)
    timed(policy, 0.15 * step, 1)  # break-even a1 = 0.15
    policy.draft_time.record(2, 0.30 * step)  # one more depth: a draft model's forward (no slack)
    budget = torch.tensor([2])

    def row(hits: float, trials: float, off_streak: int = 0) -> RowStats:
        s = RowStats(prior=0.26)
        s.hits[0], s.trials[0], s.off_streak = hits, trials, off_streak
        return s

    dipped = row(2.0, 18.0)  # a_1 = (0.52 + 2) / 20 = 0.126, sd 0.072: within noise
    assert policy.plan([dipped], budget, 0) == 1 and policy.must_verify and not policy.looking and not policy.probing
    assert policy.plan([row(2.0, 18.0, off_streak=1)], budget, 0) == 0  # off: the mean decides
    assert policy.plan([row(0.0, 60.0)], budget, 0) == 0  # a_1 = 0.008: clearly below
    assert policy.plan([dipped] * 2, budget.repeat(2), 0) == 0  # batches: the means decide



def test_the_depth_1_prior_is_as_strong_as_the_rates_spread_says():
    """Windows of a steady rate (0.2 +- chance) make a strong prior; windows of a drafter that
    is either right or wrong for long stretches (lookup: 0.05 or 0.8) leave it weak."""
    g = torch.Generator().manual_seed(0)
    steady, bursty = RateSpread(), RateSpread()
    assert steady.strength() == PRIOR_STRENGTH  # no windows yet
    for i in range(60):
        steady.add(int(torch.binomial(torch.tensor(float(WINDOW)), torch.tensor(0.2), generator=g)), WINDOW)
        rate = 0.8 if i % 3 == 0 else 0.05
        bursty.add(int(torch.binomial(torch.tensor(float(WINDOW)), torch.tensor(rate), generator=g)), WINDOW)
    assert steady.strength() >= 16
    assert bursty.strength() <= 3


def test_a_bad_start_does_not_turn_a_steady_drafter_off():
    """A drafter accepted ~21% of the time on every stretch of text (the shipped draft model
    on MT-Bench; break-even 0.12 here): a new request whose first 16 drafts are rejected
    (P = 0.02 at 0.21; ``stays_on`` alone keeps a weak prior's row on for ~15) keeps
    drafting: its rate's mean stays above break-even. Before the prior's strength was learnt
    such a start went off (a_1 = 0.04) for ~25 steps, on 2 of 10 MT-Bench requests after 8
    misses. A drafter whose rate swings between stretches of text goes off."""
    step = FLAT4(1)
    budget = torch.tensor([2])

    def after_history(rates) -> tuple[AdaptivePolicy, RowStats]:
        policy = AdaptivePolicy(FLAT4, prior=0.5)
        timed(policy, 0.12 * step, 1)
        policy.draft_time.record(2, 0.30 * step)  # no slack
        g = torch.Generator().manual_seed(1)
        for rate in rates:  # 40 earlier requests of 40 drafted steps
            row = [policy.new_row(None)]
            for _ in range(40):
                policy.observe(row, [1], [int(torch.rand((), generator=g) < rate)], None, off=False)
        row = [policy.new_row(None)]
        for _ in range(16):
            policy.observe(row, [1], [0], None, off=False)
        return policy, row[0]

    policy, row = after_history([0.21] * 40)
    assert row.strength >= 16
    assert policy.plan([row], budget, 0) == 1
    policy, row = after_history([0.6, 0.02] * 20)  # pooled ~0.31, but stretch by stretch
    assert row.strength <= 4
    assert policy.plan([row], budget, 0) == 0


def test_a_failed_probe_does_not_stay_on():
    """``stays_on`` keeps a drafting row on while its rate is within a posterior deviation
    of break-even; a row that drafted only because a probe was due was not on: after a probe
    whose rate's mean says off the plan goes off and the probe is recorded as a loss (it
    stayed on for one more draft, and counted as a win, on 1 of 15 runs of the always-wrong
    engine test, depending on when the probe credit allowed the probe)."""
    def weak_row() -> RowStats:  # mean 0.06 < LINEAR's 0.1 break-even, one deviation above it
        s = RowStats(prior=0.05)
        s.trials[0], s.hits[0] = 3, 0.2
        return s

    on = AdaptivePolicy(LINEAR)
    assert on.plan([weak_row()], torch.tensor([5]), 0) == 1 and on.staying
    probed = AdaptivePolicy(LINEAR)
    probed.probed_rows = 1  # the last plan was a probe's
    assert probed.plan([weak_row()], torch.tensor([5]), 0) == 0 and not probed.staying
    assert probed.probe_record == {1: (0.0, 1.0)}


def test_a_plan_prices_the_plain_steps_of_calls_that_draft_nothing():
    """A lookup drafts for a row on a minority of calls; when it drafts for no row the step
    runs plain. Four rows offered on a quarter of calls each (no row: 0.75^4 = 32% of steps)
    draft where the same expected gain from rows offered on every call does not pay."""
    curve = CostModel([1, 16, 64], [1.0, 1.2, 4.0])
    budget = torch.full((4,), 2)

    def row(rate: float, offers: float) -> RowStats:
        s = stats_with([rate] * 8)
        s.offers, s.calls = offers, 6.0  # offer rate (2 + offers) / 8
        return s

    sometimes = [row(0.4, 0.0) for _ in range(4)]  # offered on 1 call in 4, a_1 = 0.4
    always = [row(0.1, 6.0) for _ in range(4)]  # offered on every call, a_1 = 0.1: same gain
    assert AdaptivePolicy(curve).plan(sometimes, budget, 0) == 1
    assert AdaptivePolicy(curve).plan(always, budget, 0) == 0
    assert AdaptivePolicy(curve).seconds(4, 0, offered=0.5)(1) == pytest.approx((curve(8) + curve(4)) / 2)


def test_sampled_chains_are_cut_to_one_depth_whatever_they_drew():
    """W sampled chains (q set) are cut to the same depth in every chain, and the depth
    does not depend on the drawn tokens (chains that share a prefix, or not): a draw kept
    for its value would no longer be a draw from q. Seeded rows verify them whole."""
    g = torch.Generator().manual_seed(1)
    for case in range(60):
        B, W, L = 2, int(torch.randint(2, 4, (1,), generator=g)), int(torch.randint(3, 7, (1,), generator=g))
        apart = torch.randint(0, 50, (B, W, L), generator=g)
        same = apart[:, :1].repeat(1, W, 1)  # every chain drew the same tokens
        valid = torch.ones(B, W, L, dtype=torch.bool)
        q = torch.full((B, W, L - 1, 50), 1 / 50)
        stats = [stats_with(torch.rand(8, generator=g).tolist()) for _ in range(B)]
        policy = AdaptivePolicy([LINEAR, FLAT4, STEEP][case % 3])
        use_conf = torch.zeros(B, dtype=torch.bool)
        cuts = [policy.choose(Proposal(b, valid, q=q, confidence=torch.rand(B, W, L, generator=g)), stats, use_conf,
                              0, 0.01, False) for b in (apart, same)]
        assert torch.equal(cuts[0], cuts[1]), case
        depth = cuts[0].sum(dim=2)
        assert (depth == depth[:, :1]).all(), case  # one depth for all of a row's chains
        assert cuts[0][:, :, 0].all()
    stats[0].fixed = True
    whole = policy.choose(Proposal(apart, valid, q=q), stats, use_conf, 0, 10.0, False)
    assert whole[0].all()
