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
from ..models import softcapped


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
    module_rows: ids (N,) long -> a ``rows_logits`` over an ``nn.Linear`` holding a copy of those
            N rows, for a drafter traced by torch.compile: freezing folds a module's weights
            into the graph, and ``rows_logits``' own cache would break it (data pointers).
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    hidden_size: int
    rows_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    int8_rows: Callable[[torch.Tensor], Callable] | None = None
    module_rows: Callable[[torch.Tensor], Callable] | None = None

    @classmethod
    def of(cls, target) -> "TargetParts":
        """The parts of a ``specdraft.models.Target``."""
        embeddings = target.model.get_input_embeddings()

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            # The head may run in another dtype than the target (e.g. fp32 head, bf16 target).
            return target.logits(hidden.to(target.dtype))

        rows = SimpleNamespace(key=None)  # the gathered head rows, kept while the ids tensor is the same

        def rows_logits(hidden: torch.Tensor, ids: torch.Tensor, float32: bool = True) -> torch.Tensor:
            head = target.head
            bias = getattr(head, "bias", None)
            key = (ids.data_ptr(), ids.shape[0], ids.device)
            if rows.key != key:
                rows.key, rows.weight, rows.bias = key, head.weight[ids], None if bias is None else bias[ids]
            # Through the target's fast layout when drafting (fastpath.active); ``rows`` keeps its packed copy.
            out = fastpath.linear(hidden.to(target.dtype), rows.weight, rows.bias, holder=rows)
            return softcapped(out, target.softcap, float32)

        def int8_rows(ids: torch.Tensor) -> Callable:
            head = target.head
            bias = head.bias[ids] if getattr(head, "bias", None) is not None else None
            packed = int8.pack(head.weight[ids], bias)

            def rows_logits_int8(hidden: torch.Tensor, asked: torch.Tensor, float32: bool = True) -> torch.Tensor:
                assert asked.shape[0] == ids.shape[0], "int8 rows were packed for another draft vocabulary"
                return softcapped(int8.linear(hidden, packed), target.softcap)  # float32

            return rows_logits_int8

        def module_rows(ids: torch.Tensor) -> Callable:
            head = target.head
            bias = getattr(head, "bias", None)
            rows_module = torch.nn.Linear(head.weight.shape[1], ids.shape[0], bias=bias is not None,
                                          device=head.weight.device, dtype=head.weight.dtype).requires_grad_(False)
            with torch.no_grad():
                rows_module.weight.copy_(head.weight[ids])
                if bias is not None:
                    rows_module.bias.copy_(bias[ids])
            fastpath.small_batch_linear(rows_module)  # eager calls (sampled chains) keep the fast layout

            def rows_logits_module(hidden: torch.Tensor, asked: torch.Tensor, float32: bool = True) -> torch.Tensor:
                assert asked.shape[0] == ids.shape[0], "the rows were copied for another draft vocabulary"
                return softcapped(rows_module(hidden.to(rows_module.weight.dtype)), target.softcap, float32)

            return rows_logits_module

        return cls(embed=embeddings, logits=logits, vocab_size=int(target.vocab_size),
                   hidden_size=int(target.hidden_size), rows_logits=rows_logits, int8_rows=int8_rows,
                   module_rows=module_rows)
