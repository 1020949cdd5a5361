"""Does a head that attends over the answer so far beat the paper's head? (issue 12)

The ReDrafter head sees only the target's last hidden state h_t and the next token x_{t+1}.
EAGLE's drafter also attends over the features of the earlier positions. This probe trains,
on the same position corpus (`specdraft fit`'s OUT/corpus) and the same batches, two
depth-0 heads and scores their held-out top-1 against the target's greedy choice for slot
t+2 (labels outside the draft vocabulary count as misses):

    paper:    z_t = [h_t ; SiLU(W E[x_{t+1}] + b)],  logits = O · blocks(z_t)
    context:  u_s = F z_s  for the consecutive answer positions s <= t of the same segment
              z'_t = z_t + P · attn(q(u_t), k(u_<=t), v(u_<=t))    (causal, RoPE, 9 heads)
              logits = O · blocks(z'_t)
    layer:    u_s = F [h_s ; E[x_{s+1}]], then one decoder layer of the target's own architecture,
              initialised from its last layer (causal over the segment, RoPE), output c_t:
              logits = O · blocks([z_t ; c_t])     (blocks and O at width 3d)

    .venv/bin/python scripts/context_head_probe.py --corpus runs/fit-own8k/corpus \
        --heldout runs/fit-own8k/heldout-corpus --chunks 8 --steps 1500

Prints one line per evaluation: positions seen, held-out top-1 of each head.
"""

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdraft.models import load_target
from specdraft.train.corpus import Corpus, int16_to_bf16


def segments(corpus: Corpus, max_len: int) -> list[tuple[int, int, int]]:
    """(chunk, first flat-in-chunk index, length) of runs of consecutive trained positions
    (one answer span each), cut into pieces of at most ``max_len``."""
    out = []
    for c, a in enumerate(corpus.arrays):
        pos = np.asarray(a["pos"])
        breaks = np.nonzero(np.diff(pos) != 1)[0] + 1
        for s, e in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(pos)]])):
            for b in range(int(s), int(e), max_len):
                out.append((c, b, min(int(e), b + max_len) - b))
    return out


def batch(corpus: Corpus, segs, t2d: torch.Tensor):
    """hidden (B, L, d) bf16, fed x_{t+1} (B, L), label (B, L) draft ids (-100: none/oov/pad)."""
    L = max(n for _, _, n in segs)
    d = corpus.arrays[0]["hidden"].shape[1]
    hidden = np.zeros((len(segs), L, d), dtype=np.int16)
    fed = np.zeros((len(segs), L), dtype=np.int64)
    label = np.full((len(segs), L), -1, dtype=np.int64)
    for r, (c, b, n) in enumerate(segs):
        a = corpus.arrays[c]
        t = np.asarray(a["pos"][b:b + n])
        hidden[r, :n] = a["hidden"][b:b + n]
        fed[r, :n] = a["tokens"][t + 1]
        label[r, :n] = a["greedy"][t + 1]
    label = torch.from_numpy(label)
    draft = torch.where(label >= 0, t2d[label.clamp(min=0)], torch.tensor(-100))
    return int16_to_bf16(hidden).float(), torch.from_numpy(fed), draft


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, z):
        return z + F.silu(self.linear(z))


