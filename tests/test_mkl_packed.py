"""float32's mkl-packed layout (``fastpath.MKL_PACKED``): MKL's packed copy of each weight per
row bucket, rows padded up to it. It changes the kernel (so rounding, within float32's
precision), never what the engine decodes: tree forwards match stock F.linear's to float
tolerance, 1-3 rows and more than 16 run stock F.linear itself, greedy speculative output is
generate()'s, a packed copy follows its weight, and the layout runs only where
``$SPECDRAFT_LINEAR_LAYOUT`` asks for it."""

from __future__ import annotations

import types

import pytest
import torch

from drafters_for_tests import RandomBeamsDrafter
from specdraft import SamplingParams, SpeculativeEngine, fastpath
from specdraft.errors import SpecdraftError
from specdraft.parity import hf_greedy
from specdraft.timing import prefill

pytestmark = pytest.mark.skipif(not fastpath.mkl_packing_available(), reason="this torch build has no MKL")


@pytest.fixture
def mkl_layout(monkeypatch):
    """float32 forwards in the mkl-packed layout for one test (then the process's own choice)."""
    monkeypatch.setattr(fastpath, "CHOSEN", {torch.float32: fastpath.MKL_PACKED})


def tree_logits(target, n: int) -> torch.Tensor:
    """Logits (1, n, V) of an n-token chain verified after 5 cached tokens."""
    cache = prefill(target, 5, 40)
    ids = (torch.arange(1, n + 1)[None] * 7) % target.vocab_size
    chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return target.logits(target.forward(ids, 5 + torch.arange(n)[None], cache.attention_mask(chain), cache))


def test_mkl_packed_forwards_match_stock(tiny_target, mkl_layout, monkeypatch):
    """Every tree size 1-20: close to stock F.linear's logits; bitwise where the layout does
    not apply (1-3 rows, more than 16)."""
    for n in range(1, 21):
        mine = tree_logits(tiny_target, n)
        monkeypatch.setitem(fastpath.CHOSEN, torch.float32, None)  # stock F.linear
        stock = tree_logits(tiny_target, n)
        monkeypatch.setitem(fastpath.CHOSEN, torch.float32, fastpath.MKL_PACKED)
        torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)
        if n < 4 or n > 16:
            assert torch.equal(mine, stock), n


def test_rows_are_padded_to_their_bucket(monkeypatch):
    """4-16 rows run with the copy packed for the next bucket (4, 8 or 16), one copy per
    bucket on the holder, made once; other row counts and no holder run stock."""
    packed_for = []
    real_pack = fastpath.mkl_pack_weight
    # fastpath's own name for it: what packed_weight_of calls
    monkeypatch.setattr(fastpath, "mkl_pack_weight", lambda w, rows: packed_for.append(rows) or real_pack(w, rows))
    monkeypatch.setattr(fastpath, "CHOSEN", {torch.float32: fastpath.MKL_PACKED})
    weight, holder = torch.randn(48, 32), types.SimpleNamespace()
    with torch.no_grad(), fastpath.active():
        for rows in (1, 3, 4, 5, 8, 9, 16, 17, 5, 12):
            x = torch.randn(rows, 32)
            y = fastpath.linear(x, weight, holder=holder)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
        fastpath.linear(torch.randn(6, 32), weight)  # no holder to keep a copy: stock
    assert packed_for == [4, 8, 16]
    assert {name for name in vars(holder)} == {"_specdraft_packed4", "_specdraft_packed8", "_specdraft_packed16"}


def test_packed_copy_follows_its_weight(mkl_layout):
    linear = torch.nn.Linear(32, 48)
    fastpath.small_batch_linear(linear)
    x = torch.randn(5, 32)
    with torch.no_grad(), fastpath.active():
        before = linear(x)
        linear.weight.mul_(2)  # in place: the packed copy must follow
        after = linear(x)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("beam_width", [1, 4])
def test_greedy_output_is_generates(tiny_target, mkl_layout, beam_width):
    """Trees of 4-20 tokens through the mkl-packed products: still generate()'s tokens."""
    prompt = [2, 3, 4, 5]
    reference = hf_greedy(tiny_target.model, prompt, 24, tiny_target.eos_ids)
    drafter = RandomBeamsDrafter(tiny_target.vocab_size, beam_width=beam_width, beam_length=5, seed=1,
                                 oracle={0: prompt + reference})
    ours = SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(
        [prompt], SamplingParams(max_new_tokens=24))[0]
    assert ours.token_ids == reference


def test_mkl_packed_is_never_chosen_by_measurement(monkeypatch):
    """Opt-in only: where the transposed layout loses, float32 runs stock however fast the
    packed product is (in decoding it measured level for ``auto``; docs/engine.md)."""
    monkeypatch.delenv(fastpath.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    # transposed loses at one row; any later timing (an mkl-packed probe) would favour it 2x
    timings = iter([(2.8, 9.3)])
    monkeypatch.setattr(fastpath, "_best_ms", lambda stock, mine, trials=9: next(timings, (12.6, 5.9)))
    assert fastpath.choose_layout(torch.zeros(2048, 576)) is None
    assert fastpath.CHOSEN == {torch.float32: None}


@pytest.mark.parametrize("value, chosen", [("stock", None), ("mkl-packed", fastpath.MKL_PACKED),
                                           ("transposed", fastpath.TRANSPOSED)])
def test_the_layout_can_be_forced(monkeypatch, value, chosen):
    monkeypatch.setenv(fastpath.LAYOUT_ENV, value)
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "_best_ms", lambda *a, **k: pytest.fail("a forced layout is not measured"))
    assert fastpath.choose_layout(torch.zeros(2048, 576)) == chosen
    assert fastpath.layout_name(torch.float32) == (chosen or "stock")


def test_a_bad_forced_layout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(fastpath.LAYOUT_ENV, "fastest")
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    with pytest.raises(SpecdraftError, match="SPECDRAFT_LINEAR_LAYOUT"):
        fastpath.choose_layout(torch.zeros(2048, 576))
