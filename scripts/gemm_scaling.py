"""How inductor's GEMM choice for a dynamic graph scales with the rows it is run at: the
linear products of one SmolLM2 decoder layer (q, k, v, o; gate, up, down) compiled as ``Target.compile`` compiles
the target (frozen, max_autotune, dynamic shapes), first called at one row (its static graph)
and then at ``--hint`` rows (the dynamic graph's autotuning happens there), then timed at
several row counts beside eager. Medians of 200 calls.

A dynamic graph keeps the kernels tuned at its first call for every size after: with the C++
GEMM among the choices and a hint of 2 it wins there and then scales badly, which is why
``specdraft.graphs`` leaves it to the graphs of one and of few rows.

    .venv/bin/python scripts/gemm_scaling.py --backends CPP,ATEN --hint 2
    .venv/bin/python scripts/gemm_scaling.py --backends ATEN --hint 2
"""

from __future__ import annotations

import argparse

import torch
import torch._inductor.config as inductor_config

from specdraft.graphs import CPU_INDUCTOR_OPTIONS
from specdraft.models import parse_dtype
from specdraft.timing import median_call_us


class LayerLinears(torch.nn.Module):
    """The linear products of one SmolLM2 decoder layer (attention itself left out): q, k, v
    and o projections, then the gated MLP."""

    def __init__(self, width: int, kv_width: int, inner: int, dtype: torch.dtype):
        super().__init__()
        shapes = dict(q=(width, width), k=(width, kv_width), v=(width, kv_width), o=(width, width),
                      gate=(width, inner), up=(width, inner), down=(inner, width))
        for name, (i, o) in shapes.items():
            setattr(self, name, torch.nn.Linear(i, o, bias=False, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = x + self.o(q * (k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)))  # stands in for attention
        return h + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", default="CPP,ATEN", help="inductor's max_autotune_gemm_backends")
    p.add_argument("--hint", type=int, default=2, help="rows of the dynamic graph's first call")
    p.add_argument("--rows", default="1,2,3,4,6,8,16")
    args = p.parse_args()
    dtype = parse_dtype(args.dtype)
    torch.manual_seed(0)
    mlp = LayerLinears(576, 192, 1536, dtype).eval()
    compiled = torch.compile(mlp, dynamic=True)
    options = {**CPU_INDUCTOR_OPTIONS, "max_autotune_gemm_backends": args.backends}
    with torch.no_grad(), inductor_config.patch(options):
        compiled(torch.randn(1, 1, 576, dtype=dtype))  # the static one-row graph
        compiled(torch.randn(1, args.hint, 576, dtype=dtype))  # the dynamic graph, tuned here
        print(f"backends {args.backends}, dynamic graph tuned at {args.hint} rows")
        print("| rows | eager µs | compiled µs |")
        print("|---|---|---|")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(1, rows, 576, dtype=dtype)
            eager, fast = median_call_us(lambda: mlp(x), 200), median_call_us(lambda: compiled(x), 200)
            print(f"| {rows} | {eager:.0f} | {fast:.0f} |")


if __name__ == "__main__":
    main()
