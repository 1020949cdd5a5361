"""``specdraft parity``'s classifier (identical / near-tie / error) on constructed cases,
``--dtype auto``'s choice (the CPU-flag probe mocked), and the structure behind a
monotone verify-cost curve (which kernels a 1-row forward runs; no timing)."""

from __future__ import annotations

import copy
import types
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import NEEDS_PACKED, PACKED_HERE, make_tiny_llama
from drafters_for_tests import RandomBeamsDrafter
from specdraft import SamplingParams, SpeculativeEngine, fastpath, models
from specdraft.errors import SpecdraftError
from specdraft.acceptance import Acceptance
from specdraft.bench.verify_cost import monotone_violations
from specdraft.cli import main
from specdraft.models import load_target
from specdraft.parity import ERROR, IDENTICAL, NEAR_TIE, compare_greedy, hf_greedy, run_parity, summary, tie_epsilon

REAL_NATIVE_BF16 = models.native_bf16  # bound at collection, before conftest's session patch

# ---- the classifier ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A tiny float32 target whose greedy continuation of PROMPT has a token with an exact
    twin (another vocabulary entry with the same LM-head row: a forced tie), plus that
    continuation and the position of the tie."""
    path = make_tiny_llama(tmp_path_factory.mktemp("twin") / "m", vocab_size=32, seed=3)
    target = load_target(str(path), dtype="float32")
    prompt = [3, 5, 7, 9]
    ref = hf_greedy(target.model, prompt, 12, target.eos_ids)
    index = next(i for i, t in enumerate(ref) if t != 0)
    tied = 31 if ref[index] != 31 else 30
    with torch.no_grad():
        target.head.weight[tied] = target.head.weight[ref[index]]
    assert hf_greedy(target.model, prompt, 12, target.eos_ids)[: index + 1] == ref[: index + 1]
    return target, prompt, ref, index, tied


def test_identical(twin):
    target, prompt, ref, _, _ = twin
    assert compare_greedy(target.model, prompt, list(ref), ref, torch.bfloat16).status == IDENTICAL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_near_tie(twin, dtype):
    """Picking the twin of generate()'s token is a divergence at a gap of exactly 0."""
    target, prompt, ref, index, tied = twin
    ours = ref[:index] + [tied] + ref[index + 1:]
    outcome = compare_greedy(target.model, prompt, ours, ref, dtype)
    assert (outcome.status, outcome.index, outcome.ours, outcome.reference) == (NEAR_TIE, index, tied, ref[index])
    assert outcome.gap == 0 and outcome.epsilon > 0 and outcome.ok


def test_wrong_token_is_an_error(twin):
    """A token far below the argmax is an error even with bfloat16's wide ε."""
    target, prompt, ref, index, _ = twin
    logits = target.model(torch.tensor([prompt + ref[:index]])).logits[0, -1]
    worst = int(logits.argmin())
    outcome = compare_greedy(target.model, prompt, ref[:index] + [worst], ref, torch.bfloat16)
    assert outcome.status == ERROR and not outcome.ok and outcome.gap >= outcome.epsilon


def test_stopping_early_is_an_error(twin):
    target, prompt, ref, _, _ = twin
    outcome = compare_greedy(target.model, prompt, ref[:3], ref)
    assert (outcome.status, outcome.index, outcome.ours) == (ERROR, 3, None)


def test_epsilon_follows_the_dtype_resolution():
    logits = torch.tensor([20.0, -3.0, 1.0])
    eps32, eps16 = tie_epsilon(torch.float32, 30, logits), tie_epsilon(torch.bfloat16, 30, logits)
    assert eps32 == pytest.approx(2.0 ** -23 * 30 ** 0.5 * 20)
    assert eps16 / eps32 == pytest.approx(2.0 ** 16)


class AcceptEverything(SpeculativeEngine):
    """A broken engine: takes beam 0 of the drafter as if the target had agreed with it."""

    def _accept(self, rows, tree, proposal, logits):
        B = proposal.beams.shape[0]
        n = proposal.valid[:, 0].sum(-1)
        path = tree.unpack[:, 0]  # beam 0's packed slots
        last = path.gather(1, (n - 1)[:, None])[:, 0]
        nxt = logits[torch.arange(B), last].argmax(-1)
        return Acceptance(path=path, n=n, next_token=nxt, beam=torch.zeros(B, dtype=torch.long))


