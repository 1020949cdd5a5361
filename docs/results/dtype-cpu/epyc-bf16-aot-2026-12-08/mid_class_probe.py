"""Probe: a package for 5-8 tokens at batch 1 (C++ GEMM among candidates, tuned at the hint) against the
many-tokens class (ATen only), forward + logits at 256 cached."""
import sys, time, statistics
import torch
from specdraft.models import load_target
from specdraft import aot, graphs, fastpath
from specdraft.timing import prefill
hint = int(sys.argv[1]) if len(sys.argv) > 1 else 6
backends = sys.argv[2] if len(sys.argv) > 2 else "CPP,ATEN"
t = load_target("default", dtype="bfloat16")
aot.compile_packaged(t, "/tmp/specdraft-mid-probe", options={**graphs.CPU_INDUCTOR_OPTIONS, "max_autotune_gemm_backends": backends})
ps = t.packaged
cache = prefill(t, 256, 320)
def inputs(n):
    mask = cache.attention_mask(torch.ones(1, n, n, dtype=torch.bool).tril())
    return dict(input_ids=torch.randint(1000, (1, n)), position_ids=(256 + torch.arange(n))[None], attention_mask=mask,
                past_key_values=cache, use_cache=True)
size = graphs.SizeClass(f"mid{hint}-{backends.replace(',', '')}", {1: (5, 8)}, True)
key = (size.name, ())
s = time.time()
runner = ps._build(key, size, aot.arguments(inputs(hint), t.dtype))
print("build %.0f s" % (time.time() - s), flush=True)
for n in (5, 6, 8):
    args = aot.arguments(inputs(n), t.dtype)
    ts = []
    for i in range(20):
        s = time.perf_counter(); t.logits(runner(*args)[0]); ts.append(time.perf_counter() - s)
    e = []
    for i in range(10):
        s = time.perf_counter()
        with fastpath.active(): t.logits(t.states((), **inputs(n))[0])
        e.append(time.perf_counter() - s)
    print(n, "package %.2f ms  eager %.2f ms" % (statistics.median(ts[3:]) * 1e3, statistics.median(e[2:]) * 1e3), flush=True)
