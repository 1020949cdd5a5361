"""The ReDrafter head: a recurrent draft head on the target's last hidden state.

Notation (d = target hidden size, V = vocabulary, E = the target's frozen input
embeddings, N = config.num_blocks):

    h    = the target's last-layer hidden state (after its final norm) at the last
           accepted token: the state whose logits chose g0
    s_0  = 0;   x_1 = g0
    s_t  = SiLU(W·E[x_t] + U·s_{t-1} + b)            W: d×d (no bias), U: d×d with bias b
    z    = [h ; s_t]                                  width 2d, h first
    z    = z + SiLU(A_l·z + c_l)     l = 1..N         residual blocks at width 2d
    logits_t = O·z        "own" head:    O is 2d → V (the paper's untied output layer)
             = LM(P·z)    "shared" head: P is 2d → d, then the target's frozen LM head
                          (``Target.logits``: the same head and softcap the target uses)

With a draft vocabulary of N tokens (``config.draft_vocab``; ``specdraft.vocab``) the
output covers those N only: O is 2d → N, or the shared head uses the N rows of the
target's LM head. ``draft_logits`` gives those (training); ``logits`` scatters them into
the full vocabulary with -inf elsewhere (inference: beam search and acceptance see an
ordinary distribution over V that is zero outside the draft vocabulary).

logits_t is the drafter's distribution of x_{t+1}: with x_1 = g0 = the token after the
last accepted one, logits_1 predicts the token after g0.

Beyond the paper, two options change what the head starts from and one what its recurrence
reads (each starts as the paper's head, and each is computed once per step):
- ``config.feature_layers`` = [a, b, ...]: h is replaced by F·[rms(s^a) ; rms(s^b) ; ... ; h]
  with s^l the target's residual stream after layer l at the same token and rms an RMS
  normalisation without weights (EAGLE-3's fusion of low, middle and high layers; F starts
  as [0 ... 0 I]): ``fuse_features``.
- ``config.context`` = C > 0: then h is replaced by a_t, context attention over the last C
  target states paired with their next tokens (``heads.context``; a fresh one starts as the
  identity, a_t = h_t): ``contextualize``.
- ``config.hidden_in_recurrence``: s_t = SiLU(W·E[x_t] + U·s_{t-1} + V·h + b), so the state
  that carries depths 2, 3, ... sees the context summary too, not only the output layer
  (V: d×d, starts at 0): ``recurrence_bias``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..checkpoint import target_signature
from ..vocab import DraftVocab
from .config import ReDrafterConfig
from .context import ContextAttention, right_aligned
from .io import SavedHead
from .parts import TargetParts


class ResidualBlock(nn.Module):
    """z + SiLU(A·z + c) at a fixed width."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + F.silu(self.linear(z))


