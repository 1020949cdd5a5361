"""CPU matmul layouts for the few-row forwards of decoding, chosen per dtype by measurement.

In float32 on CPU (MKL), ``x @ W.T`` with a handful of rows runs far below memory
bandwidth, and with one row (a matrix-vector product) it is no better. For SmolLM2's
49152 x 576 LM head (AMD EPYC, 2 cores, float32): ``F.linear`` takes 7.6 ms for 1 row and
more for 2-16 rows, ``(W @ x.T).T`` takes 2.7 ms for 2 rows. One row is padded to two
(a zero row) so that it takes the same matrix-matrix kernel: plain decoding must not pay a
slower kernel than a 2-token tree does, or every speed-up over it is inflated. The
product's result is the transpose of a contiguous matrix; it is made contiguous again (a
copy of rows x out floats) because the attention that follows is much slower on the
transposed layout (16 rows x 1 token: 209 ms transposed, 120 ms contiguous, 133 ms stock).

In bfloat16 (oneDNN kernels, AVX512-BF16) stock ``F.linear`` reorders the plain weight into
oneDNN's blocked layout on every call; for the few rows of decoding that reorder is most of
the call. The "packed" layout reorders each weight once (``torch.ops.mkldnn``'s
``_reorder_linear_weight``, what inductor uses when it freezes a CPU model) and multiplies
with the packed copy: the same kernel, so bitwise the stock result at every row count
measured (1-256), and 1.5-2.6x faster for 1-16 rows on the AVX512-BF16 EPYC (SmolLM2's LM
head, one row: 2.5 ms against 3.9 ms; a 1536 x 576 MLP weight 31 against 59 us). It costs
a second copy of each linear weight in memory. It is kept only where it is bitwise stock
*and* not slower on this machine (``choose_layout``), and only up to the row count where it
still is (``ROW_LIMIT``: on an Intel Xeon with AMX, bitwise at 1-32 rows, not at 40 or 48);
the transposed layout made bfloat16 slower (4 tokens: 37 ms against 29 ms). ``LAYOUTS`` records the candidate per dtype; the
figures are in docs/engine.md ("Kernels per dtype").

Where float32's transposed layout does not pay (an AVX-512 Xeon: MKL's one-row kernel is
fast), MKL's stock product is still slow from 4 rows on: it packs the weight into its own
layout on every call, so a 4-row forward of SmolLM2 cost 1.36x a 1-row one. The "mkl-packed"
layout keeps MKL's packed copy (``torch.ops.mkl._mkl_reorder_linear_weight``, what inductor
uses for frozen float32 linears) per row bucket (``MKL_BUCKETS``), since a copy serves only
the row count it was packed for: 4-16 rows are padded with zero rows up to the next bucket,
1-3 rows and more than 16 run stock. Verify forwards of 4 / 8 / 16 tree tokens cost 0.85-0.90 /
0.79-0.82 / 0.76-0.90x stock's there; each bucket used costs one more copy of the weights. In
decoding that measured level for ``auto`` (batch 1 and 4, mixed in the server at 4), so it is
not chosen by measurement: ``SPECDRAFT_LINEAR_LAYOUT=mkl-packed`` asks for it.

``small_batch_linear(model)`` patches the model's ``nn.Linear`` instances (not the class)
so that, only inside ``active()`` and only on CPU with at most ``MAX_ROWS`` rows, they use
the dtype's layout. Outside ``active()`` (e.g. transformers' own ``generate`` on the same
model, a baseline in our benchmarks) they behave exactly as stock. The result equals
F.linear up to floating-point summation order.
"""

from __future__ import annotations

import os
import time
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .errors import SpecdraftError
from .mkl_packed import MKL_BUCKETS, mkl_bucket, mkl_pack_weight, mkl_packed_linear, mkl_packing_available

