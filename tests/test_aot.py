"""``--compile-target`` on CPU: the target's step as ahead-of-time packages kept on disk
(``aot``) decodes as the eager target, writes the engine's cache in place, is loaded (not
compiled again) by a later target, and leaves every call it cannot take to the eager stack."""

from __future__ import annotations

import torch
from conftest import make_tiny_llama

from specdraft import aot
from specdraft.drafters import NoDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.models import load_target
from specdraft.sampling import SamplingParams
from specdraft.timing import prefill, time_forward

# Without GEMM autotuning: it times each product for seconds, and what is tested here (the
# package's inputs, outputs and writes) does not depend on the kernels it picks.
FAST = {"freezing": True}


def counted(packaged) -> list:
    """Calls that ran a package, as (class, layers) keys: wraps every runner loaded so far."""
    calls = []
    for key, runner in list(packaged.runners.items()):
        if runner is not None:
            packaged.runners[key] = lambda *args, _r=runner, _k=key: calls.append(_k) or _r(*args)
    return calls


def test_a_package_decodes_as_eager_and_a_later_target_loads_it(tmp_path):
    """The one-token package, built at a warm-up forward, then serving every step of plain
    greedy decoding (its prompt, a class not built, runs eager): eager's tokens (float32, a
    tiny model far from ties), so the keys and values it writes into the engine's cache are
    the ones later steps read. A second target of the same weights loads the package from the
    folder without compiling; a target of other weights does not find it."""
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, initializer_range=0.4, num_hidden_layers=1)
    eager, packaged = load_target(str(path)), load_target(str(path))
    aot.compile_packaged(packaged, tmp_path / "packages", options=FAST)
    cache = prefill(packaged, 8, 24)  # many-tokens: built too while building is on
    time_forward(packaged, cache, 1, 8, trials=0, warmup=1)
    assert packaged.packaged.built == ["many-tokens", "one"]
    packaged.warmed()
    calls = counted(packaged.packaged)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 3, 9, 2, 5, 11, 4]]
    for prompt in prompts:
        ours = SpeculativeEngine(packaged, NoDrafter()).generate([prompt], params)
        plain = SpeculativeEngine(eager, NoDrafter()).generate([prompt], params)
        assert ours[0].token_ids == plain[0].token_ids
    assert calls.count(("one", ())) == 2 * 11 and calls.count(("many-tokens", ())) == 2

    again = load_target(str(path))
    aot.compile_packaged(again, tmp_path / "packages", options=FAST)
    assert again.packaged.folder == packaged.packaged.folder
    again.warmed()  # no building: whatever runs compiled was loaded
    ours = SpeculativeEngine(again, NoDrafter()).generate([prompts[0]], params)
    assert again.packaged.loaded == ["many-tokens", "one"] and again.packaged.built == []
    assert ours[0].token_ids == SpeculativeEngine(eager, NoDrafter()).generate([prompts[0]], params)[0].token_ids

    other = load_target(str(make_tiny_llama(tmp_path / "o", vocab_size=16, seed=1, num_hidden_layers=1)))
    assert aot.fingerprint(other, FAST) != aot.fingerprint(packaged, FAST) != aot.fingerprint(packaged, {})


def test_calls_no_package_takes_run_eager(tmp_path):
    """After warm-up nothing is built: a class without a package runs the eager stack, once
    settled (no second look on disk), and so does a call the packages' signature cannot take
    (int32 ids). A damaged package file is reported and not loaded."""
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, num_hidden_layers=1)
    eager, target = load_target(str(path)), load_target(str(path))
    aot.compile_packaged(target, tmp_path / "packages", options=FAST)
    target.warmed()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ours = SpeculativeEngine(target, NoDrafter()).generate([[1, 2, 3, 4]], params)
    assert ours[0].token_ids == SpeculativeEngine(eager, NoDrafter()).generate([[1, 2, 3, 4]], params)[0].token_ids
    assert target.packaged.built == [] and set(target.packaged.runners.values()) == {None}

    cache = prefill(target, 8, 24)
    mask = cache.attention_mask(torch.ones(1, 1, 1, dtype=torch.bool))
    inputs = dict(input_ids=torch.tensor([[3]], dtype=torch.int32), position_ids=torch.tensor([[8]]),
                  attention_mask=mask, past_key_values=cache, use_cache=True)
    assert aot.arguments(inputs, target.dtype) is None
    assert aot.arguments({**inputs, "input_ids": torch.tensor([[3]])}, target.dtype) is not None

    damaged = load_target(str(path))
    aot.compile_packaged(damaged, tmp_path / "packages", options=FAST)
    damaged.packaged.folder.mkdir(parents=True, exist_ok=True)
    (damaged.packaged.folder / "one.pt2").write_bytes(b"not a package")
    damaged.warmed()
    time_forward(damaged, prefill(damaged, 8, 24), 1, 8, trials=0, warmup=1)
    assert damaged.packaged.loaded == [] and damaged.packaged.runners[("one", ())] is None


