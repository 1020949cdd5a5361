"""Which compiled graph a call of the target runs, and which GEMM kernels inductor may tune it with
(``--compile-target``; ``models.Target.compile``).

torch.compile gives sizes 0 and 1 graphs of their own and makes every other size dynamic: one
graph serves all of them, with the kernels autotuned at the sizes of its first call. On CPU,
inductor's own C++ GEMM and oneDNN's product scale differently with the rows M = B·N of a call
(the linear products of one SmolLM2 layer, bfloat16, AVX512-BF16 EPYC, ``scripts/gemm_scaling.py``):

    rows M                        1     2     3     4     6     8     16
    C++ GEMM, tuned at M = 2    134   164   191   217   630  1013   1970  µs
    oneDNN (ATen)               296   313   314   323   363   400    534  µs

So a call falls in one of three size classes, each its own graph:
- one row of one token: static, the C++ GEMM among the candidates;
- few rows (2 ≤ M ≤ ``FEW_ROWS``, one of B and N being 1): that dimension marked dynamic within
  [2, ``FEW_ROWS``], the C++ GEMM among the candidates;
- more: the dimensions above 1 marked dynamic from ``FEW_ROWS`` + 1 (or from 2 when both are above 1),
  ATen's kernels only.
The ranges are guards: a call outside a graph's range never runs that graph's kernels.

Worked example (batch 1): plain decoding feeds (1, 1) → the static graph; a 1 × 3 beam's tree
(1, 4) → the few-rows graph; an 8-token tree (1, 8) → the many-rows graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Inductor's config around a CPU target's compiled calls (``models.Target.compile`` says why):
# frozen weights, GEMMs autotuned with inductor's C++ GEMM among the candidates...
CPU_INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
ATEN_GEMMS = {"max_autotune_gemm_backends": "ATEN"}  # ...but not for graphs past the few rows
# Up to here the C++ GEMM tuned at two rows beats oneDNN; beyond it falls behind, and tuned at
# eight rows autotuning picks oneDNN anyway (so no class of its own for 5-8 rows).
FEW_ROWS = 4
MANY_ROWS = 1 << 20  # the upper bound of the many-rows class: more than any batch or context


@dataclass(frozen=True)
class SizeClass:
    """One graph's share of the calls (B, N): ``name``; ``bounds`` {dim: (min, max)} of the
    dimensions (0: rows B, 1: tokens N) that are dynamic in it (absent: static, of the size
    given); ``few``: inductor's C++ GEMM among its candidates."""

    name: str
    bounds: dict
    few: bool


def size_class(batch: int, tokens: int) -> SizeClass:
    """The size class of a call feeding ``tokens`` tokens in each of ``batch`` rows, e.g.
    (1, 1) one; (1, 3) few-tokens; (3, 1) few-rows; (1, 8) many-tokens; (16, 1) many-rows;
    (2, 2) many."""
    if batch * tokens == 1:
        return SizeClass("one", {}, True)
    dims = [dim for dim, size in enumerate((batch, tokens)) if size > 1]
    if not dims:  # an empty call: nothing to tune
        return SizeClass("empty", {}, False)
    if batch * tokens <= FEW_ROWS and len(dims) == 1:
        return SizeClass(("few-rows", "few-tokens")[dims[0]], {dims[0]: (2, FEW_ROWS)}, True)
    if len(dims) == 2:
        return SizeClass("many", {0: (2, MANY_ROWS), 1: (2, MANY_ROWS)}, False)
    # past the few rows, a bound no call reaches (an open one fails torch 2.13's range analysis)
    return SizeClass(("many-rows", "many-tokens")[dims[0]], {dims[0]: (FEW_ROWS + 1, MANY_ROWS)}, False)


def mark_size_class(inputs: dict) -> bool:
    """Mark ``inputs``' ``input_ids`` and ``position_ids`` (B, N) with their size class's dynamic
    ranges (``torch._dynamo.mark_dynamic``, per call: the tensors are fresh) and return whether
    inductor's C++ GEMM may serve the class (one row, or few rows along one dimension)."""
    size = size_class(*inputs["input_ids"].shape)
    for dim, (low, high) in size.bounds.items():
        for name in ("input_ids", "position_ids"):
            torch._dynamo.mark_dynamic(inputs[name], dim, min=low, max=high)
    return size.few
