"""What ``--compile-target`` costs at start and what inductor's on-disk cache saves of it: the
target compiled as ``build.compile_target`` compiles it (each size class of ``specdraft.graphs``
after a 16-token prefill), with the seconds of each class's first call and inductor's FX-graph
cache counters (hit / miss / bypass), then the compiled forward's speed per class (256 tokens
cached, median of 15). Extra inductor options (``key=value``) are laid over
``graphs.CPU_INDUCTOR_OPTIONS``; point ``TORCHINDUCTOR_CACHE_DIR`` at an empty folder for a cold
start.

    .venv/bin/python scripts/compile_cost.py
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cold .venv/bin/python scripts/compile_cost.py
    .venv/bin/python scripts/compile_cost.py cpp.weight_prepack=False
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch._dynamo.utils import counters

from specdraft import graphs, load_target
from specdraft.build import COMPILE_CLASSES
from specdraft.timing import prefill, time_forward

TIMED = ((1, 1), (1, 2), (1, 4), (1, 6), (1, 8), (2, 1), (8, 1))  # (rows, tokens) timed after


def option(text: str) -> tuple[str, object]:
    key, value = text.split("=", 1)
    return key, {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("options", nargs="*", type=option, help="inductor options key=value")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-speed", action="store_true", help="compile only")
    args = p.parse_args()
    graphs.CPU_INDUCTOR_OPTIONS.update(dict(args.options))
    target = load_target("default", dtype=args.dtype)
    start = time.time()
    target.compile("inductor")
    prefix = 16
    for rows, sizes in COMPILE_CLASSES:
        cache = prefill(target, prefix, 2 * prefix, rows=rows)
        for n in sizes:
            began = time.time()
            time_forward(target, cache, n, prefix, trials=0, warmup=1)
            fx = counters["inductor"]
            print(f"compile: {rows} row(s) x {n} token(s) {time.time() - began:.1f} s; FX graph cache "
                  f"hit/miss/bypass so far {fx['fxgraph_cache_hit']}/{fx['fxgraph_cache_miss']}/"
                  f"{fx['fxgraph_cache_bypass']}", flush=True)
    print(f"compile: {time.time() - start:.1f} s in all (prefills included)", flush=True)
    if args.no_speed:
        return
    target.warmed()
    for rows, n in TIMED:
        cache = prefill(target, 256, 320, rows=rows)
        ms = 1e3 * statistics.median(time_forward(target, cache, n, 256, trials=15, warmup=2))
        print(f"forward + logits: {rows} row(s) x {n} token(s) {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
