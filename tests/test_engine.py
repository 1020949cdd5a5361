"""The engine's bookkeeping on a tiny random target: stop conditions, streaming, stats,
ragged batches, continuous batching (admit / cancel), context limits, bad parameters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters_for_tests import RandomBeamsDrafter
from specdraft import SamplingParams, SpeculativeEngine
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.prefill import PREFILL_PADDING, prefill_groups
from specdraft.errors import SpecdraftError

PROMPTS = [[3, 4, 5, 3, 4], [5, 6, 7, 8, 9, 10, 11], [2, 3], [7, 7, 7, 8]]
# Engines run with max_tree_tokens=None (no per-step cap) so every row drafts its full
# beam and all acceptance paths run; the cap itself has its own tests below.


def reference(target, prompts, params):
    return [r.token_ids for r in SpeculativeEngine(target, NoDrafter()).generate(prompts, params)]


def test_autoregressive_engine_matches_transformers(tiny_target):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ours = reference(tiny_target, PROMPTS, params)
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([prompt])
        hf = tiny_target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=20, eos_token_id=None, pad_token_id=0)
        assert got == hf[0, len(prompt):].tolist()


def test_stats_add_up(tiny_target):
    engine = SpeculativeEngine(tiny_target, RandomBeamsDrafter(16, beam_width=3, beam_length=4, seed=3), max_tree_tokens=None)
    res = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=25, ignore_eos=True))[0]
    assert res.new_tokens == 25 == len(res.token_ids)
    assert sum(res.accepted_hist.values()) == res.steps  # one histogram entry per target forward
    assert sum(n * c for n, c in res.accepted_hist.items()) >= res.new_tokens  # the last step may be cut
    assert res.tokens_per_step == pytest.approx(res.new_tokens / res.steps)
    assert set(res.stage_seconds) == {"prefill", "draft", "verify", "accept", "update"}
    assert res.seconds >= sum(res.stage_seconds.values()) * 0.99


def test_eos_stops_and_is_kept(tiny_target):
    free = reference(tiny_target, [PROMPTS[1]], SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    eos = next(iter(tiny_target.eos_ids))
    assert eos in free, "the fixture model (seed 0) is expected to emit EOS within 60 tokens"
    res = SpeculativeEngine(tiny_target, LookupDrafter(2, 5), max_tree_tokens=None).generate([PROMPTS[1]], SamplingParams(max_new_tokens=60))[0]
    assert res.token_ids == free[: free.index(eos) + 1]
    assert res.finish_reason == "stop"


def test_stop_string_cuts_text_and_tokens(tiny_target):
    full = SpeculativeEngine(tiny_target, NoDrafter()).generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    words = full.text.split()
    stop = " ".join(words[3:5])
    res = SpeculativeEngine(tiny_target, LookupDrafter(2, 6), max_tree_tokens=None).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == "stop"
    assert stop not in res.text and full.text.startswith(res.text)
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert stop in tiny_target.tokenizer.decode(res.token_ids)


def test_streaming_deltas_join_to_the_text(tiny_target):
    engine = SpeculativeEngine(tiny_target, LookupDrafter(2, 4), max_tree_tokens=None)
    items = list(engine.stream(PROMPTS[2], SamplingParams(max_new_tokens=15, ignore_eos=True)))
    result = items[-1]
    deltas = items[:-1]
    assert len(deltas) > 1 and all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == result.text


def test_ragged_batch_with_per_row_limits(tiny_target):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 17, 9, 30)]
    want = [reference(tiny_target, [p], q)[0] for p, q in zip(PROMPTS, params)]
    engine = SpeculativeEngine(tiny_target, RandomBeamsDrafter(16, beam_width=4, beam_length=5, seed=5), max_tree_tokens=None)
    got = [r.token_ids for r in engine.generate(PROMPTS, params)]
    assert got == want


def test_continuous_batching_admit_and_cancel(tiny_target):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = reference(tiny_target, PROMPTS, params)
    engine = SpeculativeEngine(tiny_target, LookupDrafter(2, 4), max_tree_tokens=None)
    out = {i: [] for i in range(len(PROMPTS))}

    def collect(events):
        for e in events:
            out[e.request_id] += e.new_ids

    batch, events = engine.start(PROMPTS[:2], params, ids=[0, 1])
    collect(events)
    for _ in range(3):
        collect(engine.step(batch))
    collect(engine.admit(batch, PROMPTS[2:], params, ids=[2, 3]))  # join mid-flight
    collect(engine.step(batch))
    engine.cancel(batch, {1})
    assert 1 not in batch.request_ids
    while batch.rows:
        collect(engine.step(batch))
    assert out[0] == want[0] and out[2] == want[2] and out[3] == want[3]
    assert out[1] == want[1][: len(out[1])]  # cancelled: a prefix, then nothing


def test_admit_into_an_empty_batch(tiny_target):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = SpeculativeEngine(tiny_target, LookupDrafter(1, 4), max_tree_tokens=None)
    batch, _ = engine.start([PROMPTS[0]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert not batch.rows  # finished at prefill
    out = []
    for e in engine.admit(batch, [PROMPTS[1]], params, ids=[7]):
        out += e.new_ids
    while batch.rows:
        for e in engine.step(batch):
            assert e.request_id == 7
            out += e.new_ids
    assert out == reference(tiny_target, [PROMPTS[1]], params)[0]


@pytest.mark.parametrize("max_rows", [1, 3, 8])
def test_run_continuous_gives_every_prompt_its_own_text(tiny_target, max_rows):
    """Continuous batching over a list: never more than ``max_rows`` rows in a step, rows
    joining as others finish (ragged limits, one done at prefill), each prompt's text as
    decoded alone, one result per prompt."""
    prompts = PROMPTS + [[9, 8, 7], [4, 4], [6, 5, 4, 3, 2, 1]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (5, 17, 1, 30, 9, 12, 3)]
    want = [reference(tiny_target, [p], q)[0] for p, q in zip(prompts, params)]
    engine = SpeculativeEngine(tiny_target, LookupDrafter(2, 4), max_tree_tokens=None)
    widest, step = 0, engine.step

    def counting_step(batch):
        nonlocal widest
        widest = max(widest, len(batch.rows))
        return step(batch)

    engine.step = counting_step
    results = {}
    for e in engine.run_continuous(prompts, params, max_rows):
        if e.result is not None:
            assert e.request_id not in results
            results[e.request_id] = e.result.token_ids
    assert [results[i] for i in range(len(prompts))] == want
    assert 0 < widest <= max_rows


def test_context_limit_ends_generation(tiny_target):
    ctx = tiny_target.max_context
    prompt = [3, 4, 5, 6] * ((ctx - 6) // 4)
    res = SpeculativeEngine(tiny_target, LookupDrafter(2, 8), max_tree_tokens=None).generate(
        [prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(prompt) + res.new_tokens == ctx
    assert res.finish_reason == "length"


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(temperature=float("nan")),
])
def test_bad_parameters_are_user_errors(tiny_target, bad):
    with pytest.raises(SpecdraftError):
        SpeculativeEngine(tiny_target, NoDrafter()).generate([PROMPTS[0]], SamplingParams(**bad))


def test_prompt_longer_than_context_is_a_user_error(tiny_target):
    with pytest.raises(SpecdraftError, match="context"):
        SpeculativeEngine(tiny_target, NoDrafter()).generate([[3] * tiny_target.max_context], SamplingParams())


def test_seed_makes_sampling_reproducible(tiny_target):
    engine = SpeculativeEngine(tiny_target, LookupDrafter(2, 4), max_tree_tokens=None)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    a = engine.generate([PROMPTS[0]], params)[0].token_ids
    b = engine.generate([PROMPTS[0]], params)[0].token_ids
    c = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, temperature=1.0, seed=12, ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_tree_token_cap_shares_drafts_between_rows(tiny_target):
    """With max_tree_tokens=8 and 4 rows, each row drafts at most 1 token (2 with g0);
    with one row it may use its whole beam. Output is unchanged either way."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = reference(tiny_target, PROMPTS, params)
    engine = SpeculativeEngine(tiny_target, RandomBeamsDrafter(16, beam_width=1, beam_length=6, seed=2),
                               max_tree_tokens=8)
    results = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in results] == want
    for r in results:  # drafted depth per step never exceeds the share of the rows still running
        assert max(r.drafted_hist) <= 8 // 1 - 1
    assert max(results[0].drafted_hist) <= 1  # row 0 finished while all four rows were running
    alone = engine.generate([PROMPTS[0]], params)[0]
    assert max(alone.drafted_hist) == 5  # one row: the full beam (L - 1 drafted tokens) fits