def test_broken_engine_is_caught(tiny_target):
    """Accepting unverified random drafts makes errors, each at the first wrong token."""
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    engine = AcceptEverything(tiny_target, RandomBeamsDrafter(tiny_target.vocab_size, beam_width=1, beam_length=3,
                                                              seed=0))
    records = run_parity(engine, tiny_target.model, prompts, ["a", "b"], max_new_tokens=10, batch_size=2)
    assert [r.outcome.status for r in records] == [ERROR, ERROR]
    assert summary(records) == "parity: 0 identical, 0 near-ties, 2 errors"
    for prompt, r in zip(prompts, records):
        ref = hf_greedy(tiny_target.model, prompt, 10, tiny_target.eos_ids)
        assert r.outcome.reference == ref[r.outcome.index]


def test_parity_command(tiny_target_path, tmp_path, capsys):
    """One line per prompt, the summary line, exit 0 when nothing is an error."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["t3 t4", "t5"])))
    code = main(["parity", "--target", str(tiny_target_path), "--prompts-file", str(prompts), "--no-chat",
                 "--drafter", "lookup", "--max-new-tokens", "8", "--batch-size", "2", "--dtype", "float32"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert out == ["0: identical", "1: identical", "parity: 2 identical, 0 near-ties, 0 errors"]


def test_parity_command_bad_input(tiny_target_path, capsys):
    code = main(["parity", "--target", str(tiny_target_path), "--batch-size", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("specdraft: error: ")


# ---- --dtype auto -----------------------------------------------------------------------------


@pytest.fixture
def probe(monkeypatch):
    """The real probe, with /proc/cpuinfo's flags and torch's own CPU probes mocked."""
    monkeypatch.setattr(models, "native_bf16", REAL_NATIVE_BF16)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)

    def set_flags(*flags):
        monkeypatch.setattr(models, "cpu_flags", lambda: set(flags))
    return set_flags


@pytest.mark.parametrize("flags, expected", [(("avx512f", "avx512_bf16"), "bfloat16"), (("amx_bf16",), "bfloat16"),
                                             (("avx2", "avx512f"), "float32"), ((), "float32")])
def test_auto_dtype_on_cpu(probe, flags, expected):
    probe(*flags)
    assert models.resolve_dtype("auto", "cpu") == expected
    assert models.resolve_dtype("float32", "cpu") == "float32"  # an explicit dtype is kept


def test_auto_dtype_on_cuda(probe, monkeypatch):
    probe()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert models.resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert models.resolve_dtype("auto", torch.device("cuda")) == "float32"


@pytest.mark.parametrize("flags, expected", [(("avx512_bf16",), torch.bfloat16), ((), torch.float32)])
def test_auto_dtype_loads_and_says_so(probe, tiny_target_path, capsys, flags, expected):
    probe(*flags)
    assert load_target(str(tiny_target_path)).dtype == expected  # load_target's default is auto
    code = main(["generate", "--target", str(tiny_target_path), "--no-chat", "--prompt", "t3 t4", "--drafter",
                 "none", "--max-new-tokens", "2", "--json"])
    err = [line for line in capsys.readouterr().err.splitlines() if "dtype" in line]
    name = str(expected).removeprefix("torch.")
    assert code == 0 and len(err) == 1 and err[0].startswith(f"specdraft: dtype {name} (--dtype auto")


# ---- verify cost: structure, not timing ---------------------------------------------------------


class MatmulLog(TorchDispatchMode):
    """Records (op, input shapes) of every matrix product dispatched."""

    OPS = {"mm", "addmm", "mv", "addmv", "bmm", "baddbmm", "dot", "_linear_pointwise"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.calls.append((name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def linear_calls(target, n: int) -> list:
    """The matrix products of the linears of one engine forward of n tree tokens (after a
    5-token cache), logits included; attention's own products are left out."""
    from specdraft.timing import prefill

    cache = prefill(target, 5, 16)
    ids = torch.arange(1, n + 1)[None]
    chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with torch.no_grad(), MatmulLog() as log:
        target.logits(target.forward(ids, 5 + torch.arange(n)[None], cache.attention_mask(chain), cache))
    weights = {tuple(m.weight.shape) for m in target.model.modules() if isinstance(m, torch.nn.Linear)}
    return [c for c in log.calls if any(s in weights for s in c[1])]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=NEEDS_PACKED)])
