"""Does ``--compile-target`` make the target's forward faster here, and how far from eager?

Loads the target twice: one copy eager (the engine's layouts, ``specdraft.fastpath``), one
compiled exactly as the engine compiles it (``Target.compile``: inductor, dynamic shapes,
frozen weights on CPU). Times the engine's forward (+ logits) of a few chain-token counts
after a cached prefix (``specdraft.timing``, the code of ``bench --verify-cost``), the two
copies in alternating rounds so that a drifting VM affects both alike, and compares the
compiled logits with the eager ones (bitwise equal or not, largest difference).

    .venv/bin/python scripts/compile_probe.py --dtype bfloat16 --tokens 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdraft.models import load_target
from specdraft.timing import prefill, time_forward


def logits_of(target, cache, n: int, prefix: int) -> torch.Tensor:
    """The logits of n chain tokens after the prefix (the tokens ``time_forward`` uses)."""
    ids = torch.randint(target.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    positions = (prefix + torch.arange(n))[None]
    mask = cache.attention_mask(torch.ones(n, n, dtype=torch.bool).tril()[None])
    with torch.no_grad():
        return target.logits(target.forward(ids, positions, mask, cache))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default="1,4,8")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (3 timed forwards each)")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    eager, compiled = load_target("default", dtype=args.dtype), load_target("default", dtype=args.dtype)
    caches = {name: prefill(t, args.prefix, args.prefix + max(sizes) + 8) for name, t in
              (("eager", eager), ("compiled", compiled))}
    reference = {n: logits_of(eager, caches["eager"], n, args.prefix) for n in sizes}
    compiled.compile()
    started = time.perf_counter()
    first = {n: logits_of(compiled, caches["compiled"], n, args.prefix) for n in sizes}  # compiles
    compile_seconds = time.perf_counter() - started
    times: dict[str, dict[int, list[float]]] = {"eager": {n: [] for n in sizes}, "compiled": {n: [] for n in sizes}}
    for _ in range(args.rounds):
        for name, target in (("eager", eager), ("compiled", compiled)):
            for n in sizes:
                times[name][n] += time_forward(target, caches[name], n, args.prefix, 3, 1)
    rows = []
    for n in sizes:
        e, c = statistics.median(times["eager"][n]), statistics.median(times["compiled"][n])
        rows.append({"tokens": n, "eager_ms": round(1000 * e, 2), "compiled_ms": round(1000 * c, 2),
                     "speedup": round(e / c, 3), "bitwise_equal": bool(torch.equal(reference[n], first[n])),
                     "max_abs_diff": float((reference[n] - first[n]).abs().max())})
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "compile_seconds": round(compile_seconds, 1),
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
