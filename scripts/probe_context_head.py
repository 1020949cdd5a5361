"""Probe (issue 12, lever "beyond the paper's head"): does a draft head that *attends over
the target's hidden states of the preceding tokens* (EAGLE's input) predict the next-next
token better than the paper's head, which sees only the last one?

Both are trained from scratch here, on the same positions of an extracted corpus
(``specdraft fit``'s OUT/corpus), in bfloat16 autocast, for depth 1 only, and scored on the
held-out corpus (OUT/heldout-corpus, the target's own greedy answers) the way
``fit_eval.CorpusEvaluator`` scores depth 1: top-1 of x_{t+2} given h_t and x_{t+1},
out-of-draft-vocabulary labels counted as misses.

    paper   z = [h_t ; SiLU(W·E[x_{t+1}] + b)] -> 2 residual blocks (2d) -> out (2d -> N)
    context u_t = F·[h_t ; E[x_{t+1}]] (2d -> d) -> one decoder layer of the target's
            architecture (initialised from its last layer), causal attention over the
            u of the same answer span, RoPE at the real positions -> norm -> out (d -> N)

A corpus stores h_t only at trained positions (answer slots), so the context model sees the
answer so far, not the prompt: a lower bound on what attention over the whole context
gives. Prints one JSON line per evaluation.

    .venv/bin/python scripts/probe_context_head.py --corpus runs/fit-warm640 --positions 400000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from specdraft.models import load_target
from specdraft.train.corpus import Corpus, int16_to_bf16
from specdraft.vocab import DraftVocab

IGNORE = -100


def windows(corpus: Corpus, T: int, label: str):
    """Yield (hidden (T, d) int16, inputs (T,), labels (T,), positions (T,), segment (T,))
    windows of the corpus' trained positions in order; segment ids separate answer runs so
    attention never crosses from one run (or sequence) into another."""
    for c, a in enumerate(corpus.arrays):
        pos = np.asarray(a["pos"])
        tokens, greedy, answer = np.asarray(a["tokens"]), np.asarray(a["greedy"]), np.asarray(a["answer"])
        S = tokens.shape[0]
        seg = np.concatenate([[0], np.cumsum(np.diff(pos) != 1)]) + c * 10_000_000
        inputs = tokens[np.minimum(pos + 1, S - 1)].astype(np.int64)
        if label == "greedy":
            lab = greedy[np.minimum(pos + 1, S - 1)].astype(np.int64)
            lab[lab < 0] = IGNORE
        else:
            nxt = np.minimum(pos + 2, S - 1)
            lab = np.where(answer[nxt], tokens[nxt], IGNORE).astype(np.int64)
        for s in range(0, len(pos), T):
            e = min(s + T, len(pos))
            yield (np.asarray(a["hidden"][s:e]), inputs[s:e], lab[s:e], pos[s:e], seg[s:e])


def batches(corpus: Corpus, T: int, B: int, label: str, skip: int = 0):
    buf = []
    for i, w in enumerate(windows(corpus, T, label)):
        if i < skip:
            continue
        buf.append(w)
        if len(buf) == B:
            yield collate(buf, T)
            buf = []
    if buf:
        yield collate(buf, T)


def collate(ws, T):
    B = len(ws)
    d = ws[0][0].shape[1]
    hidden = np.zeros((B, T, d), np.int16)
    inputs = np.zeros((B, T), np.int64)
    labels = np.full((B, T), IGNORE, np.int64)
    pos = np.zeros((B, T), np.int64)
    seg = np.full((B, T), -1, np.int64)
    for b, (h, x, y, p, s) in enumerate(ws):
        n = len(x)
        hidden[b, :n], inputs[b, :n], labels[b, :n], pos[b, :n], seg[b, :n] = h, x, y, p, s
    seg_t = torch.from_numpy(seg)
    same = seg_t[:, :, None] == seg_t[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (same & causal & (seg_t[:, :, None] >= 0)) | torch.eye(T, dtype=torch.bool)  # padding sees itself
    return (int16_to_bf16(hidden.reshape(-1, d)).reshape(B, T, d), torch.from_numpy(inputs),
            torch.from_numpy(labels), torch.from_numpy(pos), mask[:, None])


class PaperHead(nn.Module):
    def __init__(self, d, N, embed):
        super().__init__()
        self.embed = embed
        self.w = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Linear(2 * d, 2 * d) for _ in range(2))
        self.out = nn.Linear(2 * d, N, bias=False)

    def forward(self, h, x, pos, mask):
        z = torch.cat([h, F.silu(self.w(self.embed(x)))], -1)
        for blk in self.blocks:
            z = z + F.silu(blk(z))
        return self.out(z)


class ContextHead(nn.Module):
    def __init__(self, target_model, N, ids, embed):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = target_model.config
        d = cfg.hidden_size
        self.embed = embed
        self.fc = nn.Linear(2 * d, d, bias=False)
        last = target_model.model.layers[-1]
        self.layer = type(last)(cfg, layer_idx=0)
        self.layer.load_state_dict(last.state_dict())
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.norm = type(target_model.model.norm)(d, eps=cfg.rms_norm_eps)
        self.norm.load_state_dict(target_model.model.norm.state_dict())
        self.out = nn.Linear(d, N, bias=False)
        with torch.no_grad():
            self.out.weight.copy_(target_model.lm_head.weight[ids].float())

    def forward(self, h, x, pos, mask):
        u = self.fc(torch.cat([h, self.embed(x)], -1))
        pe = self.rotary(u, pos)
        u = self.layer(u, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        if isinstance(u, tuple):
            u = u[0]
        return self.out(self.norm(u))


class HybridHead(nn.Module):
    """The paper's head with the context model's attention output as a third input:
    z = [h_t ; SiLU(W·E[x_{t+1}] + b) ; c_t] -> 2 residual blocks (3d) -> out (3d -> N)."""

    def __init__(self, target_model, N, embed):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = target_model.config
        d = cfg.hidden_size
        self.embed = embed
        self.w = nn.Linear(d, d)
        self.fc = nn.Linear(2 * d, d, bias=False)
        last = target_model.model.layers[-1]
        self.layer = type(last)(cfg, layer_idx=0)
        self.layer.load_state_dict(last.state_dict())
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.blocks = nn.ModuleList(nn.Linear(3 * d, 3 * d) for _ in range(2))
        self.out = nn.Linear(3 * d, N, bias=False)

    def forward(self, h, x, pos, mask):
        e = self.embed(x)
        u = self.fc(torch.cat([h, e], -1))
        c = self.layer(u, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(u, pos))
        c = c[0] if isinstance(c, tuple) else c
        z = torch.cat([h, F.silu(self.w(e)), c], -1)
        for blk in self.blocks:
            z = z + F.silu(blk(z))
        return self.out(z)


@torch.no_grad()
def evaluate(model, heldout, vocab, T):
    model.eval()
    hits = count = 0
    for h, x, y, pos, mask in batches(heldout, T, 8, "text"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(h.float(), x, pos, mask).float()
        valid = y != IGNORE
        yd = vocab.to_draft(y.clamp(min=0))
        hits += int(((logits.argmax(-1) == yd) & valid & (yd >= 0)).sum())
        count += int(valid.sum())
    model.train()
    return hits / max(count, 1), count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="a fit OUT folder with corpus/, heldout-corpus/, vocab.json")
    p.add_argument("--models", default="paper,context")
    p.add_argument("--positions", type=int, default=400_000)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", default=None, help="JSONL file for the curve (appended)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    root = Path(a.corpus)
    target = load_target("default", dtype="bfloat16")
    hf = target.model
    ids = torch.tensor(json.loads((root / "vocab.json").read_text())["ids"])
    vocab = DraftVocab(len(ids), int(target.vocab_size))
    vocab.set_ids(ids)
    emb = hf.get_input_embeddings()
    embed = lambda x: emb(x).float()  # frozen, not a registered module
    train, heldout = Corpus(root / "corpus"), Corpus(root / "heldout-corpus")
    d = int(target.hidden_size)
    out = open(a.out, "a") if a.out else None
    for name in a.models.split(","):
        model = {"paper": lambda: PaperHead(d, len(ids), embed),
                 "context": lambda: ContextHead(hf, len(ids), ids, embed),
                 "hybrid": lambda: HybridHead(hf, len(ids), embed)}[name]()
        model = model.float()
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
        steps = math.ceil(a.positions / (a.window * a.batch))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        seen, step, begin = 0, 0, time.perf_counter()
        for h, x, y, pos, mask in batches(train, a.window, a.batch, "greedy"):
            yd = vocab.to_draft(y.clamp(min=0))
            yd[(y == IGNORE) | (yd < 0)] = IGNORE
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(h.float(), x, pos, mask)
            loss = F.cross_entropy(logits.float().flatten(0, 1), yd.flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            seen += int((y != IGNORE).sum())
            last = step >= steps
            if step % a.eval_every == 0 or last:
                acc, n = evaluate(model, heldout, vocab, a.window)
                row = {"model": name, "step": step, "positions": seen, "loss": round(float(loss.detach()), 4),
                       "heldout_top1_depth1": round(acc, 4), "heldout_positions": n,
                       "train_pos_per_s": round(seen / (time.perf_counter() - begin))}
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
            if last:
                break


if __name__ == "__main__":
    sys.exit(main())