def test_one_row_runs_the_kernels_of_two(tiny_target_path, dtype, monkeypatch):
    """Why a 1-token forward costs no more than a 2-token one (a monotone verify-cost
    curve): in float32 every linear of a 1-row forward runs the very matrix product (same
    op, same shapes) a 2-row forward runs, one row padded; in bfloat16 both run oneDNN's
    product with the packed weight. The speed of those kernels is measured by
    ``specdraft bench --verify-cost``."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})  # the dtype's candidate (a tiny model does not measure)
    target = load_target(str(tiny_target_path), dtype=dtype)
    one, two = linear_calls(target, 1), linear_calls(target, 2)
    assert one and len(one) == len(two)
    if dtype == "float32":
        assert one == two and {op for op, _ in one} == {"mm"}
        assert fastpath.LAYOUTS[target.dtype] == fastpath.TRANSPOSED
    else:
        assert fastpath.packing_available()  # the CI machine's torch has oneDNN
        assert {op for op, _ in one} == {op for op, _ in two} == {"_linear_pointwise"}
        assert fastpath.LAYOUTS[target.dtype] == fastpath.PACKED


def test_packed_layout_falls_back_where_the_cpu_lacks_it(tiny_target_path, monkeypatch):
    """On a CPU whose oneDNN has no packed bf16 product (the op raises), bfloat16 keeps
    stock F.linear: the layout is None and an engine forward runs no packed product."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})

    def no_packing(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")

    monkeypatch.setattr(fastpath, "pack_weight", no_packing)
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    assert fastpath.CHOSEN == {torch.bfloat16: None}
    assert "_linear_pointwise" not in {op for op, _ in linear_calls(target, 1) + linear_calls(target, 3)}


@NEEDS_PACKED
def test_packed_layout_is_bitwise_stock(tiny_target_path, monkeypatch):
    """bfloat16's packed layout changes speed, never values: every engine forward of a
    tiny model (1-9 tree tokens after a cache, logits included) equals the stock F.linear
    forward bitwise, and a packed weight is made again when the weight changes in place."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    from specdraft.timing import prefill

    def logits(n):
        cache = prefill(target, 5, 16)
        ids = (torch.arange(1, n + 1)[None] * 7) % target.vocab_size
        chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
        with torch.no_grad():
            return target.logits(target.forward(ids, 5 + torch.arange(n)[None], cache.attention_mask(chain), cache))

    for n in (1, 2, 3, 4, 8, 9):
        packed = logits(n)
        monkeypatch.setitem(fastpath.CHOSEN, torch.bfloat16, None)  # stock F.linear
        stock = logits(n)
        monkeypatch.setitem(fastpath.CHOSEN, torch.bfloat16, fastpath.PACKED)
        assert torch.equal(packed, stock), n
    linear = next(m for m in target.model.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(3, linear.in_features).to(torch.bfloat16)
    with torch.no_grad(), fastpath.active():
        before = linear(x)
        linear.weight.mul_(2)  # in place: the packed copy must follow
        after = linear(x)
    assert torch.equal(after, torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert not torch.equal(before, after)
    twin = copy.deepcopy(linear)  # a module holding a packed copy still copies (without it)
    with torch.no_grad(), fastpath.active():
        assert torch.equal(twin(x), after)


def test_packed_layout_needs_bitwise_equality(monkeypatch):
    """A packed product that is not bitwise stock (another oneDNN, another CPU) is not used."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    weight = torch.randn(64, 32).to(torch.bfloat16)
    # too small to time: packed wherever the CPU has the bitwise packed product
    assert fastpath.choose_layout(weight) == (fastpath.PACKED if PACKED_HERE else None)
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "packed_linear", lambda x, packed, bias=None: torch.zeros(x.shape[0], 64, dtype=x.dtype))
    assert fastpath.choose_layout(weight) is None
    assert fastpath.CHOSEN == {torch.bfloat16: None}


