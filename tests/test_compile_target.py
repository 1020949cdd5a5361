"""``--compile-target``: the target's decoder stack through torch.compile keeps the engine's
guarantees, and warming up leaves nothing to compile while serving."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from specdraft import graphs
from specdraft.build import compile_target, warm_up
from specdraft.drafters import NoDrafter
from specdraft.drafters.lookup import LookupDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.models import load_target
from specdraft.sampling import SamplingParams


def test_compiled_target_decodes_as_eager_and_warm_up_covers_its_shapes(tmp_path):
    """Greedy output of the compiled target with lookup drafting (trees of several tokens,
    batches of 1 and 3 rows, prompts of several lengths) equals eager plain decoding, and
    after ``warm_up`` none of those shapes compiles again (a recompile while serving would
    stall requests for minutes). The ``eager`` backend: dynamo's graph capture, guards and
    recompiles as with inductor, in seconds, and bitwise eager numerics, so equality is
    exact; inductor's own rounding is measured by ``specdraft parity --compile-target``."""
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, initializer_range=0.4, num_hidden_layers=1)
    eager, compiled = load_target(str(path)), load_target(str(path))
    compile_target(compiled, backend="eager")
    engine = SpeculativeEngine(compiled, LookupDrafter(beam_width=2, beam_length=4), max_tree_tokens=None)
    warm_up(engine)
    assert compiled.compiled and compiled.stance == "eager_on_recompile"  # what serving runs under
    compiled.stance = "fail_on_recompile"  # here: prove that warm-up left nothing to compile
    prompts = [([1, 2, 3, 4, 5] * 4)[: 6 + 5 * i] for i in range(3)]  # repeats: lookup drafts
    for rows in (prompts[:1], prompts):
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        ours = engine.generate(rows, params)
        plain = SpeculativeEngine(eager, NoDrafter()).generate(rows, params)
        assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
        assert max(max(r.accepted_hist) for r in ours) > 1  # trees of several tokens were verified


def test_inductor_freezes_the_target_on_cpu_and_decodes_as_eager(tmp_path, monkeypatch):
    """With inductor on CPU the stack is compiled frozen (weights as constants, so each linear
    weight is packed once, not per call) with inductor's GEMM autotuning on (its own C++ GEMM
    among the choices for graphs of few rows only): inductor's own
    config says so while it compiles (``torch.compile(options=...)`` did not: the weights
    stayed graph inputs). Greedy decoding through the engine, caches written by the compiled
    graph step after step, gives eager's tokens (float32, where the tiny model's logits are
    far from ties)."""
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, initializer_range=0.4, num_hidden_layers=1)
    eager, compiled = load_target(str(path)), load_target(str(path))
    seen, gemm = [], []
    real = compile_fx_module.compile_fx

    def recording(gm, example_inputs, *args, **kwargs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ids = example_inputs[next(i for i, name in enumerate(names) if "input_ids" in name)]
        seen.append((inductor_config.freezing, inductor_config.max_autotune))
        gemm.append((tuple(ids.shape), inductor_config.max_autotune_gemm_backends))
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    compiled.compile()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5, 6]]
    ours = SpeculativeEngine(compiled, NoDrafter()).generate(prompt, params)
    plain = SpeculativeEngine(eager, NoDrafter()).generate(prompt, params)
    assert seen and all(flags == (True, True) for flags in seen)  # every graph compiled frozen
    assert not inductor_config.freezing  # only around the target's calls, not process-wide
    # inductor's C++ GEMM in the graphs of one row and of few rows only (graphs.FEW_ROWS): a
    # dynamic graph keeps its first call's kernels for every size in its range, and that GEMM
    # tuned at few rows scales badly
    assert ((1, 1), "CPP,ATEN") in gemm and any(shape[1] > graphs.FEW_ROWS for shape, _ in gemm)
    few = {shape: shape[0] * shape[1] <= graphs.FEW_ROWS and min(shape) == 1 for shape, _ in gemm}
    assert all(backends == ("CPP,ATEN" if few[shape] else "ATEN") for shape, backends in gemm), gemm
    assert ours[0].token_ids == plain[0].token_ids


