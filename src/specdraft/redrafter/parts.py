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
from typing import Callable

import torch


@dataclass(frozen=True)
class TargetParts:
    """embed:  (...,) long -> (..., d) float, the target's input embeddings.
    logits: (..., d) -> (..., V) float32, the target's LM head exactly as the target
            applies it to its final hidden states (final-logit softcap included).
    vocab_size, hidden_size: of the target (V, d)."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    hidden_size: int

    @classmethod
    def of(cls, target) -> "TargetParts":
        """The parts of a ``specdraft.models.Target``."""
        embeddings = target.model.get_input_embeddings()

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            # The head may run in another dtype than the target (e.g. fp32 head, bf16 target).
            return target.logits(hidden.to(target.dtype))

        return cls(embed=embeddings, logits=logits, vocab_size=int(target.vocab_size),
                   hidden_size=int(target.hidden_size))
