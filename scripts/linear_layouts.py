"""One-row linear products of SmolLM2's weight shapes in each layout (``specdraft.fastpath``):
float32 stock, bfloat16 stock, bfloat16 packed; and whether the packed result is bitwise
stock on this CPU (``fastpath.packed_is_stock``, the condition for the engine to use it).

Medians of alternating rounds (random weights of the real shapes; the VM drifts):

    .venv/bin/python scripts/linear_layouts.py --rounds 6
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from specdraft.fastpath import pack_weight, packed_is_stock, packed_linear
from specdraft.timing import median_call_us

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # q/o, k/v, gate/up, down, LM head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = {s: torch.randn(*s) * 0.02 for s in SHAPES}
    found = {s: {"float32": [], "bf16 stock": [], "bf16 packed": []} for s in SHAPES}
    for _ in range(args.rounds):
        for s in SHAPES:
            w32 = weights[s]
            w16 = w32.bfloat16()
            packed = pack_weight(w16)
            x32 = torch.randn(1, s[1])
            x16 = x32.bfloat16()
            calls = 20 if s[0] > 10000 else 100
            found[s]["float32"].append(median_call_us(lambda: F.linear(x32, w32), calls))
            found[s]["bf16 stock"].append(median_call_us(lambda: F.linear(x16, w16), calls))
            found[s]["bf16 packed"].append(median_call_us(lambda: packed_linear(x16, packed), calls))
    for s in SHAPES:
        cells = ", ".join(f"{k} {statistics.median(v):.1f} us" for k, v in found[s].items())
        print(f"{s[0]} x {s[1]}: {cells}; packed bitwise stock: {packed_is_stock(weights[s].bfloat16())}")


if __name__ == "__main__":
    main()