def test_packed_layout_stops_at_the_rows_where_it_stops_being_stock(monkeypatch):
    """oneDNN picks its packed kernel by row count, and on some CPUs only the few-row ones
    match stock (the AMX Xeon: bitwise at 1-32 rows, not at 40). The packed layout is
    used up to the last probed count where every weight shape given is bitwise stock, and
    a forward with more rows takes stock F.linear."""
    calls = []

    def stock_up_to_5(x, packed, bias=None):
        calls.append(x.shape[0])
        # stock's product stands in for oneDNN's (absent on CPUs without native bf16)
        y = torch.nn.functional.linear(x, packed, bias)
        return y if x.shape[0] <= 5 else y + 1  # wrong from 6 rows on

    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "ROW_LIMIT", {})
    monkeypatch.setattr(fastpath, "packing_available", lambda: True)
    monkeypatch.setattr(fastpath, "pack_weight", lambda w: w)
    monkeypatch.setattr(fastpath, "packed_linear", lambda x, packed, bias=None: stock_up_to_5(x, packed, bias)
                        if packed.shape[0] == 64 else torch.nn.functional.linear(x, packed, bias))
    weight, other = torch.randn(64, 32).to(torch.bfloat16), torch.randn(48, 32).to(torch.bfloat16)
    assert fastpath.packed_stock_rows(other) == fastpath.PROBE_ROWS[-1]  # this shape: stock at every count
    assert fastpath.packed_stock_rows(weight) == 5
    assert fastpath.choose_layout(other, (weight,)) == fastpath.PACKED  # too small to time: the candidate
    assert fastpath.ROW_LIMIT == {torch.bfloat16: 5}
    holder = types.SimpleNamespace()
    calls.clear()
    with torch.no_grad(), fastpath.active():
        fastpath.linear(torch.randn(5, 32).to(torch.bfloat16), weight, holder=holder)
        fastpath.linear(torch.randn(6, 32).to(torch.bfloat16), weight, holder=holder)
    assert calls == [5]  # 6 rows: stock F.linear


@pytest.mark.parametrize("stock_ms, transposed_ms, chosen", [(2.8, 9.3, None), (7.6, 2.7, "transposed"),
                                                              (3.0, 2.9, None)])
def test_layout_is_the_faster_one_on_this_machine(monkeypatch, stock_ms, transposed_ms, chosen):
    """float32's transposed layout is kept only where it measures >= 10% faster than stock
    (the AVX2 EPYC: 2.7 vs 7.6 ms for SmolLM2's LM head; the AVX-512 Xeon: 9.3 vs 2.8 ms)."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "_best_ms", lambda stock, mine, trials=9: (stock_ms, transposed_ms))
    assert fastpath.choose_layout(torch.zeros(2048, 576)) == chosen
    assert fastpath.CHOSEN == {torch.float32: chosen}
    assert fastpath.choose_layout(torch.zeros(16, 8)) == chosen  # measured once per dtype
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    assert fastpath.choose_layout(torch.zeros(16, 8)) == fastpath.TRANSPOSED  # too small to time: candidate


def test_monotone_violations():
    rows = [{"tree_tokens": n, "ms_median": ms} for n, ms in [(1, 40.0), (2, 38.0), (4, 39.6), (8, 52.0)]]
    assert [r["tree_tokens"] for r in monotone_violations(rows)] == [2]
    assert monotone_violations(rows[:1] + rows[2:]) == []


def test_engine_greedy_with_padded_rows_matches_generate(tiny_target):
    """The padded 1-row path is exact: plain decoding equals generate() token for token."""
    from specdraft.drafters import NoDrafter

    prompt = [2, 3, 4, 5]
    ours = SpeculativeEngine(tiny_target, NoDrafter()).generate([prompt], SamplingParams(max_new_tokens=16))[0]
    assert ours.token_ids == hf_greedy(tiny_target.model, prompt, 16, tiny_target.eos_ids)


def chain_and_steps(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, V) of ``ids`` verified as one chain after 5 cached tokens, and of the same
    tokens fed one forward at a time."""
    from specdraft.timing import prefill

    n = len(ids)
    with torch.no_grad():
        cache = prefill(target, 5, 16)
        chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
        tree = target.logits(target.forward(torch.tensor([ids]), 5 + torch.arange(n)[None],
                                            cache.attention_mask(chain), cache))[0]
        cache = prefill(target, 5, 16)
        steps = []
        for i, tok in enumerate(ids):
            one = torch.ones(1, 1, 1, dtype=torch.bool)
            h = target.forward(torch.tensor([[tok]]), torch.tensor([[5 + i]]), cache.attention_mask(one), cache)
            cache.commit(torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]))
            steps.append(target.logits(h)[0, 0])
    return tree, torch.stack(steps)


def batched_chain(target, prefixes: list[list[int]], ids: list[list[int]]) -> torch.Tensor:
    """Logits (B, N, V) of each row's ``ids`` verified as one chain after its cached
    ``prefixes`` (B rows of P tokens), all rows in one forward."""
    from specdraft.timing import prefill

    (B, P), n = torch.tensor(prefixes).shape, len(ids[0])
    cache = prefill(target, P, 16, rows=B, ids=torch.tensor(prefixes))
    with torch.no_grad():
        chain = torch.ones(n, n, dtype=torch.bool).tril()[None].expand(B, n, n)
        return target.logits(target.forward(torch.tensor(ids), P + torch.arange(n)[None].expand(B, n),
                                            cache.attention_mask(chain), cache))


