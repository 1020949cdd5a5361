"""Draft vocabularies: a drafter that predicts only the N most frequent target tokens.

On a small target the drafter's output layer dominates its cost (SmolLM2: 49152 × 2d for
a ReDrafter head). The N tokens the target itself writes most often cover most of what
it writes (SmolLM2 on ShareGPT answers: 8192 tokens ≈ 91%), so a drafter whose output
layer covers only them is several times cheaper to train and to run, and loses only the
drafts that would have needed another token (FR-Spec, EAGLE-3's ``draft_vocab_size``).

Representation (the convention of EAGLE-3 and vLLM's speculators, so export is direct):

    d2t (N,) int64   target_id = draft_id + d2t[draft_id]     (draft ids in target-id order)
    t2d (V,) bool    t2d[v] = v is in the draft vocabulary

Exactness: a drafter with a draft vocabulary is still a distribution over the whole target
vocabulary, zero outside it (``scatter`` puts -inf logits there). Greedy acceptance
compares tokens; recursive rejection and speculative sampling take q over the full
vocabulary, so nothing downstream changes.

Worked example: V = 6, counts = [5, 0, 9, 1, 7, 0], N = 3 -> kept target ids [0, 2, 4],
d2t = [0, 1, 2], t2d = [T, F, T, F, T, F]; draft logits [a, b, c] scatter to
[a, -inf, b, -inf, c, -inf]; ``to_draft([4, 1])`` = [2, -1].
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import SpecdraftError


class DraftVocab(nn.Module):
    """The buffers ``d2t`` (N,) and ``t2d`` (V,) (saved in a drafter's state dict as
    ``<name>.d2t`` / ``<name>.t2d``), and the maps between the two id spaces."""

    def __init__(self, size: int, vocab_size: int):
        super().__init__()
        if not 1 <= size <= vocab_size:
            raise SpecdraftError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> "DraftVocab":
        """The ``size`` most frequent ids of ``counts`` (V,) (ties: the lower id)."""
        vocab = cls(size, counts.shape[0])
        # A stable sort of -counts keeps equal counts in id order.
        keep = torch.sort(torch.argsort(-counts.to(torch.float64), stable=True)[:size]).values
        vocab.set_ids(keep)
        return vocab

    def set_ids(self, ids: torch.Tensor) -> None:
        """Set the kept target ids (N,) (strictly increasing)."""
        ids = ids.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape or (ids[1:] <= ids[:-1]).any():
            raise SpecdraftError("draft vocabulary ids must be N strictly increasing target ids")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    def ids(self) -> torch.Tensor:
        """(N,) long: the target id of each draft id. Cached (the same tensor until d2t
        changes: in place, e.g. load_state_dict, or by a move), so that users may key their
        own caches on it (``heads.parts``: the LM head rows of a shared head)."""
        if torch.compiler.is_compiling():  # traced: frozen, the sum folds into a constant
            return self.d2t + torch.arange(self.size, device=self.d2t.device)
        key = (self.d2t.data_ptr(), self.d2t._version, self.d2t.device)
        if getattr(self, "_ids_key", None) != key:
            self._ids = self.d2t + torch.arange(self.size, device=self.d2t.device)
            self._ids_key = key
        return self._ids

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape, long) -> draft ids, -1 where not in the vocabulary (and
        for negative inputs such as -100 padding labels)."""
        safe = target_ids.clamp(min=0)
        index = torch.cumsum(self.t2d.long(), 0) - 1  # draft id of each kept target id
        return torch.where((target_ids >= 0) & self.t2d[safe], index[safe], torch.full_like(safe, -1))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def scatter(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., N) draft logits -> (..., V) float32 target-vocabulary logits, -inf outside."""
        out = logits.new_full((*logits.shape[:-1], self.t2d.shape[0]), float("-inf"), dtype=torch.float32)
        out[..., self.ids()] = logits.float()
        return out

    def coverage(self, counts: torch.Tensor) -> float:
        """The share of ``counts`` (V,) that falls inside the vocabulary."""
        total = counts.sum().item()
        return counts[self.t2d.to(counts.device)].sum().item() / total if total else 0.0
