"""Verify-forward cost at bf16: chunks of 3 (the bitwise mode), balanced chunks (no 1-row chunk), one call.

Run from the project root: .venv/bin/python docs/results/tree-attention-2026-12-04/chunkcost.py [batch]"""
import statistics, sys
import torch
from specdraft import fastpath
from specdraft.models import load_target
from specdraft.timing import prefill, time_forward

t = load_target("default", "cpu", "auto")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
prefix = 256
cache = prefill(t, prefix, prefix + 64, rows=B)
sizes = [1, 4, 5, 7, 8, 10, 13, 16]
real = fastpath.chunked_sdpa

def balanced(module, query, key, value, attention_mask, **kwargs):
    rows, q = fastpath.QUERY_CHUNK.get(query.dtype), query.shape[2]
    if torch.compiler.is_compiling() or fastpath._depth == 0 or key.shape[2] <= q or rows is None or q <= rows:
        return real(module, query, key, value, attention_mask, **kwargs)
    k = -(-q // rows)
    cuts = [q // k + (i < q % k) for i in range(k)]
    outs, s = [], 0
    for c in cuts:
        outs.append(fastpath.masked_gqa_sdpa(module, query[:, :, s:s + c], key, value, attention_mask[:, :, s:s + c], **kwargs)[0])
        s += c
    return torch.cat(outs, dim=1), None

on = dict(fastpath.QUERY_CHUNK)
modes = ("chunk3", "balanced", "whole")
res = {(s, k): [] for s in sizes for k in modes}
def setmode(k):
    fastpath.QUERY_CHUNK.clear()
    if k != "whole":
        fastpath.QUERY_CHUNK.update(on)
    from transformers import AttentionInterface
    AttentionInterface.register(fastpath.ATTENTION, balanced if k == "balanced" else real)
with fastpath.active(bitwise=True):  # "whole" empties QUERY_CHUNK instead
    for rnd in range(9):
        for s in sizes:
            for k in (modes if rnd % 2 else modes[::-1]):
                setmode(k)
                res[(s, k)] += time_forward(t, cache, s, prefix, trials=3, warmup=1)
base = statistics.median(res[(1, "chunk3")])
for s in sizes:
    m = {k: statistics.median(res[(s, k)]) for k in modes}
    print(f"N={s:2d} " + "  ".join(f"{k} {m[k]*1e3:6.2f} ms ({m[k]/base:.2f}x)" for k in modes))