@pytest.mark.parametrize("dtype,mode,packed", [("bfloat16", "fast", True), ("bfloat16", "bitwise", False),
                                               ("float32", "fast", False)])
def test_batched_trees_pack_query_heads_in_reduced_precision(tiny_target_path, monkeypatch, dtype, mode, packed):
    """A verify forward of several rows' trees runs ``packed_gqa_sdpa`` (each kv head's query
    heads as rows of one head) in bfloat16 with "fast" tree attention, and not in float32 (whose
    exactness rests on the grouped kernel) nor with "bitwise" trees (chunks bitwise one-token
    decoding's); one row's tree never does, nor rows of more than PACKED_TREE_QUERIES tokens. Each row's logits are those of the row verified
    alone: bitwise for bitwise trees, up to rounding elsewhere."""
    target = load_target(str(tiny_target_path), dtype=dtype, tree_attention=mode)
    calls = []
    real = fastpath.packed_gqa_sdpa
    monkeypatch.setattr(fastpath, "packed_gqa_sdpa", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    prefixes, rows = [[1, 2, 3, 4, 5], [6, 5, 4, 3, 2]], [[3, 7, 2, 9], [4, 5, 1, 8]]
    both = batched_chain(target, prefixes, rows)
    assert bool(calls) == packed and all(shape[0] == 2 and shape[2] == 4 for shape in calls)
    calls.clear()
    alone = torch.cat([batched_chain(target, [prefix], [row]) for prefix, row in zip(prefixes, rows)])
    assert not calls  # one row: the grouped kernel
    batched_chain(target, prefixes, [row + [1] * (fastpath.PACKED_TREE_QUERIES + 1 - len(row)) for row in rows])
    assert not calls  # more tokens a row than PACKED_TREE_QUERIES: the grouped kernel
    if dtype == "float32":  # more rows take other matmul blockings: rounding apart
        torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)
    elif packed:
        torch.testing.assert_close(both, alone, atol=0.1, rtol=0.05)
    else:
        assert torch.equal(both, alone)


@pytest.mark.parametrize("mode", ["bitwise", "fast"])
def test_bf16_tree_attention_modes(tiny_target_path, monkeypatch, mode):
    """In bfloat16, with ``tree_attention="bitwise"`` a verify forward of a 6-token chain gives,
    row by row, bitwise the logits of six one-token forwards (tree queries run in SDPA calls of
    QUERY_CHUNK rows); with "fast" (the default) each layer attends in one call of 6 rows, and
    the logits differ at most in rounding (the parity tool's near-ties)."""
    target = load_target(str(tiny_target_path), dtype="bfloat16", tree_attention=mode)
    assert load_target(str(tiny_target_path), dtype="bfloat16").tree_attention == "fast"
    rows = []
    real = fastpath.masked_gqa_sdpa
    monkeypatch.setattr(fastpath, "masked_gqa_sdpa", lambda *a, **k: rows.append(a[1].shape[2]) or real(*a, **k))
    tree, steps = chain_and_steps(target, [3, 7, 2, 9, 4, 5])
    if mode == "bitwise":
        assert max(rows) == fastpath.QUERY_CHUNK[torch.bfloat16]  # the tree's queries went in groups
        assert torch.equal(tree, steps)
    else:
        assert 6 in rows and max(rows) == 6  # one call per layer
        torch.testing.assert_close(tree, steps, atol=0.1, rtol=0.05)
    with pytest.raises(SpecdraftError, match="tree attention"):
        load_target(str(tiny_target_path), dtype="bfloat16", tree_attention="chunked")


