"""Compile the target's one-token graph (``Target.compile``: frozen, GEMMs autotuned) in a fresh
process and say what it cost and why inductor's on-disk cache does or does not serve it:
prints the first call's seconds (the compile), a compiled one-token forward's milliseconds
(256 cached), dynamo's per-phase compile times, the inductor / AOTAutograd cache counters, and
every reason inductor gives for bypassing its FX graph cache. ``NOPREPACK=1`` turns inductor's
mkldnn weight prepacking off (``cpp.weight_prepack``). Run it twice: the second process shows
what the caches of the first one save.

    .venv/bin/python docs/results/compile-cache-2026-12-08/compile_one_graph.py
"""
import os
import time

import torch._inductor.codecache as codecache
from torch._dynamo.utils import compile_times, counters

from specdraft.models import load_target
from specdraft.timing import prefill, time_forward

bypass_init = codecache.BypassFxGraphCache.__init__


def report_bypass(self, *args, **kwargs):
    print("FX graph cache bypassed:", *args, flush=True)
    bypass_init(self, *args, **kwargs)


codecache.BypassFxGraphCache.__init__ = report_bypass
target = load_target("default", dtype="bfloat16")
cache = prefill(target, 256, 300)  # eager: only the one-token graph is compiled below
target.compile()
if os.environ.get("NOPREPACK"):
    target.inductor_options["cpp.weight_prepack"] = False
started = time.perf_counter()
time_forward(target, cache, 1, 256, 1, 0)
print("first call (compile) %.1f s" % (time.perf_counter() - started))
print("compiled one-token forward %.2f ms" % (min(time_forward(target, cache, 1, 256, 10, 2)) * 1e3))
print(compile_times(repr="str", aggregate=True))
print({k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")})
