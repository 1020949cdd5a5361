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

In bfloat16 (oneDNN kernels, AVX512-BF16) the stock ``F.linear`` is the fastest at every
row count measured (1-16 rows; the transposed layout made a 4-token forward 37 ms against
29 ms), so bfloat16 and float16 keep it. ``LAYOUTS`` records the choice per dtype; the
figures are in docs/engine.md ("Kernels per dtype").

``small_batch_linear(model)`` patches the model's ``nn.Linear`` instances (not the class)
so that, only inside ``active()`` and only on CPU with at most ``MAX_ROWS`` rows, they use
the dtype's layout. Outside ``active()`` (e.g. transformers' own ``generate`` on the same
model, a baseline in our benchmarks) they behave exactly as stock. The result equals
F.linear up to floating-point summation order.
"""

from __future__ import annotations

import time
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

MAX_ROWS = 32  # measured on SmolLM2 (docs above): better from 1 to 32 rows in float32
TRANSPOSED = "transposed"  # (W @ x.T).T, one row padded to two
LAYOUTS = {torch.float32: TRANSPOSED}  # weight dtype -> candidate layout on CPU; absent: stock F.linear
# The candidate is kept only where it measures faster: on an Intel Xeon with AVX-512/AMX
# (2026-11-25) MKL's one-row float32 kernel is fast and the transposed layout 3-5x slower
# (LM head, 1 row: 9.3 ms against 2.8 ms), the opposite of the AVX2 EPYC above.
CHOSEN: dict[torch.dtype, str | None] = {}  # dtype -> layout measured in this process
MEASURE_MIN_PARAMS = 1 << 20  # a smaller weight times too fast to tell; it keeps the candidate
_depth = 0  # > 0 while an engine forward runs


@contextmanager
def active():
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


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


def _median_ms(fn, trials: int = 7) -> float:
    fn()  # warm-up (first-call allocation, kernel selection)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[trials // 2]


def choose_layout(weight: torch.Tensor) -> str | None:
    """The layout this process uses for ``weight.dtype``: the dtype's candidate if it runs a
    one-row product with ``weight`` (the model's largest linear) at least 10% faster than
    stock ``F.linear`` on this machine, else None (stock). Measured once per dtype."""
    dtype = weight.dtype
    if dtype not in CHOSEN:
        candidate = LAYOUTS.get(dtype)
        if candidate is None or weight.device.type != "cpu" or weight.numel() < MEASURE_MIN_PARAMS:
            return candidate
        x = torch.zeros(1, weight.shape[1], dtype=dtype)
        with torch.no_grad():
            stock = _median_ms(lambda: F.linear(x, weight))
            mine = _median_ms(lambda: transposed_linear(x, weight))
        CHOSEN[dtype] = candidate if mine < 0.9 * stock else None
    return CHOSEN[dtype]


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Cheap tests first: this runs for every linear of every forward.
    if _depth == 0 or x.is_cuda or CHOSEN.get(self.weight.dtype, LAYOUTS.get(self.weight.dtype)) is None:
        return F.linear(x, self.weight, self.bias)
    if x.numel() > MAX_ROWS * x.shape[-1] or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    return transposed_linear(x, self.weight, self.bias)


# Query rows per SDPA call in an engine forward that attends to a cache, per dtype. On CPU in
# bfloat16 (torch 2.13), a query row's attention output is bitwise the one-query result for
# calls of up to 3 query rows and differs in the last bits from 4 rows on (another kernel
# path); those bits are what made tree verification part ways with one-token decoding.
# Attention is a small part of a forward, so the few extra calls cost little.
QUERY_CHUNK = {torch.bfloat16: 3, torch.float16: 3}
ATTENTION = "specdraft_sdpa"  # the attn_implementation name targets load with


def chunked_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs):
    """transformers' SDPA attention; inside ``active()``, on CPU at a dtype of ``QUERY_CHUNK``,
    queries (B, H, q, D) that attend to a cache (more keys than queries: a verify step, not a
    prefill) run in groups of ``QUERY_CHUNK[dtype]`` rows. Returns ((B, q, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, q = QUERY_CHUNK.get(query.dtype), query.shape[2]
    if _depth == 0 or rows is None or q <= rows or key.shape[2] <= q or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for s in range(0, q, rows):
        mask = None if attention_mask is None else attention_mask[:, :, s: s + rows]
        outs.append(sdpa_attention_forward(module, query[:, :, s: s + rows], key, value, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


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
    model's largest linear decides, once per dtype, whether the candidate layout pays here."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if linears:
        choose_layout(max(linears, key=lambda m: m.weight.numel()).weight.detach())
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, "_specdraft_fastpath", False):
            module.forward = types.MethodType(_forward, module)
            module._specdraft_fastpath = True
    return model