def rope(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, hd) rotated by position 0..L-1 (base 10000)."""
    hd = x.shape[-1]
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class PaperHead(nn.Module):
    def __init__(self, E: torch.Tensor, V: int, blocks: int = 2):
        super().__init__()
        d = E.shape[1]
        self.register_buffer("E", E, persistent=False)
        self.w = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[Block(2 * d) for _ in range(blocks)])
        self.out = nn.Linear(2 * d, V, bias=False)

    def features(self, h, fed):
        return torch.cat([h, F.silu(self.w(F.embedding(fed, self.E)))], -1)

    def forward(self, h, fed):
        return self.out(self.blocks(self.features(h, fed)))


class ContextHead(PaperHead):
    def __init__(self, E, V, blocks=2, heads=9):
        super().__init__(E, V, blocks)
        d = E.shape[1]
        self.heads = heads
        self.fuse = nn.Linear(2 * d, d)
        self.norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, 2 * d)
        nn.init.zeros_(self.proj.weight)  # starts as the paper's head
        nn.init.zeros_(self.proj.bias)

    def forward(self, h, fed):
        z = self.features(h, fed)
        B, L, _ = z.shape
        q, k, v = self.qkv(self.norm(self.fuse(z))).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        # right padding: a real query never attends to a later (padded) key under causality
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        z = z + self.proj(a.transpose(1, 2).reshape(B, L, -1))
        return self.out(self.blocks(z))


class TargetLayerHead(nn.Module):
    """The paper's features plus c_t from a copy of the target's last decoder layer (the Hugging
    Face module itself, run with a causal boolean mask and explicit positions)."""

    def __init__(self, target, E, V, blocks=2):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf, d = target.model, E.shape[1]
        self.register_buffer("E", E, persistent=False)
        self.w = nn.Linear(d, d)
        self.fuse = nn.Linear(2 * d, d, bias=False)
        last = hf.model.layers[-1]
        self.layer = type(last)(hf.config, layer_idx=0)
        self.layer.load_state_dict(last.state_dict())
        self.rotary = LlamaRotaryEmbedding(hf.config)
        self.blocks = nn.Sequential(*[Block(3 * d) for _ in range(blocks)])
        self.out = nn.Linear(3 * d, V, bias=False)

    def forward(self, h, fed):
        e = F.embedding(fed, self.E)
        B, L, _ = h.shape
        u = self.fuse(torch.cat([h, e], -1))
        pos = torch.arange(L).expand(B, -1)
        causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
        c = self.layer(u, attention_mask=causal, position_ids=pos, position_embeddings=self.rotary(u, pos))
        c = c[0] if isinstance(c, tuple) else c
        return self.out(self.blocks(torch.cat([h, F.silu(self.w(e)), c], -1)))


def top1(model, corpus, segs, t2d, bs=32):
    """Share of labelled positions whose greedy label the head's argmax hits (oov: a miss)."""
    hits = n = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, len(segs), bs):
            part = segs[i:i + bs]
            h, fed, y = batch(corpus, part, t2d)
            pred = model(h, fed).argmax(-1)
            hits += ((pred == y) & (y != -100)).sum().item()  # padding and oov have y = -100
            n += has_label(corpus, part, y.shape).sum().item()
    return hits / max(n, 1)


def has_label(corpus, segs, shape):
    """(B, L) True where the target's greedy label exists (in or out of the vocabulary)."""
    out = torch.zeros(shape, dtype=torch.bool)
    for r, (c, b, n) in enumerate(segs):
        a = corpus.arrays[c]
        t = np.asarray(a["pos"][b:b + n])
        out[r, :n] = torch.from_numpy(np.asarray(a["greedy"][t + 1]) >= 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--chunks", type=int, default=8, help="train on the first N chunks")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--segment", type=int, default=128)
    parser.add_argument("--batch-segments", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="paper,context", help="any of paper, context, layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    corpus = Corpus(args.corpus, chunks=list(range(args.chunks)))
    held = Corpus(args.heldout)
    target = load_target("default", dtype="float32")
    E = target.model.get_input_embeddings().weight.detach()
    V = E.shape[0]
    counts = corpus.label_counts(V)
    keep = counts.argsort(descending=True)[: args.vocab]
    t2d = torch.full((V,), -100, dtype=torch.long)
    t2d[keep] = torch.arange(len(keep))
    train_segs, held_segs = segments(corpus, args.segment), segments(held, args.segment)
    print(json.dumps({"train_positions": len(corpus), "train_segments": len(train_segs),
                      "heldout_segments": len(held_segs)}), flush=True)
    make = {"paper": lambda: PaperHead(E, len(keep)), "context": lambda: ContextHead(E, len(keep)),
            "layer": lambda: TargetLayerHead(target, E, len(keep))}
    models = {k: make[k]() for k in args.models.split(",")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for k, m in models.items()}
    warm = max(1, args.steps // 20)
    sched = lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    seen, order, at, begin = 0, rng.permutation(len(train_segs)), 0, time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            found = {k: round(top1(m, held, held_segs, t2d), 4) for k, m in models.items()}
            print(json.dumps({"step": step, "positions": seen, "seconds": round(time.time() - begin), **found}),
                  flush=True)
        if step == args.steps:
            break
        if at + args.batch_segments > len(order):
            order, at = rng.permutation(len(train_segs)), 0
        segs = [train_segs[i] for i in order[at:at + args.batch_segments]]
        at += args.batch_segments
        h, fed, y = batch(corpus, segs, t2d)
        seen += sum(n for _, _, n in segs)
        for k, m in models.items():
            for g in opts[k].param_groups:
                g["lr"] = args.lr * sched(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(h, fed)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()


if __name__ == "__main__":
    main()
