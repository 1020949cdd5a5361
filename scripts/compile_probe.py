"""Does ``torch.compile`` make the target's decode forward faster here, and is it exact?

Times the engine's one-token forward (and a few tree sizes) of the target through
``Target.forward`` + ``Target.logits`` after a cached prefix (``specdraft.timing``, the
code of ``bench --verify-cost``), eager and with the decoder stack compiled, and checks
that the compiled logits are bitwise the eager ones. Issue 14 asks to keep compile only
if it is faster and exact; this measures both.

    .venv/bin/python scripts/compile_probe.py --dtype bfloat16 --tokens 1,4,8
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
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--mode", default="default", help="torch.compile mode")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    target = load_target("default", dtype=args.dtype)
    cache = prefill(target, args.prefix, args.prefix + max(sizes) + 8)
    eager = {n: statistics.median(time_forward(target, cache, n, args.prefix, args.trials, 3)) for n in sizes}
    reference = {n: logits_of(target, cache, n, args.prefix) for n in sizes}
    target.base = torch.compile(target.base, mode=args.mode, dynamic=True)
    started = time.perf_counter()
    compiled_first = {n: logits_of(target, cache, n, args.prefix) for n in sizes}  # compiles
    compile_seconds = time.perf_counter() - started
    compiled = {n: statistics.median(time_forward(target, cache, n, args.prefix, args.trials, 3)) for n in sizes}
    rows = [{"tokens": n, "eager_ms": 1000 * eager[n], "compiled_ms": 1000 * compiled[n],
             "speedup": eager[n] / compiled[n],
             "bitwise_equal": bool(torch.equal(reference[n], compiled_first[n])),
             "max_abs_diff": float((reference[n] - compiled_first[n]).abs().max())} for n in sizes]
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "mode": args.mode,
                      "compile_seconds": compile_seconds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
