"""A drafter's linears in int8 on CPU (``--int8-drafter``): fewer bytes per draft token.

A drafter's call at batch 1 reads every weight once for a handful of rows, so on a CPU it
costs what its weights weigh. The shipped ReDrafter head reads ~32 MB per depth in float32
(two 1152 x 1152 blocks, its 1152 -> 576 projection and 8192 rows of the target's LM head);
in int8 that is ~8 MB, which stays in the L3 cache between calls. (A draft model's call is
bound by per-op overhead instead: its draft-vocabulary rows in int8 measured level, so it is
left as is; docs/engine.md.) Measured on the AVX2 EPYC
(2 threads, docs/engine.md "An int8 drafter"): the 8192 x 1152 product for 2 rows 3.7 ms in
float32, 0.22 ms in int8; the head's beam search (W = 2, L = 3) 7.1 -> 2.7 ms.

The kernel is fbgemm's dynamic quantisation (``torch.ops.quantized.linear_dynamic``):
weights int8 per output channel (symmetric, scale = max |w| / 127), activations quantised
per call to uint8 over their own range, int32 accumulation, float32 out. ``reduce_range``
keeps activations to 7 bits so AVX2's 16-bit pairwise sums cannot saturate.

Exactness does not depend on it: only the drafter's weights are quantised, never the
target's; greedy verification accepts exactly the target's tokens whatever is proposed, and
a sampled draft's q is the distribution its tokens were drawn from (int8 logits or not).
Where this torch build has no fbgemm engine, ``available()`` is False and nothing changes.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def available() -> bool:
    """fbgemm's (or its x86 successor's) quantised linear is in this torch build."""
    engines = set(torch.backends.quantized.supported_engines)
    return bool(engines & {"fbgemm", "x86"}) and hasattr(torch.ops.quantized, "linear_dynamic")


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``weight`` (out, in) quantised per output row to int8 and prepacked for fbgemm."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # an all-zero row keeps a valid scale
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch flags quantised tensors for a future release; pinned here
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())


def linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x (..., in) -> (..., out) float32 through ``packed`` (``pack``)."""
    flat = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.quantized.linear_dynamic(flat, packed, True).reshape(*x.shape[:-1], -1)


class Int8Linear(nn.Module):
    """An ``nn.Linear``'s inference-only int8 twin (float32 in and out, no parameters)."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.packed = pack(source.weight, source.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed)


def quantize_linears(module: nn.Module, names: list[str]) -> int:
    """Replace the ``nn.Linear`` submodules at ``names`` (dotted, e.g. 'blocks.0.linear') by
    ``Int8Linear``; returns how many were replaced (already-quantised ones are skipped)."""
    done = 0
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        child = getattr(parent, leaf)
        if isinstance(child, nn.Linear):
            setattr(parent, leaf, Int8Linear(child))
            done += 1
    return done
