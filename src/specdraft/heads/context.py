"""Context attention: the ReDrafter head's optional look at the last few target states.

The paper's head sees one target state, h_t, and the token after it. Everything the
draft knows about how x_{t+1} relates to the earlier text must already be in h_t, which
was computed before x_{t+1} existed; a few MLP blocks cannot redo the target's attention.
EAGLE's answer is an attention layer over (state, next token) pairs. This module is that
idea, kept inside ReDrafter's shape (an option, ``config.context`` = C > 0; C = 0 is the
paper's head):

    u_i = RMSNorm(W_in · [h_i ; E[x_{i+1}]])        the pair of a target state and the
                                                    token that followed it, width d
    for the query position t (its window: the C positions t-C+1 .. t, fewer where the
    window starts later, see below):
    q = W_q·u_t,  k_i = W_k·u_i,  v_i = W_v·u_i     H heads of d/H
    α_i = softmax_i( q·k_i / sqrt(d/H) + b[head, t - i] )   b: a learned bias per head and
                                                            relative offset 0 .. C-1
    a_t = h_t + W_o · Σ_i α_i v_i                    W_o starts at zero: a fresh context
                                                    head equals the paper's head

and a_t replaces h_t in the head: z = [a_t ; s_j]. The query u_t holds E[x_{t+1}] = E[g0],
so the attention asks "what, in the recent text, goes with this token?"; deeper drafted
tokens still enter through the recurrence s_j. a_t is computed once per step per row.

Which states a window holds (the same in training and inference): target states of the
current answer only, from the second-to-last prompt token on (``fit``'s corpus stores
exactly those: the positions t whose slot t+2 is an answer token). At inference the
engine keeps the last C such states per row (``specdraft.recent``).

Worked example (C = 4): prompt [p0 p1 p2], answer so far [g0 g1] with g1 the newest
token. Window states h_{p1}, h_{p2}, h_{g0} paired with tokens p2, g0, g1; the query is
u_{g0} = pair(h_{g0}, g1) (the last slot); the first slot is empty (3 of 4 valid).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class ContextAttention(nn.Module):
    """Parameters: w_in.weight (d, 2d); norm.weight (d,); qkv.weight (3d, d);
    out.weight (d, d) (zero at init); bias (H, C)."""

    def __init__(self, hidden_size: int, window: int, heads: int):
        super().__init__()
        d = hidden_size
        if d % heads:
            raise ValueError(f"context heads {heads} must divide the hidden size {d}")
        self.window, self.heads = window, heads
        self.w_in = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.bias = nn.Parameter(torch.zeros(heads, window))
        nn.init.zeros_(self.out.weight)

    def pairs(self, hidden: torch.Tensor, next_embedded: torch.Tensor) -> torch.Tensor:
        """u = RMSNorm(W_in·[h ; E[x_next]]): (..., d), (..., d) -> (..., d)."""
        dtype = self.w_in.weight.dtype
        u = self.w_in(torch.cat([hidden.to(dtype), next_embedded.to(dtype)], dim=-1))
        return self.norm(u.to(self.norm.weight.dtype))  # the fused kernel wants matching dtypes

    def forward(self, support: torch.Tensor, query: torch.Tensor, valid: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """a_t for G groups of Q query positions that share one span of S states.

        support (G, S, d): u of the span's positions, in order (``pairs``).
        query (G, Q) long: each query's own slot in the span; slot s is query - s
            positions back, so its bias is b[:, query - s].
        valid (G, Q, S) bool: the slots in the query's window (at most C, never after the
            query, its own slot always).
        hidden (G, Q, d): h_t of the queries. Returns (G, Q, d) in the module's dtype.

        Training uses groups of consecutive positions (a span of Q + C - 1 states);
        inference one query per row over its last C states (``right_aligned``).
        """
        G, S, d = support.shape
        Q, H = query.shape[1], self.heads
        w_q, w_kv = self.qkv.weight[:d], self.qkv.weight[d:]
        k, v = F.linear(support, w_kv).view(G, S, 2 * H, d // H).transpose(1, 2).split(H, dim=1)  # (G, H, S, d/H)
        q = F.linear(support.gather(1, query[:, :, None].expand(-1, -1, d)), w_q).view(G, Q, H, d // H).transpose(1, 2)
        offset = (query[:, :, None] - torch.arange(S, device=query.device)).clamp(0, self.window - 1)
        bias = self.bias[:, offset].permute(1, 0, 2, 3)  # (G, H, Q, S)
        mask = torch.where(valid[:, None], bias.to(q.dtype), torch.tensor(float("-inf"), dtype=q.dtype,
                                                                          device=q.device))
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(d // H))
        return hidden.to(q.dtype) + self.out(mixed.transpose(1, 2).reshape(G, Q, d))


def right_aligned(lengths: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward``'s query (B, 1) and valid (B, 1, C) for a (B, C, d) buffer of each row's
    latest states, right-aligned: the last ``lengths[b]`` slots of row b, its query last."""
    slots = torch.arange(C, device=lengths.device)
    query = torch.full((lengths.shape[0], 1), C - 1, dtype=torch.long, device=lengths.device)
    return query, (slots[None, :] >= (C - lengths)[:, None])[:, None, :]
