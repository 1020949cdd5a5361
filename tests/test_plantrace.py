"""SPECDRAFT_PLAN_TRACE: one JSON line per planned step, saying what the policy decided and why."""

from __future__ import annotations

import json
import os

from specdraft.adaptive import AdaptivePolicy
from specdraft.costmodel import CostModel
from specdraft.drafters import LookupDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.sampling import SamplingParams

FLAT4 = CostModel([1, 4, 5, 8, 64], [1.0, 1.0, 2.0, 2.2, 10.0])  # up to 4 tokens for the price of 1
STEEP = CostModel([1, 2, 64], [1.0, 2.0, 64.0])  # every token costs a full forward
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]


def traced_run(tiny_target, cost, path, monkeypatch):
    """Generate with the policy on and the trace written to ``path``; returns (results, lines).
    Callers use ``steady_clock``: the plans must not depend on the machine's load."""
    monkeypatch.setenv("SPECDRAFT_PLAN_TRACE", str(path))
    engine = SpeculativeEngine(tiny_target, LookupDrafter(1, 4), policy=AdaptivePolicy(cost))
    res = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return res, [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_has_one_line_per_planned_step(tiny_target, tmp_path, monkeypatch, steady_clock):
    res, lines = traced_run(tiny_target, FLAT4, tmp_path / "plan.jsonl", monkeypatch)
    steps = max(r.steps for r in res)
    assert 0 < len(lines) <= steps - 1  # every step after prefill plans, while rows remain
    first = lines[0]
    assert first["rows"] == 2 and len(first["a1"]) == len(first["offer"]) == len(first["k1"]) == 2
    assert first["pid"] == os.getpid() and first["drafter"] == "LookupDrafter"
    assert all(k >= 2.0 for line in lines for k in line["k1"])  # the prior's strength, in trials
    assert all(0.0 <= a <= 1.0 for line in lines for a in line["a1"] + line["offer"])
    assert all(line["s"][0] <= line["s"][1] for line in lines)  # a tree step is never cheaper than a plain one
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    # Verifying 4 tokens for the price of 1: the policy drafts on (nearly) every step.
    assert sum(line["depth"] > 0 for line in lines) >= 0.8 * len(lines)


def test_trace_shows_drafting_off_when_every_token_costs_a_forward(tiny_target, tmp_path, monkeypatch, steady_clock):
    _, lines = traced_run(tiny_target, STEEP, tmp_path / "plan.jsonl", monkeypatch)
    late = lines[len(lines) // 2:]
    assert sum(line["depth"] == 0 for line in late) >= 0.8 * len(late)
    assert all(line["depth"] > 0 for line in late if line["probe"])  # a probe drafts
    # the catch-up a call would make: the steps the rows were off (no call in between)
    assert all(line["catch_up"]["gap"] >= 1 for line in late if line["probe"])


def test_no_trace_without_the_variable(tiny_target, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDRAFT_PLAN_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    SpeculativeEngine(tiny_target, LookupDrafter(1, 4), policy=AdaptivePolicy(FLAT4)).generate(
        PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert list(tmp_path.iterdir()) == []
