"""A datastore of the target's own answers, searched by the latest n-gram (REST-style retrieval).

Prompt lookup searches the request's own text; a datastore holds what the target wrote for
*other* prompts: its stock phrases, list and code layouts, the way its answers begin and end.
A query is the last n tokens of a row (n from ``max_ngram`` down to ``min_ngram``, the longest
n with a match wins); the answer is every place that n-gram occurs and the tokens that
followed it there.

Layout. ``tokens`` (N,) int32: the answers' token ids, each answer followed by -1 (a
separator no n-gram or continuation crosses). For each n the index holds the key of every
n-gram that lies inside one answer, sorted, and where its continuation starts. A key packs
the n token ids exactly into one int64 (``bits`` bits each; ``n * bits <= 63``), so there are
no hash collisions and a query is two binary searches.

Worked example (``bits`` = 16, n = 2): tokens [5, 7, 9, -1, 5, 7, 2, -1]. The 2-grams inside
an answer are (5, 7) at 0 and 4, (7, 9) at 1, (7, 2) at 5; (9, -1) and (-1, 5) cross a
separator and are not indexed. The query (5, 7) finds starts [0, 4], so its continuations
begin at 2 and 6: [9, -1, ...] and [2, -1, ...] (a continuation ends at its answer's end).

Files (a folder): ``datastore.safetensors`` (``tokens``) and ``config.json`` (the target it
was written by, vocabulary size, n-gram range, the sources). The index is rebuilt on load
(about a second per million tokens on one core): only the tokens are stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecdraftError

SEPARATOR = -1
FILE, CONFIG = "datastore.safetensors", "config.json"
DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM = 3, 1  # measured: longer n-grams drafted no better (docs/retrieval.md)
MAX_MATCHES = 4096  # continuations read per query at most: a common 1-gram matches ~10^5 places


def key_bits(vocab_size: int) -> int:
    """Bits per token id in a packed key."""
    return max(1, (vocab_size - 1).bit_length())


@dataclass
class Datastore:
    """tokens (N,) with SEPARATOR after each answer (int64 in memory, int32 on disk);
    ``index[n]`` = (keys (M_n,) int64 sorted, starts (M_n,) int32: where the continuation of
    each n-gram begins)."""

    tokens: torch.Tensor
    vocab_size: int
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    config: dict | None = None

    def __post_init__(self):
        self.bits = key_bits(self.vocab_size)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecdraftError(f"the n-gram range must satisfy 1 <= min <= max, got {self.min_ngram}..{self.max_ngram}")
        if self.max_ngram * self.bits > 63:
            raise SpecdraftError(f"n-grams of {self.max_ngram} tokens of a {self.vocab_size}-token vocabulary do not "
                                 f"fit a 63-bit key: at most {63 // self.bits}")
        self.tokens = self.tokens.to(torch.int64)
        self.index = {n: self._index(n) for n in range(self.min_ngram, self.max_ngram + 1)}

    # ---- building ------------------------------------------------------------------------

    @classmethod
    def from_answers(cls, answers, vocab_size: int, **kw) -> "Datastore":
        """From token-id lists (one per answer); ids outside the vocabulary are an error."""
        flat: list[int] = []
        for ids in answers:
            if any(not 0 <= i < vocab_size for i in ids):  # a -1 would pass for a separator
                raise SpecdraftError(f"a token id is outside the target's vocabulary of {vocab_size}")
            flat.extend(ids)
            flat.append(SEPARATOR)
        return cls(torch.tensor(flat, dtype=torch.int64), vocab_size, **kw)

    def _index(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys sorted, starts of their continuations) of every n-gram inside one answer."""
        T = self.tokens.numel()
        if T < n:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
        windows = self.tokens.unfold(0, n, 1)  # (T - n + 1, n): windows[j] = tokens[j: j + n]
        inside = (windows != SEPARATOR).all(1)
        keys = self._pack(windows[inside])
        starts = (torch.nonzero(inside)[:, 0] + n).to(torch.int32)  # int32: a third less memory
        order = torch.argsort(keys, stable=True)  # stable: equal keys stay in text order
        return keys[order], starts[order]

    def _pack(self, grams: torch.Tensor) -> torch.Tensor:
        """(M, n) token ids -> (M,) int64 keys, exact (n * bits <= 63)."""
        shifts = torch.arange(grams.shape[1], dtype=torch.int64) * self.bits
        return (grams << shifts).sum(1)

    # ---- queries ---------------------------------------------------------------------------

    def continuations(self, history: torch.Tensor, depth: int) -> tuple[int, torch.Tensor]:
        """(n, conts): the longest n-gram ending ``history`` (T,) that the datastore holds,
        and the ``depth`` tokens after up to MAX_MATCHES of its occurrences, (M, depth) long,
        SEPARATOR from an answer's end on. (0, empty) when no n-gram matches."""
        history = history.to(torch.int64)
        for n in range(min(self.max_ngram, history.numel()), self.min_ngram - 1, -1):
            keys, starts = self.index[n]
            key = self._pack(history[-n:][None])  # (1,)
            lo = int(torch.searchsorted(keys, key, right=False))
            hi = int(torch.searchsorted(keys, key, right=True))
            if hi == lo:
                continue
            first = starts[lo: min(hi, lo + MAX_MATCHES)].to(torch.int64)
            at = first[:, None] + torch.arange(depth)  # (M, depth)
            conts = self.tokens[at.clamp(max=self.tokens.numel() - 1)]
            ended = (conts == SEPARATOR).cumsum(1) > 0  # from the answer's end on
            return n, conts.masked_fill(ended, SEPARATOR)
        return 0, torch.empty(0, depth, dtype=torch.int64)

    # ---- files -------------------------------------------------------------------------------

    def save(self, folder: str | Path, config: dict | None = None) -> Path:
        """``folder``/datastore.safetensors and config.json (``config`` merged in)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": self.tokens.to(torch.int32).contiguous()}, str(folder / FILE))
        record = {"kind": "retrieval", "vocab_size": self.vocab_size, "max_ngram": self.max_ngram,
                  "min_ngram": self.min_ngram, "tokens": int((self.tokens != SEPARATOR).sum()),
                  "answers": int((self.tokens == SEPARATOR).sum()), **(config or {})}
        (folder / CONFIG).write_text(json.dumps(record, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "Datastore":
        """The datastore in ``folder`` (a one-line error if there is none)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / FILE).is_file() or not (folder / CONFIG).is_file():
            raise SpecdraftError(f"no datastore in {folder} (expected {FILE} and {CONFIG}; "
                                 "make one with `specdraft datastore`)")
        config = json.loads((folder / CONFIG).read_text())
        tokens = load_file(str(folder / FILE))["tokens"]
        return cls(tokens, int(config["vocab_size"]), int(config["max_ngram"]), int(config["min_ngram"]), config)


# ---- sources ---------------------------------------------------------------------------


def answers_in_file(path: str | Path, tokenizer, target_name: str):
    """Token ids of the answers in a ``specdraft distill`` responses file: each record's
    ``response_ids`` (what the target generated), else its ``response`` text tokenized. A
    record written by another target is an error: its ids would mean other tokens."""
    from .data.jsonl import iter_records

    for record in iter_records(path):
        if record.get("kind") != "response":
            continue
        if record.get("target") not in (None, target_name):
            raise SpecdraftError(f"{path}: answers of {record['target']!r}, not of the target {target_name!r}")
        ids = record.get("response_ids")
        yield ids if ids is not None else tokenizer(record["response"], add_special_tokens=False)["input_ids"]


def answers_in_sharegpt(tokenizer, limit: int | None = None):
    """Token ids of every assistant turn of ShareGPT's training split (the first ``limit``
    conversations): text the target did not write, for a datastore without generating."""
    from .data.sharegpt import iter_conversations

    for i, conversation in enumerate(iter_conversations(split="train")):
        if limit is not None and i >= limit:
            return
        for message in conversation.messages:
            if message["role"] == "assistant":
                yield tokenizer(message["content"], add_special_tokens=False)["input_ids"]