def test_no_drafter_call_when_the_cap_leaves_no_row_a_draft(tiny_target):
    """With as many rows as max_tree_tokens or more (a fixed shape on a CPU: 8 tokens over 16
    rows), no row may draft: the drafter is not called, and the output is plain decoding's;
    with a share of two tokens a row it is called."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]  # 8 rows
    drafter = RandomBeamsDrafter(16, beam_width=1, beam_length=3, seed=1)
    calls = []
    propose = drafter.propose
    drafter.propose = lambda ctx: calls.append(len(ctx.g0)) or propose(ctx)
    results = SpeculativeEngine(tiny_target, drafter, max_tree_tokens=8).generate(prompts, params)
    assert [r.token_ids for r in results] == reference(tiny_target, prompts, params)
    assert not calls  # 8 tokens over 8 rows: g0 alone a row, never called
    SpeculativeEngine(tiny_target, drafter, max_tree_tokens=16).generate(prompts, params)
    assert calls and set(calls) == {8}  # g0 and one drafted token a row: called


def test_tree_token_cap_defaults_by_device(tiny_target):
    assert SpeculativeEngine(tiny_target, NoDrafter()).max_tree_tokens == 8  # CPU
    assert SpeculativeEngine(tiny_target, NoDrafter(), max_tree_tokens=None).max_tree_tokens is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_prefill_groups_cover_every_row_once_and_bound_padding(lengths):
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    if len(groups) == 1:
        assert groups[0] == list(range(len(lengths)))  # one pass: the order is kept
    for g in groups:
        if len(g) > 1:  # a group of one has no padding; larger ones stay within the bound
            assert len(g) * max(lengths[i] for i in g) <= PREFILL_PADDING * sum(lengths[i] for i in g)


def test_prompts_of_very_different_lengths_decode_as_alone(tiny_target):
    prompts = [[i % 16 for i in range(3, 60)], [5, 6], [i % 16 for i in range(9, 30)], [7, 7, 7]]
    assert len(prefill_groups([len(p) for p in prompts])) > 1
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [reference(tiny_target, [p], params)[0] for p in prompts]
    engine = SpeculativeEngine(tiny_target, RandomBeamsDrafter(16, beam_width=2, beam_length=4, seed=1), max_tree_tokens=None)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want


def test_huge_max_new_tokens_sizes_the_cache_by_the_context(tiny_target):
    """max_new_tokens far beyond the context must not size a cache of that many slots
    (issue 17: 1e11 tried to allocate terabytes): rows stop at the context, "length"."""
    prompt = [3, 4, 5, 6]
    for drafter in (NoDrafter(), LookupDrafter()):
        (result,) = SpeculativeEngine(tiny_target, drafter).generate([prompt], SamplingParams(max_new_tokens=10**11, ignore_eos=True))
        assert result.finish_reason == "length"
        assert len(prompt) + len(result.token_ids) == tiny_target.max_context
