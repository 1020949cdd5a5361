"""Whole target forwards in two linear layouts (``specdraft.fastpath``), side by side: per tree
size, the two layouts alternate trial by trial (the order flipping every trial), and the
table gives each one's median and the median of the per-trial ratios (the VM's speed drifts
within seconds; a ratio within one trial sees one speed).

    .venv/bin/python scripts/layout_forward_ab.py --layouts stock,mkl-packed --tokens 1,2,3,4,5,6,8,10,12,16
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdraft import fastpath
from specdraft.models import load_target, parse_dtype
from specdraft.timing import prefill, time_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layouts", default="stock,mkl-packed", help="two of stock, transposed, mkl-packed, packed")
    p.add_argument("--tokens", default="1,2,3,4,5,6,8,10,12,16", help="tree sizes")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before the tree")
    p.add_argument("--trials", type=int, default=15)
    args = p.parse_args()
    layouts = [None if name == "stock" else name for name in args.layouts.split(",")]
    sizes = [int(n) for n in args.tokens.split(",")]
    target = load_target(args.target, dtype=args.dtype)
    dtype = parse_dtype(args.dtype)
    cache = prefill(target, args.prefix, args.prefix + max(sizes) + 8)
    times = {(layout, n): [] for layout in layouts for n in sizes}
    for trial in range(-1, args.trials):  # trial -1: warm-up (packed copies made, kernels chosen)
        for n in sizes:
            for layout in (layouts if trial % 2 else layouts[::-1]):
                fastpath.CHOSEN[dtype] = layout
                seconds = time_forward(target, cache, n, args.prefix, 1, 0)
                if trial >= 0:
                    times[(layout, n)] += seconds
    a, b = layouts
    print(f"| tree tokens | {a or 'stock'} ms | {b or 'stock'} ms | {b or 'stock'} / {a or 'stock'} (paired) |")
    print("|---|---|---|---|")
    for n in sizes:
        ta, tb = times[(a, n)], times[(b, n)]
        ratio = statistics.median(y / x for x, y in zip(ta, tb))
        print(f"| {n} | {1000 * statistics.median(ta):.1f} | {1000 * statistics.median(tb):.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    with torch.no_grad():
        main()
