"""Medusa-style heads, the ReDrafter paper's baseline: K independent heads on h.

With h = the target's last-layer hidden state at the last accepted token (the state
whose logits chose g0, which sits one position after it), head k (k = 1..K) predicts the
token k positions after g0:

    u_k      = h;   u_k = u_k + SiLU(A_{k,l}·u_k + c_{k,l})   l = 1..N  (width d; N = 1)
    logits_k = O_k·u_k         "own":    O_k is d → V
             = LM(u_k)         "shared": the target's frozen LM head (``Target.logits``)

Unlike ReDrafter, no head sees the drafted tokens: a candidate's score is the separable
sum Σ_k log q_k(y_k). Candidates are the W best sequences of the cartesian product of the
heads' distributions (``beam_search.independent_beam_search``), a top-k tree.

In teacher-forced terms: at position t (hidden h_t, next token x_{t+1} = g0), head k
predicts x_{t+1+k}; head index i = k - 1 predicts x_{t+2+i}, the same label layout as
ReDrafter's ``teacher_forced_logits`` (``model.future_labels``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import target_signature
from ..vocab import DraftVocab
from .config import MedusaConfig
from .model import ResidualBlock
from .io import SavedHead
from .parts import TargetParts


class MedusaHead(nn.Module):
    """One head: N residual blocks at width d, then its own d → V layer (head "own")."""

    def __init__(self, hidden_size: int, vocab_size: int, num_blocks: int, own: bool):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_blocks))
        if own:
            self.out = nn.Linear(hidden_size, vocab_size, bias=False)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


class MedusaHeads(SavedHead, nn.Module):
    """K heads. state_dict names: heads.{k}.blocks.{l}.linear.{weight,bias} (d, d)/(d,),
    and heads.{k}.out.weight (V, d) for head "own" (k = 0..K-1 predicts g0's (k+1)-th
    successor). With a draft vocabulary of N tokens (``specdraft.vocab``): out.weight (N, d),
    the shared variant uses those N rows of the target's head, and the buffers
    draft_vocab.d2t (N,) / draft_vocab.t2d (V,) are saved too."""

    CONFIG = MedusaConfig  # what ``load`` parses config.json as

    def __init__(self, config: MedusaConfig, parts: TargetParts):
        super().__init__()
        self.config = config
        self.parts = parts  # not registered: never saved or trained
        own = config.head == "own"
        self.heads = nn.ModuleList(MedusaHead(config.hidden_size, config.output_size, config.num_blocks, own)
                                   for _ in range(config.num_heads))
        self.draft_vocab = DraftVocab(config.draft_vocab, config.vocab_size) if config.draft_vocab else None

    @classmethod
    def for_target(cls, target, num_heads: int = 4, num_blocks: int = 1, head: str = "own",
                   beam_width: int = 4, beam_length: int | None = None,
                   draft_vocab: DraftVocab | None = None) -> "MedusaHeads":
        """Freshly initialised heads for ``target``, float32, on its device. The residual
        blocks start at zero and "own" output layers as copies of the target's LM head
        (Medusa's initialisation: every head starts out predicting what the target would
        predict next)."""
        config = MedusaConfig(hidden_size=int(target.hidden_size), vocab_size=int(target.vocab_size),
                              num_heads=num_heads, num_blocks=num_blocks, head=head, beam_width=beam_width,
                              beam_length=beam_length, target=target_signature(target),
                              draft_vocab=draft_vocab.size if draft_vocab is not None else 0)
        heads = cls(config, TargetParts.of(target)).to(target.device)
        if draft_vocab is not None:
            heads.draft_vocab.set_ids(draft_vocab.ids())
        rows = heads.draft_vocab.ids() if draft_vocab is not None else slice(None)
        with torch.no_grad():
            for h in heads.heads:
                for block in h.blocks:
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
                if head == "own" and getattr(target.head, "bias", None) is None:
                    h.out.weight.copy_(target.head.weight[rows].float())
        return heads

    @property
    def dtype(self) -> torch.dtype:
        first = next(self.parameters(), None)  # "shared" heads with no blocks have no parameters
        return first.dtype if first is not None else torch.float32

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden (..., d) -> (..., K', V) float32 logits of the first K' heads
        (K' = num_heads or all K); -inf outside the draft vocabulary if there is one."""
        hidden = hidden.to(self.dtype)
        out = torch.stack([self.head_logits(k, hidden) for k in range(num_heads or len(self.heads))], dim=-2)
        return self.draft_vocab.scatter(out) if self.draft_vocab is not None else out

    def head_logits(self, k: int, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Head k alone: hidden (..., d) -> (..., N) float32 over the output vocabulary (the
        draft vocabulary, or all V) (training scores each head only at the rows that have
        its label). ``float32=False``: as ``ReDrafterHead.draft_logits``."""
        head = self.heads[k]
        u = head.features(hidden.to(self.dtype))
        if self.config.head == "own":
            return head.out(u).float() if float32 else head.out(u)
        if self.draft_vocab is not None:
            return self.parts.rows_logits(u, self.draft_vocab.ids(), float32)
        return self.parts.logits(u)

    def teacher_forced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, d) -> (B, T, K, V): out[b, t, i] predicts x_{t+2+i}
        (targets: ``model.future_labels(tokens, K)``)."""
        return self.logits(hidden)