class ReDrafterHead(SavedHead, nn.Module):
    """The recurrent draft head. Parameters (state_dict names):

    rnn_w.weight (d, d); rnn_u.weight (d, d), rnn_u.bias (d,);
    blocks.{l}.linear.weight (2d, 2d), .bias (2d,) for l < N;
    out.weight (V, 2d) for head "own", or proj.weight (d, 2d) for head "shared";
    with a draft vocabulary of N tokens: out.weight (N, 2d), and the buffers
    draft_vocab.d2t (N,) and draft_vocab.t2d (V,); with context C: context.* (see
    ``ContextAttention``); with feature layers a, b, ...: fuse.weight (d, (n+1)·d); with
    hidden_in_recurrence: rnn_h.weight (d, d).

    The target's embeddings and LM head are used through ``parts`` and never stored.
    """

    CONFIG = ReDrafterConfig  # what ``load`` parses config.json as

    def __init__(self, config: ReDrafterConfig, parts: TargetParts):
        super().__init__()
        d, V = config.hidden_size, config.vocab_size
        self.config = config
        self.parts = parts  # not an nn.Module: not registered, not saved, not trained
        self.rnn_w = nn.Linear(d, d, bias=False)
        self.rnn_u = nn.Linear(d, d, bias=True)
        self.blocks = nn.ModuleList(ResidualBlock(2 * d) for _ in range(config.num_blocks))
        if config.head == "own":
            self.out = nn.Linear(2 * d, config.output_size, bias=False)
        else:
            self.proj = nn.Linear(2 * d, d, bias=False)
        self.draft_vocab = DraftVocab(config.draft_vocab, V) if config.draft_vocab else None
        self.context = ContextAttention(d, config.context, config.context_heads) if config.context else None
        self.rnn_h = None
        if config.hidden_in_recurrence:
            self.rnn_h = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.rnn_h.weight)  # a fresh one is the paper's recurrence
        self.fuse = None
        if config.feature_layers:
            n = len(config.feature_layers)
            self.fuse = nn.Linear((n + 1) * d, d, bias=False)
            with torch.no_grad():  # [0 ... 0 I]: a fresh fusion passes h through
                self.fuse.weight.zero_()
                self.fuse.weight[:, n * d:] = torch.eye(d)

    @classmethod
    def for_target(cls, target, num_blocks: int = 2, head: str = "own", beam_width: int = 4,
                   beam_length: int = 5, draft_vocab: DraftVocab | None = None,
                   context: int = 0, feature_layers: list[int] | None = None,
                   hidden_in_recurrence: bool = False) -> "ReDrafterHead":
        """A freshly initialised head for ``target`` (a ``specdraft.models.Target``),
        on the target's device, in float32; its output covers ``draft_vocab`` if given;
        ``context`` > 0 adds context attention over that many states (heads of width 64
        where the hidden size allows, else one)."""
        d = int(target.hidden_size)
        config = ReDrafterConfig(hidden_size=d, vocab_size=int(target.vocab_size),
                                 num_blocks=num_blocks, head=head, beam_width=beam_width,
                                 beam_length=beam_length, target=target_signature(target),
                                 draft_vocab=draft_vocab.size if draft_vocab is not None else 0,
                                 context=context, context_heads=d // 64 if d % 64 == 0 else 1,
                                 feature_layers=list(feature_layers or []),
                                 hidden_in_recurrence=hidden_in_recurrence)
        made = cls(config, TargetParts.of(target))
        if draft_vocab is not None:
            made.draft_vocab.set_ids(draft_vocab.ids())
        return made.to(target.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.rnn_w.weight.dtype

    # ---- the recurrence ---------------------------------------------------------------

    def initial_state(self, batch_shape: tuple[int, ...], device=None) -> torch.Tensor:
        """s_0 = 0, shape (*batch_shape, d)."""
        return torch.zeros(*batch_shape, self.config.hidden_size, dtype=self.dtype,
                           device=device if device is not None else self.rnn_w.weight.device)

    def embed_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """W·E[x] for tokens (...,) long -> (..., d). Computed once per token in training."""
        return self.rnn_w(self.parts.embed(tokens).to(self.dtype))

    def recurrence_bias(self, hidden: torch.Tensor) -> torch.Tensor | float:
        """V·h (..., d) for h (..., d), the same at every step of one draft; 0 for the
        paper's recurrence (which never reads h)."""
        return self.rnn_h(hidden.to(self.dtype)) if self.rnn_h is not None else 0.0

    def step(self, state: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor | float = 0.0) -> torch.Tensor:
        """s_t = SiLU(W·E[x_t] + U·s_{t-1} + b (+ V·h: ``bias``, ``recurrence_bias``)):
        state (..., d), tokens (...,), bias broadcastable to (..., d) -> (..., d)."""
        embedded = self.embed_input(tokens)
        # The paper's head (bias 0.0) skips the add: one elementwise op less per draft depth.
        return self.step_embedded(state, embedded if isinstance(bias, float) and bias == 0.0 else embedded + bias)

    def step_embedded(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The recurrence with W·E[x_t] already computed: (..., d), (..., d) -> (..., d)."""
        return F.silu(embedded + self.rnn_u(state))

    # ---- what the head starts from (beyond the paper) ----------------------------------

    def fuse_features(self, hidden: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """F·[rms(s^a) ; ... ; h]: hidden (..., d), features (..., n, d) the target's states
        after ``config.feature_layers`` at the same tokens -> (..., d). Identity without them."""
        if self.fuse is None:
            return hidden
        dtype = self.fuse.weight.dtype
        normed = F.rms_norm(features.to(dtype), (features.shape[-1],))  # residual streams grow with depth
        return self.fuse(torch.cat([normed.flatten(-2), hidden.to(dtype)], dim=-1))


    def contextualize(self, hidden: torch.Tensor, support: torch.Tensor, support_next: torch.Tensor,
                      query: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor | None = None) -> torch.Tensor:
        """a_t (N, d) for h_t (N, d): support (G, S, d) target states and support_next (G, S)
        the token after each; query (G, Q), valid (G, Q, S) the queries' slots and windows
        (``ContextAttention.forward``); slot (N,) where row n sits among the G·Q queries
        (None: row n at n, N = G·Q)."""
        G, Q = query.shape
        grouped = hidden if slot is None else hidden.new_zeros(G * Q, hidden.shape[-1]).index_copy(0, slot, hidden)
        pairs = self.context.pairs(support, self.parts.embed(support_next))
        out = self.context(pairs, query, valid, grouped.view(G, Q, -1)).reshape(G * Q, -1)
        return out if slot is None else out[slot]

    def contextualize_recent(self, hidden: torch.Tensor, states: torch.Tensor, next_tokens: torch.Tensor,
                             lengths: torch.Tensor) -> torch.Tensor:
        """a_t (B, d) at inference: states (B, C', d) right-aligned (the last ``lengths[b]``
        slots hold row b's latest states, hidden[b] last), next_tokens (B, C') the token after
        each (g0 last). Only the last ``config.context`` slots are read."""
        C = min(self.config.context, states.shape[1])
        query, valid = right_aligned(lengths.clamp(max=C), C)
        return self.contextualize(hidden, states[:, -C:], next_tokens[:, -C:], query, valid)

    # ---- the output -------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Draft logits (..., V) float32 from h (..., d) and s_t (..., d); -inf outside
        the draft vocabulary if the head has one.

        h is broadcast against s_t, so h (B, 1, d) with s_t (B, W, d) scores W beams.
        """
        logits = self.draft_logits(hidden, state)
        return self.draft_vocab.scatter(logits) if self.draft_vocab is not None else logits

    def draft_logits(self, hidden: torch.Tensor, state: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """(..., N) float32 logits over the output layer's own vocabulary (the draft
        vocabulary, or all V tokens): what training scores. ``float32=False`` leaves them
        in the product's dtype (bfloat16 under autocast) where the head's output layer is
        its own or draft-vocabulary rows; training casts them chunk by chunk."""
        hidden = hidden.to(self.dtype).expand(*state.shape[:-1], -1)
        z = torch.cat([hidden, state], dim=-1)
        for block in self.blocks:
            z = block(z)
        if self.config.head == "own":
            return self.out(z).float() if float32 else self.out(z)
        if self.draft_vocab is not None:
            return self.parts.rows_logits(self.proj(z), self.draft_vocab.ids(), float32)
        return self.parts.logits(self.proj(z))

    # ---- training ---------------------------------------------------------------------

    def teacher_forced_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, K: int) -> torch.Tensor:
        """Logits for K future tokens at every position, in one pass (loops over K only).

        hidden: (B, T, d) the target's last-layer hidden states (after its final norm),
                hidden[:, t] being the state at token t (whose logits predict x_{t+1}).
        tokens: (B, T) long, the sequence x_0 .. x_{T-1}.
        Returns (B, T, K, V) float32: out[b, t, i] is the drafter's prediction of
        x_{t+2+i}, from [h_t ; s^(i)_t] where the recurrence was fed the actual tokens
        x_{t+1}, ..., x_{t+1+i} (s^(i)_t = the state after i+1 steps from s_0 = 0).
        This is exactly the inference recurrence with g0 = x_{t+1}; see ``future_labels``
        for the matching targets. Where t+2+i >= T there is no target token and the
        inputs past the sequence end are token 0: those entries are meaningless.
        """
        B, T = tokens.shape
        embedded = self.embed_input(tokens)  # (B, T, d): W·E[x_u] for every u
        bias = self.recurrence_bias(hidden)  # V·h_t: position t's own, not shifted
        state = self.initial_state((B, T), device=tokens.device)
        out = []
        for i in range(K):
            # Iteration i at position t consumes x_{t+1+i}: the embedded inputs shifted left.
            shift = 1 + i
            step_in = F.pad(embedded[:, shift:], (0, 0, 0, min(shift, T)))
            state = self.step_embedded(state, step_in + bias)
            out.append(self.logits(hidden, state))
        return torch.stack(out, dim=2)


def future_labels(tokens: torch.Tensor, K: int, ignore_index: int = -100) -> torch.Tensor:
    """Targets for ``teacher_forced_logits``: labels[b, t, i] = tokens[b, t+2+i], or
    ``ignore_index`` where t+2+i >= T. tokens (B, T) -> (B, T, K) long."""
    B, T = tokens.shape
    labels = torch.full((B, T, K), ignore_index, dtype=torch.long, device=tokens.device)
    for i in range(K):
        shift = 2 + i
        if shift < T:
            labels[:, : T - shift, i] = tokens[:, shift:]
    return labels
