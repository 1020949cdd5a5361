"""The target's frozen pieces a drafter head uses but never stores.

ReDrafter embeds its drafted tokens with the target's own input embeddings, and the
"shared" head variants end in the target's own LM head. Neither is a parameter of the
head (they are frozen, and not written to the head's checkpoint), so a head holds them
in a ``TargetParts`` object, which ``nn.Module`` does not register: they stay out of
``state_dict()``, ``parameters()`` and optimisers, while gradients still flow *through*
them to the head's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from .. import fastpath, int8


@dataclass(frozen=True)
class TargetParts:
    """embed:  (...,) long -> (..., d) float, the target's input embeddings.
    logits: (..., d) -> (..., V) float32, the target's LM head exactly as the target
            applies it to its final hidden states (final-logit softcap included).
    vocab_size, hidden_size: of the target (V, d).
    rows_logits: (hidden (..., d), ids (N,) long, float32=True) -> (..., N), the same head's
            logits of the tokens ``ids`` only (a draft vocabulary: N rows of the head,
            not V); float32, or with ``float32=False`` in the product's own dtype (training
            casts chunk by chunk, ``train.cross_entropy.cross_entropy_sum``).
    int8_rows: ids (N,) long -> a ``rows_logits`` over an int8 copy of those N rows
            (``specdraft.int8``; float32 out, softcap as the target applies it), for drafting.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    hidden_size: int
    rows_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    int8_rows: Callable[[torch.Tensor], Callable] | None = None

    @classmethod
    def of(cls, target) -> "TargetParts":
        """The parts of a ``specdraft.models.Target``."""
        embeddings = target.model.get_input_embeddings()

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            # The head may run in another dtype than the target (e.g. fp32 head, bf16 target).
            return target.logits(hidden.to(target.dtype))

        rows = SimpleNamespace(key=None)  # the gathered head rows, kept while the ids tensor is the same

        def rows_logits(hidden: torch.Tensor, ids: torch.Tensor, float32: bool = True) -> torch.Tensor:
            key = (ids.data_ptr(), ids.shape[0], ids.device)
            if rows.key != key:
                head = target.head
                bias = head.bias[ids] if getattr(head, "bias", None) is not None else None
                rows.key, rows.weight, rows.bias = key, head.weight[ids], bias
            # Through the target's fast layout when drafting (fastpath.active); ``rows`` keeps its packed copy.
            out = fastpath.linear(hidden.to(target.dtype), rows.weight, rows.bias, holder=rows)
            if target.softcap:  # the cap in float32, as the target applies it
                return torch.tanh(out.float() / target.softcap) * target.softcap
            return out.float() if float32 else out

        def int8_rows(ids: torch.Tensor) -> Callable:
            head = target.head
            bias = head.bias[ids] if getattr(head, "bias", None) is not None else None
            packed = int8.pack(head.weight[ids], bias)

            def rows_logits_int8(hidden: torch.Tensor, asked: torch.Tensor, float32: bool = True) -> torch.Tensor:
                assert asked.shape[0] == ids.shape[0], "int8 rows were packed for another draft vocabulary"
                out = int8.linear(hidden, packed)  # float32
                return torch.tanh(out / target.softcap) * target.softcap if target.softcap else out

            return rows_logits_int8

        return cls(embed=embeddings, logits=logits, vocab_size=int(target.vocab_size),
                   hidden_size=int(target.hidden_size), rows_logits=rows_logits, int8_rows=int8_rows)
