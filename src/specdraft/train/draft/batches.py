"""Batches of trained positions: right-padded sequences, the (row, col) positions whose
next token is trained and those next tokens (the labels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data.chat import IGNORE
from ..examples import Example


@dataclass
class PositionBatch:
    """input_ids, attention_mask (B, T) right-padded with 0; rows, cols (N,) the positions
    whose next token is trained; labels (N,) those next tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keys: list[str]
    lengths: list[int]
    rows: torch.Tensor
    cols: torch.Tensor
    labels: torch.Tensor


def collate_positions(examples: list[Example]) -> PositionBatch:
    """One batch of ``examples`` (B of them, T the longest); the trained positions in
    row-major order, as the loss and the evaluation's scatter back to (b, t) expect."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    rows, cols, labels = [], [], []
    for b, e in enumerate(examples):
        x = torch.tensor(e.input_ids, dtype=torch.long)
        ids[b, : len(x)] = x
        mask[b, : len(x)] = 1
        nxt = torch.tensor(e.labels[1:], dtype=torch.long)
        pos = (nxt != IGNORE).nonzero()[:, 0]
        rows.append(torch.full_like(pos, b))
        cols.append(pos)
        labels.append(nxt[pos])
    return PositionBatch(ids, mask, [e.key for e in examples], [len(e.input_ids) for e in examples],
                         torch.cat(rows), torch.cat(cols), torch.cat(labels))
