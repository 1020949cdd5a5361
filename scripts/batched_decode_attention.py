"""What one layer's attention costs in a batched plain-decoding step on this CPU, for SmolLM2's
shapes (9 query heads, 3 kv heads, head dim 64): B rows of one query token each over a cache of
S slots, each row's own length hidden by the mask (the engine's ``CompactCache``). Candidates:

- ``packed``: each kv head's 3 query heads as 3 rows of one head (transformers' one-token path,
  what the eager engine runs; ``fastpath.packed_gqa_sdpa`` compiled);
- ``enable_gqa``: SDPA with 9 heads of one row and grouped kv heads;
- ``matmul bf16``: q·kᵀ as a bfloat16 matmul (scores rounded to bfloat16), softmax in float32,
  then ·v — bfloat16 only (in float32 it is ``matmul f32``);
- ``matmul f32``: the same with q, k, v upcast to float32 first;
- ``flex``: ``torch.compile(flex_attention)`` with a block mask from the lengths.

Medians of ``--calls`` calls, µs, and the largest |Δ| of the output against float64.

    .venv/bin/python scripts/batched_decode_attention.py --batch 1,8,96 --cached 400
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from specdraft.models import parse_dtype
from specdraft.timing import median_call_us

HEADS, KV_HEADS, DIM = 9, 3, 64


def candidates(q, k, v, mask, with_flex: bool) -> dict:
    """name -> call returning (B, 9, 1, 64) in the inputs' dtype. q (B, 9, 1, D), k/v (B, 3, S, D),
    mask (B, 1, 1, S) bool."""
    B, S, groups = q.shape[0], k.shape[2], HEADS // KV_HEADS
    packed_q, packed_mask = q.reshape(B, KV_HEADS, groups, DIM), mask.expand(B, 1, groups, S)
    scale = DIM ** -0.5

    def matmul(upcast: bool):
        def call():
            qq, kk, vv = (t.float() for t in (packed_q, k, v)) if upcast else (packed_q, k, v)
            scores = torch.matmul(qq, kk.transpose(-1, -2)).float().mul_(scale).masked_fill_(~mask, float("-inf"))
            return torch.matmul(torch.softmax(scores, -1).to(vv.dtype), vv).to(q.dtype).reshape(B, HEADS, 1, DIM)
        return call

    calls = {
        "packed": lambda: F.scaled_dot_product_attention(packed_q, k, v, attn_mask=packed_mask).reshape(B, HEADS, 1, DIM),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "matmul f32": matmul(True),
    }
    if q.dtype != torch.float32:
        calls["matmul bf16"] = matmul(False)
    if with_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lengths = mask[:, 0, 0].sum(-1)
        block = create_block_mask(lambda b, h, qi, ki: ki < lengths[b], B, None, 1, S, device="cpu")
        # static per shape: torch 2.13 fails to build the dynamic CPU kernel on a second shape
        flex = torch.compile(flex_attention, dynamic=False)
        calls["flex"] = lambda: flex(q, k, v, block_mask=block, enable_gqa=True)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="1,8,96")
    p.add_argument("--cached", default="400", help="cache slots S; rows' lengths drawn from [S/3, S]")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--flex", action="store_true", help="also compiled flex_attention (compiles a few seconds per shape)")
    args = p.parse_args()
    dtype = parse_dtype(args.dtype)
    torch.manual_seed(0)
    print("| rows B | cached S | candidate | µs | max |Δ| vs float64 |")
    print("|---|---|---|---|---|")
    for S in (int(s) for s in args.cached.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            # Queries scaled so that scores spread like a trained model's (up to ~±15), where
            # rounding them to bfloat16 matters.
            q = (3 * torch.randn(B, HEADS, 1, DIM)).to(dtype)
            k, v = torch.randn(B, KV_HEADS, S, DIM).to(dtype), torch.randn(B, KV_HEADS, S, DIM).to(dtype)
            lengths = torch.randint(S // 3, S + 1, (B,))
            mask = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
            exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                                   v.double().repeat_interleave(3, 1), attn_mask=mask)
            for name, call in candidates(q, k, v, mask, args.flex).items():
                error = (call().double() - exact).abs().max().item()
                print(f"| {B} | {S} | {name} | {median_call_us(call, args.calls):.0f} | {error:.4f} |", flush=True)


if __name__ == "__main__":
    main()