TRANSPOSED = "transposed"  # (W @ x.T).T, one row padded to two
PACKED = "packed"  # oneDNN's prepacked weight, reordered once per weight
MKL_PACKED = "mkl-packed"  # float32: MKL's packed weight per row bucket, rows padded up to it
# Rows up to which a layout is used (measured on SmolLM2, docs above): the transposed layout
# is better from 1 to 32 rows in float32; the packed one is never slower (1-256 rows).
MAX_ROWS = {TRANSPOSED: 32, PACKED: None, MKL_PACKED: MKL_BUCKETS[-1]}
MIN_ROWS = {MKL_PACKED: 4}  # MKL's stock product is as fast below (it packs from 4 rows on)
LAYOUT_ENV = "SPECDRAFT_LINEAR_LAYOUT"  # overrides the measured choice (forced_layout)
LAYOUTS = {torch.float32: TRANSPOSED, torch.bfloat16: PACKED}  # weight dtype -> candidate layout on CPU; absent: stock F.linear
# The candidate is kept only where it measures faster: on an Intel Xeon with AVX-512/AMX
# (2026-11-25) MKL's one-row float32 kernel is fast and the transposed layout 3-5x slower
# (LM head, 1 row: 9.3 ms against 2.8 ms), the opposite of the AVX2 EPYC above.
CHOSEN: dict[torch.dtype, str | None] = {}  # dtype -> layout measured in this process
ROW_LIMIT: dict[torch.dtype, int] = {}  # dtype -> rows up to which the packed layout is bitwise stock here
# Row counts probed for bitwise equality: each one up to 8 (oneDNN switches kernels at small
# counts), then the batch x tree sizes of decoding, then prefill-like counts.
PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 64, 128, 256)
MEASURE_MIN_PARAMS = 1 << 20  # a smaller weight times too fast to tell; it keeps the candidate
_depth = 0  # > 0 while an engine forward runs
_bitwise = False  # the engine forward running now chunks tree queries (QUERY_CHUNK)


@contextmanager
def active(bitwise: bool | None = None):
    """The engine's kernels for the forwards inside; ``bitwise``: tree attention in reduced
    precision in ``QUERY_CHUNK`` groups (``Target.tree_attention``); None keeps the outer
    setting (a drafter's forward inside a target's)."""
    global _depth, _bitwise
    saved = _bitwise
    _depth += 1
    if bitwise is not None:
        _bitwise = bitwise
    try:
        yield
    finally:
        _depth -= 1
        _bitwise = saved


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (W @ x.T).T; x (..., in) -> (..., out), contiguous.

    A single row is padded with a zero row: MKL runs the 2-column matrix product at memory
    bandwidth but the 1-column one (a matrix-vector product) at half of it or less."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = F.pad(flat, (0, 0, 0, 1))
    y = (weight @ flat.T).T[:rows].contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) reordered once into oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) with W's packed copy; x (..., in) -> (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedCopy:
    """A weight's packed copy as a module keeps it. Copies and pickles of the module start
    without it (an opaque oneDNN tensor cannot be deep-copied): it is made again on use."""

    __slots__ = ("tensor", "of", "key")

    def __init__(self, tensor=None, of=None, key=None):
        self.tensor, self.of, self.key = tensor, of, key

    def __reduce__(self):
        return (PackedCopy, ())


def packed_weight_of(holder, weight: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``weight``'s packed copy, kept on ``holder`` (its module): oneDNN's (``rows`` 0) or
    MKL's for ``rows`` rows; made once and again only when the weight changes (another
    tensor, or written in place: its version moves). The weight itself is held and compared
    by identity: a freed weight's address may be reused by the next one, so an address alone
    could match a stale copy."""
    key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    name = f"_specdraft_packed{rows or ''}"
    copy = getattr(holder, name, None)
    if copy is None or copy.of is not weight or copy.key != key:
        tensor = mkl_pack_weight(weight.detach(), rows) if rows else pack_weight(weight.detach())
        copy = PackedCopy(tensor, weight, key)
        # object.__setattr__: a module must not see (register, move) what it holds here.
        object.__setattr__(holder, name, copy)
    return copy.tensor


def packed_stock_rows(weight: torch.Tensor) -> int:
    """The largest count R of ``PROBE_ROWS`` such that the packed layout gives bitwise
    F.linear's result for ``weight`` here at every probed count up to R (random inputs);
    0 where not even one row is (or this build or CPU has no packed product). oneDNN picks
    its kernel by row count, and only some of them match stock's."""
    if not packing_available():
        return 0
    good = 0
    try:
        packed = pack_weight(weight)
        g = torch.Generator().manual_seed(0)
        for rows in PROBE_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=g).to(weight.dtype)
            if not torch.equal(packed_linear(x, packed), F.linear(x, weight)):
                break
            good = rows
    except RuntimeError:  # an op this build or CPU does not have
        return 0
    return good


def packed_is_stock(weight: torch.Tensor) -> bool:
    """Whether the packed layout gives bitwise F.linear's result for ``weight`` here at
    one row at least (``packed_stock_rows``)."""
    return packed_stock_rows(weight) > 0