def test_tree_attention_option_reaches_the_target_and_its_cost_model(tiny_target_path):
    """--tree-attention (default fast) becomes EngineSpec.tree_attention and the built target's;
    a bitwise bf16 target's cost model is cached apart (its trees cost more), a float32
    target's is not (nothing is chunked there)."""
    from specdraft.build import EngineSpec, build_engine
    from specdraft.cli import parse_args
    from specdraft.cli.options import engine_spec
    from specdraft.costmodel import cost_model_key

    assert engine_spec(parse_args(["generate", "--prompt", "x"])).tree_attention == "fast"
    spec = engine_spec(parse_args(["generate", "--prompt", "x", "--tree-attention", "bitwise"]))
    assert spec.tree_attention == "bitwise"
    keys = {}
    for dtype in ("bfloat16", "float32"):
        for mode in ("fast", "bitwise"):
            engine = build_engine(EngineSpec(target=str(tiny_target_path), dtype=dtype, drafter="lookup",
                                             tree_attention=mode))
            assert engine.target.tree_attention == mode
            keys[dtype, mode] = cost_model_key(engine.target)
    assert keys["bfloat16", "bitwise"] == keys["bfloat16", "fast"] + "|tree=bitwise"
    assert keys["float32", "bitwise"] == keys["float32", "fast"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_attention_skips_repeated_kv_heads_and_stays_bitwise(tiny_target_path, monkeypatch, dtype):
    """A verify forward of a tree (masked, several query rows) runs SDPA with the grouped
    key/value heads as they are (``enable_gqa``, no repeat_kv copies) and gives bitwise the
    logits of transformers' own SDPA attention (repeat_kv) on the same cache; rows of a batch
    with different cached lengths included. (The grouped kernel's path: bfloat16 batches pack
    their trees' query heads instead, ``test_batched_trees_pack_query_heads_in_reduced_precision``.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdraft.timing import prefill

    monkeypatch.setattr(fastpath, "PACKED_TREE_DTYPES", ())
    target = load_target(str(tiny_target_path), dtype=dtype)
    assert target.model.config.num_key_value_heads < target.model.config.num_attention_heads  # a GQA target
    from transformers.integrations import sdpa_attention

    copies = []
    real_repeat = sdpa_attention.repeat_kv
    def tree_logits():
        cache = prefill(target, 7, 20, rows=3)
        cache.lengths = torch.tensor([7, 5, 6])  # rows of a batch hold different lengths
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        ids = torch.tensor([[3, 7, 2, 9], [4, 5, 6, 1], [8, 2, 3, 3]])
        positions = cache.lengths[:, None] + torch.tensor([0, 1, 1, 2])
        copies.clear()  # count the tree forward's copies only (the prefill's are transformers')
        with torch.no_grad():
            logits = target.logits(target.forward(ids, positions, cache.attention_mask(tree[None].expand(3, 4, 4)),
                                                  cache))
        return logits, len(copies)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(a[0].shape) or real_repeat(*a))
    ours, copied = tree_logits()
    assert copied == 0  # no layer copied the cached keys and values
    monkeypatch.setattr(fastpath, "masked_gqa_sdpa", sdpa_attention_forward)  # transformers' own path
    stock, copied = tree_logits()
    assert copied > 0  # ... which repeats the heads
    assert torch.equal(ours, stock)


@pytest.mark.parametrize("stock_ms, packed_ms, chosen", [(3.9, 2.5, "packed"), (2.0, 2.1, "packed"), (2.0, 2.5, None)])
def test_packed_layout_is_dropped_only_when_clearly_slower(monkeypatch, stock_ms, packed_ms, chosen):
    """The packed product is stock's kernel without the per-call reorder: a start-up timing
    within noise of stock (here 5% slower) keeps it; only a clearly slower one (25%) drops it."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "ROW_LIMIT", {})
    monkeypatch.setattr(fastpath, "packing_available", lambda: True)
    monkeypatch.setattr(fastpath, "pack_weight", lambda w: w)
    monkeypatch.setattr(fastpath, "packed_linear", lambda x, packed, bias=None: torch.nn.functional.linear(x, packed, bias))
    monkeypatch.setattr(fastpath, "_best_ms", lambda stock, mine, trials=9: (stock_ms, packed_ms))
    assert fastpath.choose_layout(torch.zeros(2048, 576).to(torch.bfloat16)) == chosen


def test_layout_timing_takes_the_fastest_of_alternating_calls(monkeypatch):
    """A busy spell only adds time: the fastest call of each side decides, and the two sides
    take turns so that a spell hits both."""
    order, clock = [], iter(range(1000))
    monkeypatch.setattr(fastpath.time, "perf_counter", lambda: next(clock))
    stock_ms, mine_ms = fastpath._best_ms(lambda: order.append("s"), lambda: order.append("m"), trials=3)
    assert order == ["s", "m"] * 4  # warm-up, then alternating
    assert (stock_ms, mine_ms) == (1000, 1000)  # each timed call: one tick
