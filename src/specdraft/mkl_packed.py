"""MKL's packed float32 product for the few-row forwards of decoding (``fastpath.MKL_PACKED``).

From 4 rows on, MKL's stock float32 product packs the weight into its blocked layout on every
call; a copy packed once (``torch.ops.mkl._mkl_reorder_linear_weight``) skips that, but serves
only the row count it was made for (``_mkl_linear`` silently runs stock for any other). So the
layout keeps one copy per row bucket and pads rows up to it. Why and the figures:
``specdraft.fastpath`` and docs/engine.md ("Kernels per dtype").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MKL_BUCKETS = (4, 8, 16)  # row counts MKL's packed copies are made for (one copy of a weight each)


def mkl_packing_available() -> bool:
    return torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


def mkl_pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 ``weight`` (out, in) packed by MKL for products of exactly ``rows`` rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


def mkl_bucket(rows: int) -> int:
    """The row count of the MKL packed copy a product of ``rows`` rows (4-16) runs with."""
    return next(b for b in MKL_BUCKETS if b >= rows)


def mkl_packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None, bucket: int) -> torch.Tensor:
    """F.linear(x, weight, bias) with MKL's copy packed for ``bucket`` rows; x (..., in) of at
    most ``bucket`` rows, padded with zero rows to it (MKL uses a packed copy only for the
    row count it was made for, else silently runs stock). Returns (..., out)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows < bucket:
        flat = F.pad(flat, (0, 0, 0, bucket - rows))
    y = torch.ops.mkl._mkl_linear(flat.contiguous(), packed, weight, bias, bucket)[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])