def _best_ms(stock, mine, trials: int = 9) -> tuple[float, float]:
    """The fastest of ``trials`` calls of each, in ms, the two taking turns. The fastest, not
    the median: another process on the cores only ever adds time, and a median over a busy
    spell picked stock for a whole process in our runs (packed against stock for SmolLM2's LM
    head while a second job ran: rejected in 3 of 10 sequential-median measurements)."""
    stock(), mine()  # warm-up (first-call allocation, kernel selection)
    best = [float("inf"), float("inf")]
    for _ in range(trials):
        for i, fn in enumerate((stock, mine)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return 1000 * best[0], 1000 * best[1]


def choose_layout(weight: torch.Tensor, probes: tuple[torch.Tensor, ...] = ()) -> str | None:
    """The layout this process uses for ``weight.dtype``, measured once per dtype with the
    model's largest linear: the dtype's candidate if it runs a one-row product with
    ``weight`` at least 10% faster than stock ``F.linear`` on this machine (the packed
    layout: if it is bitwise stock and not more than 10% slower), else None (stock); or the
    layout ``$SPECDRAFT_LINEAR_LAYOUT`` asks for (mkl-packed only so). A weight under
    ``MEASURE_MIN_PARAMS`` times too fast to tell: it keeps the candidate (the packed one
    only if bitwise stock). The packed layout is then used up to ``ROW_LIMIT[dtype]`` rows:
    where it is bitwise stock for ``weight`` and every weight of ``probes`` (one per shape)."""
    dtype = weight.dtype
    forced = forced_layout(dtype) if dtype not in CHOSEN else None
    if forced:
        CHOSEN[dtype] = None if forced == "stock" else forced
    if dtype not in CHOSEN:
        candidate = LAYOUTS.get(dtype)
        if candidate is None or weight.device.type != "cpu":
            return candidate
        with torch.no_grad():
            if candidate == PACKED:
                ROW_LIMIT[dtype] = min(packed_stock_rows(w) for w in (weight, *probes) if w.dtype == dtype)
                if not ROW_LIMIT[dtype]:
                    CHOSEN[dtype] = None
                    return None
            if weight.numel() < MEASURE_MIN_PARAMS:
                return candidate
            x = torch.zeros(1, weight.shape[1], dtype=dtype)
            if candidate == PACKED:
                packed = pack_weight(weight)
                stock, mine = _best_ms(lambda: F.linear(x, weight), lambda: packed_linear(x, packed))
                # The same kernel minus a per-call reorder: dropped only if clearly slower.
                CHOSEN[dtype] = candidate if mine <= 1.1 * stock else None
            else:
                stock, mine = _best_ms(lambda: F.linear(x, weight), lambda: transposed_linear(x, weight))
                CHOSEN[dtype] = candidate if mine < 0.9 * stock else None
    return CHOSEN[dtype]


def forced_layout(dtype: torch.dtype) -> str | None:
    """``$SPECDRAFT_LINEAR_LAYOUT`` where it applies to ``dtype``: "stock" (every dtype),
    "transposed" or "mkl-packed" (float32); None where unset or for another dtype. For A/B
    runs of one layout against another, and the one way to mkl-packed (opt-in)."""
    name = os.environ.get(LAYOUT_ENV, "")
    if name not in ("", "stock", TRANSPOSED, MKL_PACKED):
        raise SpecdraftError(f"${LAYOUT_ENV}={name!r}: choose stock, {TRANSPOSED} or {MKL_PACKED}")
    if name == MKL_PACKED and not mkl_packing_available():
        raise SpecdraftError(f"${LAYOUT_ENV}={name}: this torch build has no MKL")
    if name == "stock" or (name and dtype == torch.float32):
        return name
    return None


def layout_name(dtype: torch.dtype) -> str:
    """The layout this process uses for ``dtype`` as a word ("stock", "transposed", "packed<=32"):
    in the cost model's cache key and the server's start-up line (a process that chose stock
    where the candidate is faster runs few-row forwards up to ~2.8x slower)."""
    layout = CHOSEN.get(dtype, LAYOUTS.get(dtype))
    if layout == PACKED and dtype in ROW_LIMIT:
        layout += f"<={ROW_LIMIT[dtype]}"  # rows packed: what it covers changes the curve
    return layout or "stock"


def layout_for(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The layout a product of ``x`` (..., in) with ``weight`` takes now, or None for stock
    F.linear: outside ``active()``, off CPU, at a dtype without a layout, above the layout's
    row limit, (packed: oneDNN's product has no backward) where grads are wanted, or while
    traced (torch.compile, torch.export: the compiler picks its own kernels)."""
    # Cheap tests first: this runs for every linear of every forward. The compile test before
    # any other: a global read while traced becomes a guard (a recompile when it changes).
    if torch.compiler.is_compiling() or _depth == 0 or not x.is_cpu:
        return None
    layout = CHOSEN.get(weight.dtype, LAYOUTS.get(weight.dtype))
    if layout is None:
        return None
    limit = ROW_LIMIT.get(weight.dtype, MAX_ROWS[layout])  # ROW_LIMIT: packed dtypes only
    if limit is not None and x.numel() > limit * x.shape[-1]:
        return None
    if layout in MIN_ROWS and x.numel() < MIN_ROWS[layout] * x.shape[-1]:
        return None
    if layout != TRANSPOSED and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # the packed products have no backward
    return layout


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, holder, layout: str) -> torch.Tensor:
    """F.linear(x, weight, bias) in ``layout`` (of ``layout_for``); ``holder`` keeps the packed copy."""
    if layout == PACKED:
        return packed_linear(x, packed_weight_of(holder, weight), bias)
    if layout == MKL_PACKED:
        bucket = mkl_bucket(x.numel() // x.shape[-1])
        return mkl_packed_linear(x, packed_weight_of(holder, weight, bucket), weight, bias, bucket)
    return transposed_linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, holder=None) -> torch.Tensor:
    """F.linear(x, weight, bias); inside ``active()`` on CPU through the layout chosen for the
    weight's dtype. ``holder`` (any object taking attributes, e.g. the module) keeps the
    packed copy; without one the packed layout is not used."""
    layout = layout_for(x, weight)
    if layout is None or (layout != TRANSPOSED and holder is None):
        return F.linear(x, weight, bias)
    return product(x, weight, bias, holder, layout)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, self)


# Query rows per SDPA call in a bitwise engine forward (``active(bitwise=True)``,
# ``Target.tree_attention == "bitwise"``) that attends to a cache, per dtype. On CPU in
# bfloat16 (torch 2.13), a query row's attention output is bitwise the one-query result for
# calls of up to 3 query rows and differs in the last bits from 4 rows on (another kernel
# path); those bits are one of the places where tree verification parts ways with one-token
# decoding. Not the default: each extra call costs ~50 us a layer, a bf16 SmolLM2 verify
# forward of 8 tree tokens 22.5 ms chunked against 18.9 ms whole (docs/engine.md, "Tree
# attention: fast or bitwise"), and the parts that stay unclosed leave most long greedy
# outputs at near-ties against generate() either way.
QUERY_CHUNK = {torch.bfloat16: 3, torch.float16: 3}
# Dtypes whose batched trees (B >= 2 rows of 2 to PACKED_TREE_QUERIES tokens, "fast" tree
# attention) run ``packed_gqa_sdpa``: each kv head's query heads as rows of one head, so every key
# and value is read once per kv head, not once per query head as the grouped SDPA kernel reads
# them. One layer, SmolLM2's shapes, bfloat16, AVX512-BF16 EPYC, 16 rows x 2 tree tokens over 300
# / 800 cached: 0.92 -> 0.53 / 2.19 -> 1.18 ms (docs/engine.md, "Batched trees"). Not float32:
# there packed rows of 2-3 tokens are not bitwise the grouped kernel's, which float32's exactness
# (identical to generate()) rests on; not batch 1 (slower over short caches: 2 tokens over 300
# cached 64 -> 78 us), nor 8 tokens a row (mixed).
PACKED_TREE_DTYPES = (torch.bfloat16, torch.float16)
PACKED_TREE_QUERIES = 4
TREE_ATTENTION = ("fast", "bitwise")  # Target.tree_attention: one SDPA call per tree, or QUERY_CHUNK groups
ATTENTION = "specdraft_sdpa"  # the attn_implementation name targets load with


def chunked_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs):
    """transformers' SDPA attention; inside ``active()``, on CPU, queries (B, H, q, D) that
    attend to a cache (more keys than queries: a verify step, not a prefill) run as
    ``masked_gqa_sdpa`` (as ``packed_gqa_sdpa`` where B >= 2 and 2 <= q <= ``PACKED_TREE_QUERIES``
    at a dtype of ``PACKED_TREE_DTYPES``), and inside ``active(bitwise=True)`` at a dtype of ``QUERY_CHUNK``
    in groups of ``QUERY_CHUNK[dtype]`` rows. Returns ((B, q, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = query.shape[2]
    # Compiled (Target.compile), chunks would not be bitwise one-token decoding anyway (inductor's
    # kernels differ per shape) and would make every tree size its own graph.
    # (Tested first: a size test before it would become a guard, one graph per side of it.)
    if torch.compiler.is_compiling():
        return packed_gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
    if _depth == 0 or key.shape[2] <= q or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = QUERY_CHUNK.get(query.dtype) if _bitwise else None  # read after the compile test: no guard on it
    if rows is None and 1 < q <= PACKED_TREE_QUERIES and query.shape[0] > 1 and query.dtype in PACKED_TREE_DTYPES:
        return packed_gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
    if rows is None or q <= rows:
        return masked_gqa_sdpa(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for s in range(0, q, rows):
        mask = None if attention_mask is None else attention_mask[:, :, s: s + rows]
        outs.append(masked_gqa_sdpa(module, query[:, :, s: s + rows], key, value, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def own_gqa_applies(module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Our masked grouped-query attention (``masked_gqa_sdpa``, ``packed_gqa_sdpa``) applies: a
    mask, kv heads shared by several query heads, CPU, and none of transformers' extras
    (position bias, softcap, a cache object) that only its own SDPA attention handles."""
    return (attention_mask is not None and getattr(module, "num_key_value_groups", 1) >= 2
            and query.device.type == "cpu"
            and all(kwargs.get(name) is None for name in ("position_bias", "softcap", "cache")))


def masked_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs):
    """SDPA of q >= 2 query rows under a mask with grouped key/value heads passed as they are
    (``enable_gqa``), on CPU; anything else: transformers' SDPA attention. Returns
    ((B, q, H, D), None).

    Why: with a mask and q >= 2 (a tree), transformers copies every cached key and value
    ``num_key_value_groups`` times per layer (``repeat_kv``; it keeps ``enable_gqa`` for
    unmasked calls, as CUDA's fast kernels take no mask with it). On CPU the masked GQA
    kernel is bitwise the repeated one and skips the copy: SmolLM2 (9 query, 3 kv heads),
    300 cached tokens, 16 rows x 4 tree tokens, one layer: 3.7 -> 0.5 ms in float32,
    0.97 -> 0.55 ms in bfloat16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] < 2 or not own_gqa_applies(module, query, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"), enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs):
    """SDPA with each key/value head's g query heads packed as g·q rows of one head, on CPU
    under a mask; anything else: transformers' SDPA attention. Returns ((B, q, H, D), None).

    Shapes: query (B, H, q, D) with H = Hk·g (query head k·g + j reads kv head k, as
    ``repeat_kv``), key/value (B, Hk, S, D), mask (B, 1 or H, q, S) -> query (B, Hk, g·q, D),
    rows ordered (j, t), mask (B, 1 or Hk, g·q, S). E.g. SmolLM2 (9 heads, 3 kv heads), one
    token: 3 heads of 3 rows instead of 9 heads of 1 row over 3× copied keys.

    What the compiled target runs (``Target.compile``; transformers packs only one-token
    steps, and only eager). Why: CPU's flash kernel in bfloat16 is slow for a single query row
    (SmolLM2's shapes, 256 cached keys: 150 µs for 9 heads of 1 row, 65 µs of 2 rows, 60 µs
    packed), which made a compiled one-token step dearer than a two-token one (18.7 against
    15.1 ms), and the packed keys need no ``repeat_kv`` copy."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not own_gqa_applies(module, query, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = module.num_key_value_groups
    B, H, q, D = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(B, kv_heads, groups * q, D)
    mask = attention_mask
    if mask.shape[1] == 1:
        mask = mask.expand(B, 1, q, mask.shape[-1]).repeat(1, 1, groups, 1)  # row (j, t) = mask row t
    else:  # one mask per query head: its rows follow the query's
        mask = mask.expand(B, H, q, mask.shape[-1]).reshape(B, kv_heads, groups * q, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"))
    return out.reshape(B, H, q, D).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ``chunked_sdpa`` with transformers (idempotent, with SDPA's mask maker);
    returns its attn_implementation name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, chunked_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def small_batch_linear(model: torch.nn.Module) -> torch.nn.Module:
    """Patch every nn.Linear of ``model`` in place (idempotent); returns the model. The
    model's largest linear decides, once per dtype, whether the candidate layout pays here;
    one weight of each shape, up to how many rows the packed one is bitwise stock."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if linears:
        shapes = {(tuple(m.weight.shape), m.weight.dtype): m.weight.detach() for m in linears}
        choose_layout(max(linears, key=lambda m: m.weight.numel()).weight.detach(), tuple(shapes.values()))
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, "_specdraft_fastpath", False):
            module.forward = types.MethodType(_forward, module)
            module._specdraft_fastpath = True
    return model


def stock_linear(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``small_batch_linear`` for ``model``'s linears (in place; returns the model): for
    code that torch.compile traces, where inductor picks its own kernels and the layout's
    row-count test would only add a specialisation."""
    for module in model.modules():
        if getattr(module, "_specdraft_fastpath", False):
            del module.forward  # the class's own forward again
            module._specdraft_fastpath = False
    return model