def test_a_feature_layer_head_runs_the_compiled_target_without_recompiles(tmp_path):
    """A ReDrafter head that reads the target's inner layers (forward hooks on the compiled
    stack's layers, set for each forward) keeps the warmed graphs: no recompile after
    ``warm_up``, and eager plain decoding's tokens. As in ``specdraft bench`` (one engine per
    method on one target), a plain engine is warmed first: the head's warm-up must still
    compile its own shape classes rather than leave them to run eager."""
    from specdraft.drafters.redrafter import ReDrafter
    from specdraft.heads import ReDrafterHead

    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, initializer_range=0.4, num_hidden_layers=2)
    eager, compiled = load_target(str(path)), load_target(str(path))
    torch.manual_seed(0)
    head = ReDrafterHead.for_target(compiled, feature_layers=[0, 1])
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.3)  # the fusion is not the identity: the features matter
    compile_target(compiled, backend="eager")
    compiled.warmed()  # as bench does once the target is compiled
    plain_engine = SpeculativeEngine(compiled, NoDrafter())
    warm_up(plain_engine)  # an earlier method's warm-up
    engine = SpeculativeEngine(compiled, ReDrafter(head.eval().requires_grad_(False), beam_width=2, beam_length=3),
                               max_tree_tokens=None)
    warm_up(engine)
    compiled.stance = "fail_on_recompile"
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9] * 3]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for rows in (prompts[:1], prompts):
        ours = engine.generate(rows, params)
        plain = SpeculativeEngine(eager, NoDrafter()).generate(rows, params)
        assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
        again = plain_engine.generate(rows, params)  # the earlier method, after the head's reads
        assert [r.token_ids for r in again] == [r.token_ids for r in plain]


def test_packed_gqa_attention_equals_repeated_heads():
    """``fastpath.packed_gqa_sdpa`` (what the compiled target's attention runs: each kv head's
    query heads packed as rows) gives transformers' SDPA over repeated keys, for one and for
    several query rows, under a shared mask and a per-head one (float32, random masks)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdraft.fastpath import packed_gqa_sdpa

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    for q, mask_heads in ((1, 1), (3, 1), (4, 9)):
        query = torch.randn(2, 9, q, 16)
        key, value = torch.randn(2, 3, 20, 16), torch.randn(2, 3, 20, 16)
        mask = torch.rand(2, mask_heads, q, 20) > 0.3
        mask[..., 0] = True  # every row attends somewhere
        ours, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
        assert ours.shape == theirs.shape == (2, q, 9, 16)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)



def test_compile_target_leaves_warm_up_nothing_to_compile_for_plain_and_lookup_decoding(tmp_path):
    """``compile_target`` compiles every graph plain decoding and a lookup drafter's trees
    run, whatever the engine's buffers look like: a one-row slice of a wider id buffer keeps
    its row stride, which failed the guards and gave the trees a graph of their own, compiled
    (and autotuned) at warm-up's first tree only."""
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, num_hidden_layers=1)
    target = load_target(str(path))
    compiled_at = []

    def recording(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        compiled_at.append(tuple(example_inputs[next(i for i, name in enumerate(names) if "input_ids" in name)].shape))
        return gm.forward

    compile_target(target, backend=recording)
    assert (1, 1) in compiled_at and any(n > 1 for _, n in compiled_at)
    compiled_at.clear()
    warm_up(SpeculativeEngine(target, LookupDrafter(beam_width=2, beam_length=4), max_tree_tokens=None))
    assert compiled_at == []


def test_compiled_target_drops_module_guards_and_keeps_input_guards(tmp_path, monkeypatch):
    """``Target.compile`` asks dynamo to drop its guards on the stack's modules (thousands of
    checks every call; freezing already assumes the modules never change) and no more: an input
    of another dtype still fails the guards (here: a recompile refused under
    ``fail_on_recompile``), so inputs still choose their graph."""
    from specdraft.timing import prefill, time_forward

    # Dynamo's graphs are cached per code object, so the decoder code compiled by earlier tests
    # in this worker counts against the recompile limit; past it dynamo runs eager without
    # raising, and whether that happened depended on the test order.
    torch._dynamo.reset()
    options = []
    real = torch.compile

    def recording(model, **kwargs):
        options.append(dict(kwargs.get("options") or {}))
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    path = make_tiny_llama(tmp_path / "t", vocab_size=16, seed=0, num_hidden_layers=1)
    target = load_target(str(path))
    compile_target(target, backend="eager")
    assert options == [{"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}]
    target.stance = "fail_on_recompile"
    cache = prefill(target, 8, 24)
    time_forward(target, cache, 1, 8, trials=0, warmup=1)  # compiled already: runs
    mask = cache.attention_mask(torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="recompile"):
        target.forward(torch.tensor([[3]], dtype=torch.int32), torch.tensor([[8]]), mask, cache)