def test_size_classes_name_every_call():
    """``graphs.size_class`` (which package, or which torch.compile graph, serves a call)."""
    from specdraft.graphs import FEW_ROWS, size_class

    assert size_class(1, 1).name == "one" and size_class(1, 1).few
    assert size_class(1, FEW_ROWS).name == "few-tokens" and size_class(1, FEW_ROWS).bounds == {1: (2, FEW_ROWS)}
    assert size_class(3, 1).name == "few-rows" and size_class(3, 1).bounds == {0: (2, FEW_ROWS)}
    assert size_class(1, FEW_ROWS + 1).name == "many-tokens" and not size_class(1, FEW_ROWS + 1).few
    assert size_class(16, 1).name == "many-rows" and size_class(16, 1).bounds[0][0] == FEW_ROWS + 1
    assert size_class(2, 2).name == "many" and size_class(2, 2).bounds.keys() == {0, 1}


def test_packages_return_the_drafters_layers_and_serve_calls_reading_fewer(tmp_path):
    """Built for a drafter reading inner layers, a package returns them (as the eager stack's
    ``Target.states`` does) and also serves a call reading none (the cost model's timing,
    plain decoding): one set of packages, not two."""
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, num_hidden_layers=2)
    eager, target = load_target(str(path)), load_target(str(path))
    aot.compile_packaged(target, tmp_path / "packages", options=FAST, layers=(0,))
    for t in (eager, target):
        t.cache = prefill(t, 8, 24)
    mask = eager.cache.attention_mask(torch.ones(1, 1, 1, dtype=torch.bool))
    for layers in ((0,), ()):
        outs = [t.forward_features(torch.tensor([[3]]), torch.tensor([[8]]), mask, t.cache, layers) for t in (eager, target)]
        torch.testing.assert_close(outs[1][0], outs[0][0])
        if layers:
            torch.testing.assert_close(outs[1][1], outs[0][1])
        else:
            assert outs[1][1] is None
        for t in (eager, target):  # the same cache state before the next forward
            t.cache.width = 8
    assert target.packaged.built == ["many-tokens-0", "one-0"]
    plain = load_target(str(path))  # no drafter layers: finds the packages above on disk
    aot.compile_packaged(plain, tmp_path / "packages", options=FAST)
    plain.warmed()
    time_forward(plain, prefill(plain, 8, 24), 1, 8, trials=0, warmup=1)
    assert plain.packaged.loaded == ["many-tokens-0", "one-0"] and plain.packaged.built == []


def test_a_bench_run_asks_its_packages_for_every_layer_its_drafters_read(tiny_target, tmp_path):
    """``bench.specs.feature_layers``: the union over a run's methods (peers and shape suffixes
    included), which ``specdraft bench --compile-target`` gives the packages it builds, so that
    `none` warming before a head does not build a second, layerless set."""
    from specdraft.bench.specs import feature_layers
    from specdraft.heads import ReDrafterHead

    ReDrafterHead.for_target(tiny_target, feature_layers=[0]).save(tmp_path / "head")
    specs = ["none", "hf-ar", "lookup", f"redrafter:{tmp_path / 'head'}@2x2"]
    assert feature_layers(specs, tiny_target) == (0,)
    assert feature_layers(specs[:3], tiny_target) == ()
