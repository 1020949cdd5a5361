"""What one layer's attention costs on this CPU for SmolLM2's shapes (9 query heads, 3 kv heads,
head dim 64) at a few query rows and cached lengths: SDPA over keys repeated per query head
(what transformers does under torch.compile, so what a compiled target ran before), SDPA with ``enable_gqa`` (the eager engine's tree
path at batch 1, and in float32) and ``fastpath.packed_gqa_sdpa`` (what a compiled target runs, and
the eager engine's bfloat16 trees of several rows). Medians of 300 calls; B rows of q query
tokens each.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/gqa_attention_probe.py --dtype bfloat16 --batch 1,4,16
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdraft.fastpath import packed_gqa_sdpa
from specdraft.models import parse_dtype
from specdraft.timing import median_call_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cached", default="64,256,512")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes B")
    args = p.parse_args()
    dtype = parse_dtype(args.dtype)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    torch.manual_seed(0)
    print("| B | cached | query rows | repeated keys µs | enable_gqa µs | packed µs | packed max |Δ| |")
    print("|---|---|---|---|---|---|---|")
    shapes = [(int(b), int(c), int(r)) for b in args.batch.split(",") for c in args.cached.split(",")
              for r in args.rows.split(",")]
    for B, cached, q in shapes:
        query = torch.randn(B, 9, q, 64, dtype=dtype)
        key, value = torch.randn(B, 3, cached + q, 64, dtype=dtype), torch.randn(B, 3, cached + q, 64, dtype=dtype)
        mask = torch.ones(B, 1, q, cached + q, dtype=torch.bool).tril(cached)
        repeated = median_call_us(lambda: F.scaled_dot_product_attention(
            query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask, scale=0.125), 300, 20)
        gqa = median_call_us(lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125,
                                                                enable_gqa=True), 300, 20)
        packed = median_call_us(lambda: packed_gqa_sdpa(module, query, key, value, mask, scaling=0.125), 300, 20)
        diff = (packed_gqa_sdpa(module, query, key, value, mask, scaling=0.125)[0].float()
                - sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)[0].float()).abs().max()
        print(f"| {B} | {cached} | {q} | {repeated:.0f} | {gqa:.0f} | {packed:.0f} | {diff.item():.3g} |")


if __name__ == "__main__":
    main()
