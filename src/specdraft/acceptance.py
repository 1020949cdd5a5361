"""Exact acceptance rules (BRIEF section 4). All work on a packed tree.

Common shapes: B rows, W beams, L tokens per beam (beam[:, :, 0] is g0, the token the
target chose last, always accepted), N packed tree tokens, V vocabulary.
Each rule returns an ``Acceptance``: which packed tokens to keep (the path of one beam,
g0 included), how many, and the next token chosen by the target (the new g0).

- greedy: the longest beam prefix that equals the target's argmax chain.
- deterministic candidates (beam search, lookup, top-k trees) under sampling: recursive
  rejection down the tree with point-mass proposals; the output is distributed exactly as
  the target's p.
- sampled chains (a draft model sampled x ~ q): standard speculative sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample, uniform
from .tree import TreeBatch


@dataclass
class Acceptance:
    """path: (B, L) packed positions along the chosen beam; the first ``n`` are kept.
    n: (B,) tokens kept (>= 1: g0). next_token: (B,) the target's next token.
    beam: (B,) index of the beam followed."""

    path: torch.Tensor
    n: torch.Tensor
    next_token: torch.Tensor
    beam: torch.Tensor

    @property
    def last(self) -> torch.Tensor:
        """(B,) packed position of the last kept token (its logits chose next_token)."""
        return self.path.gather(1, (self.n - 1)[:, None])[:, 0]


def _along(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[b, index[b]] for x (B, K, ...) and index (B,)."""
    return x[torch.arange(x.shape[0], device=x.device), index]


def accept_greedy(tree: TreeBatch, beams: torch.Tensor, logits: torch.Tensor) -> Acceptance:
    """logits (B, N, V) of the packed tree."""
    B, W, L = beams.shape
    choice = logits.argmax(dim=-1)  # (B, N): the target's token after each tree node
    pred = choice.gather(1, tree.unpack.flatten(1)).view(B, W, L)
    match = (beams[:, :, 1:] == pred[:, :, :-1]) & tree.valid[:, :, 1:]
    accepted = match.to(torch.int8).cumprod(dim=-1).sum(dim=-1)  # drafted tokens kept per beam
    best = accepted.argmax(dim=1)
    n = _along(accepted, best).long() + 1
    path = _along(tree.unpack, best)
    next_token = _along(pred, best).gather(1, (n - 1)[:, None])[:, 0]
    return Acceptance(path=path, n=n, next_token=next_token, beam=best)


def accept_tree_sampling(tree: TreeBatch, beams: torch.Tensor, probs: torch.Tensor,
                         generators: list) -> Acceptance:
    """Recursive rejection over deterministic candidates.

    probs (B, N, V): the target's p at every packed node (already temperature/top-k/top-p).
    At a node with distinct children c_1..c_m (in beam order) and r = p: accept c_k with
    probability r(c_k) / sum(r); on rejection set r(c_k) = 0. With u_k uniform this is
    ``u_k * (1 - sum_{i<k} r(c_i)) < r(c_k)``, so all children are tested at once. If every
    child is rejected, the next token is sampled from what is left of r.
    """
    B, W, L = beams.shape
    device = beams.device
    rows = torch.arange(B, device=device)
    beam_ids = torch.arange(W, device=device)[None, :]
    u = uniform((max(L - 1, 1), W), generators, device)
    alive = torch.ones(B, W, dtype=torch.bool, device=device)
    node = torch.zeros(B, dtype=torch.long, device=device)  # the root g0 is packed first
    best = torch.zeros(B, dtype=torch.long, device=device)
    n = torch.ones(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    for j in range(L - 1):  # depth loop only: rows and children are vectorised
        p = probs[rows, node]
        tok = beams[:, :, j + 1]
        cand = alive & (tree.owner[:, :, j + 1] == beam_ids) & tree.valid[:, :, j + 1] & ~done[:, None]
        r = p.gather(1, tok) * cand
        left = 1 - (r.cumsum(dim=1) - r)  # mass not yet rejected when child k is tested
        ok = cand & (u[:, j] * left < r)
        moved = ok.any(dim=1)
        finish = ~done & ~moved
        if finish.any():
            rejected = torch.zeros_like(p).scatter_add_(1, tok, cand.float()) > 0
            rest = p.masked_fill(rejected, 0)
            rest = torch.where(rest.sum(1, keepdim=True) > 0, rest, p)  # guard float dust
            drawn = sample(rest[finish], [g for g, f in zip(generators, finish.tolist()) if f])
            next_token[finish] = drawn
            done |= finish
        k = ok.int().argmax(dim=1)
        node = torch.where(moved, tree.unpack[rows, k, j + 1], node)
        best = torch.where(moved, k, best)
        alive &= ~moved[:, None] | (tree.owner[:, :, j + 1] == k[:, None])
        n += moved.long()
    if (~done).any():
        live = ~done
        p = probs[rows, node]
        next_token[live] = sample(p[live], [g for g, f in zip(generators, live.tolist()) if f])
    return Acceptance(path=tree.unpack[rows, best], n=n, next_token=next_token, beam=best)


def accept_chain_sampling(tree: TreeBatch, beams: torch.Tensor, probs: torch.Tensor,
                          q: torch.Tensor, generators: list) -> Acceptance:
    """Speculative sampling of one sampled chain per row (W == 1).

    q (B, L-1, V): the draft distribution each drafted token was sampled from, computed
    with the same temperature/top-k/top-p as p. Accept x_j with probability
    min(1, p(x_j)/q(x_j)); at the first rejection sample from norm(max(0, p - q)); if the
    whole chain is accepted (or ends early) sample from p after its last token.
    """
    B, W, L = beams.shape
    assert W == 1, "sampled drafts are verified as one chain per row"
    device = beams.device
    rows = torch.arange(B, device=device)
    chain = tree.unpack[:, 0]  # (B, L) packed positions along the chain
    p = probs.gather(1, chain[:, :, None].expand(-1, -1, probs.shape[-1]))  # (B, L, V)
    x = beams[:, 0, 1:]
    valid = tree.valid[:, 0, 1:]
    px = p[:, :-1].gather(2, x[:, :, None])[:, :, 0]
    qx = q.gather(2, x[:, :, None])[:, :, 0]
    u = uniform((max(L - 1, 1),), generators, device)[:, : L - 1]
    ok = (u * qx < px) & valid
    m = ok.to(torch.int8).cumprod(dim=1).sum(dim=1).long()  # drafted tokens accepted
    p_m = p[rows, m]
    rejected = torch.zeros(B, dtype=torch.bool, device=device)
    if L > 1:
        j = m.clamp(max=L - 2)
        rejected = (m < L - 1) & valid[rows, j]
        residual = (p_m - q[rows, j]).clamp(min=0)
        has_mass = residual.sum(1, keepdim=True) > 0
        p_m = torch.where(rejected[:, None] & has_mass, residual, p_m)
    next_token = sample(p_m, generators)
    zero = torch.zeros(B, dtype=torch.long, device=device)
    return Acceptance(path=chain, n=m + 1, next_token=next_token, beam=zero)
