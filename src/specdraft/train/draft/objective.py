"""The training objective: the draft and its loss as one module (``DraftObjective``), and
the frozen target's last hidden states the fine-tuning loss distils from (``target_hidden``:
one target pass, or the hidden-state cache)."""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..losses import kd_loss, log_probs, total_variation
from .batches import PositionBatch

STATS = ("loss", "ce", "tv", "agree", "count")  # DraftObjective's per-micro-batch sums


class DraftObjective(nn.Module):
    """The draft and its loss as one module (one DDP forward per micro-batch). The target's
    LM head is a plain function attribute, not a submodule: it is neither trained, synced
    nor checkpointed."""

    def __init__(self, draft: nn.Module, stage: str, loss: str = "tvdpp", variant: str = "exact", samples: int = 4,
                 temperature: float = 1.0, chunk: int = 1024, target_logits=None, vocab=None):
        super().__init__()
        self.draft = draft
        self.stage, self.loss_name, self.variant, self.samples = stage, loss, variant, samples
        self.temperature, self.chunk = temperature, chunk
        # With a draft vocabulary (N tokens) both sides are scored over it alone: q and the
        # target's p renormalised there (N-wide output layers, the cost that dominates a
        # small draft's step); labels outside it leave the cross-entropy.
        self.target_logits = target_logits if vocab is None else partial(target_logits, rows=vocab.ids())
        self.rows = None if vocab is None else vocab.ids()  # plain tensors: not state, not synced
        self.to_draft = None if vocab is None else vocab.to_draft

    def forward(self, input_ids, attention_mask, rows, cols, labels, target_hidden, denom):
        """Loss (sum over trained positions / denom) and stats (len(STATS),) sums."""
        hidden = self.draft.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       use_cache=False).last_hidden_state
        h = hidden[rows, cols]
        # Every parameter enters the graph even with no trained position (DDP needs a
        # gradient for each from every process).
        loss = sum(p.sum() for p in self.parameters()) * 0.0
        stats = torch.zeros(len(STATS), device=h.device)
        n = h.shape[0]
        recompute = torch.is_grad_enabled() and n > self.chunk
        for s in range(0, n, self.chunk):
            part = (h[s: s + self.chunk], labels[s: s + self.chunk],
                    None if target_hidden is None else target_hidden[s: s + self.chunk])
            if recompute:  # keep one chunk's (chunk, V) tensors alive at a time
                part_loss, part_stats = checkpoint(self._chunk, *part, use_reentrant=False)
            else:
                part_loss, part_stats = self._chunk(*part)
            loss = loss + part_loss
            stats = stats + part_stats
        return loss / denom[0], stats

    def _chunk(self, h, y, target_hidden):
        head = self.draft.get_output_embeddings()
        logits = (head(h) if self.rows is None else F.linear(h, head.weight[self.rows])).float()
        n = y.new_tensor(float(len(y)), dtype=torch.float32)
        if self.to_draft is not None:  # labels in draft ids; outside the vocabulary: no CE term
            y = self.to_draft(y)
        inside = y >= 0
        if self.stage == "pretrain":
            logq = log_probs(logits)
            ce = torch.where(inside, -logq.gather(-1, y.clamp(min=0)[:, None])[:, 0], 0.0)
            with torch.no_grad():
                stats = torch.stack([ce.sum().detach(), ce.sum().detach(), ce.new_zeros(()),
                                     (logq.argmax(-1) == y).sum().float(), n])
            return ce.sum(), stats
        with torch.no_grad():
            logp = log_probs(self.target_logits(target_hidden), self.temperature)
        logq = log_probs(logits, self.temperature)
        per = kd_loss(self.loss_name, logp, logq, self.variant, self.samples)
        with torch.no_grad():
            ce = torch.where(inside, -logq.gather(-1, y.clamp(min=0)[:, None])[:, 0], 0.0)
            stats = torch.stack([per.sum().detach(), ce.sum(), total_variation(logp, logq).sum(),
                                 (logp.argmax(-1) == logq.argmax(-1)).sum().float(), n])
        return per.sum(), stats


@torch.no_grad()
def target_hidden(target, cache, mb: PositionBatch, totals: torch.Tensor) -> torch.Tensor:
    """(B, T, d) the target's last hidden states: from the cache when every row is there,
    else one target pass (written to the cache). Adds the target's seconds and tokens to
    ``totals``."""
    device = target.device
    if cache is not None:
        rows = [cache.get(k, device) for k in mb.keys]
        if all(r is not None for r in rows):
            out = torch.zeros(len(rows), mb.input_ids.shape[1], target.hidden_size, dtype=rows[0].dtype,
                              device=device)
            for b, r in enumerate(rows):
                out[b, : r.shape[0]] = r
            return out
    start = time.perf_counter()
    hidden = target.base(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                         use_cache=False).last_hidden_state
    if device.type == "cuda":
        torch.cuda.synchronize()
    totals[0] += time.perf_counter() - start
    totals[1] += float(sum(mb.lengths))
    if cache is not None:
        for b, (key, n) in enumerate(zip(mb.keys, mb.lengths)):
            cache.put(key, hidden[b, :n])
    return hidden
