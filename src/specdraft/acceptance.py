"""Exact acceptance rules (BRIEF section 4). All work on a packed tree.

Common shapes: B rows, W beams, L tokens per beam (beam[:, :, 0] is g0, the token the
target chose last, always accepted), N packed tree tokens, V vocabulary.
Each rule returns an ``Acceptance``: which packed tokens to keep (the path of one beam,
g0 included), how many, and the next token chosen by the target (the new g0).

- greedy: the longest beam prefix that equals the target's argmax chain.
- deterministic candidates (beam search, lookup, top-k trees) under sampling: recursive
  rejection down the tree with point-mass proposals; the output is distributed exactly as
  the target's p.
- sampled chains (a draft model sampled x ~ q): standard speculative sampling; several
  chains, one after another at each node: recursive rejection, with i.i.d. drafts
  (SpecInfer's multi-step speculative sampling) or drafts drawn without replacement (each
  with its own conditional q; Jeon et al. 2024, recursive speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample
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
    """Recursive rejection over deterministic candidates, as one draw from p per depth.

    probs (B, N, V): the target's p at every packed node (already temperature/top-k/top-p).
    At a node with distinct children c_1..c_m, recursive rejection (accept c_k with
    probability r(c_k) / sum(r), on rejection zero r(c_k), finally sample what is left of r)
    has the same law as one draw x ~ p: the walk moves to the child x if there is one, and
    otherwise x (a token no child holds, so p restricted to the non-children) is the next
    token. Drawing it that way makes a row consume exactly (its accepted drafts + 1) draws
    from its generator, whatever the other rows of its batch propose: a seeded request's
    output does not depend on the batch it was decoded in.
    """
    B, W, L = beams.shape
    device = beams.device
    rows = torch.arange(B, device=device)
    beam_ids = torch.arange(W, device=device)[None, :]
    alive = torch.ones(B, W, dtype=torch.bool, device=device)
    node = torch.zeros(B, dtype=torch.long, device=device)  # the root g0 is packed first
    best = torch.zeros(B, dtype=torch.long, device=device)
    n = torch.ones(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    flat = probs.reshape(B * probs.shape[1], -1)  # index_select of whole rows: a plain copy
    for j in range(L):  # depth loop only: rows and children are vectorised
        live = (~done).nonzero().flatten()
        if live.numel() == 0:
            break
        p_live = flat.index_select(0, live * probs.shape[1] + node.index_select(0, live))
        x = torch.zeros(B, dtype=torch.long, device=device)
        x.index_copy_(0, live, sample(p_live, [generators[i] for i in live.tolist()]))
        if j == L - 1:  # below the deepest drafts: x is the next token
            next_token = torch.where(done, next_token, x)
            break
        cand = alive & (tree.owner[:, :, j + 1] == beam_ids) & tree.valid[:, :, j + 1] & ~done[:, None]
        hit = cand & (beams[:, :, j + 1] == x[:, None])  # at most one: children are distinct
        moved = hit.any(dim=1)
        finish = ~done & ~moved
        next_token = torch.where(finish, x, next_token)
        done |= finish
        k = hit.int().argmax(dim=1)
        node = torch.where(moved, tree.unpack[rows, k, j + 1], node)
        best = torch.where(moved, k, best)
        alive &= ~moved[:, None] | (tree.owner[:, :, j + 1] == k[:, None])
        n += moved.long()
    return Acceptance(path=tree.unpack[rows, best], n=n, next_token=next_token, beam=best)


def accept_sampled(tree: TreeBatch, beams: torch.Tensor, probs: torch.Tensor, q: torch.Tensor,
                   generators: list) -> Acceptance:
    """Sampled drafts, q (B, W, L-1, V): one chain (W == 1) by speculative sampling,
    several by ``accept_chains_sampling``."""
    if beams.shape[1] == 1:
        return accept_chain_sampling(tree, beams, probs, q[:, 0], generators)
    return accept_chains_sampling(tree, beams, probs, q, generators)


def accept_chain_sampling(tree: TreeBatch, beams: torch.Tensor, probs: torch.Tensor,
                          q: torch.Tensor, generators: list) -> Acceptance:
    """Speculative sampling of one sampled chain per row (W == 1).

    q (B, L-1, V): the draft distribution each drafted token was sampled from, computed
    with the same temperature/top-k/top-p as p. Accept x_j with probability
    min(1, p(x_j)/q(x_j)); at the first rejection sample from norm(max(0, p - q)); if the
    whole chain is accepted (or ends early) sample from p after its last token.
    """
    B, W, L = beams.shape
    assert W == 1, "one sampled chain per row here; several: accept_chains_sampling"
    device = beams.device
    rows = torch.arange(B, device=device)
    chain = tree.unpack[:, 0]  # (B, L) packed positions along the chain
    p = probs.gather(1, chain[:, :, None].expand(-1, -1, probs.shape[-1]))  # (B, L, V)
    x = beams[:, 0, 1:]
    valid = tree.valid[:, 0, 1:]
    px = p[:, :-1].gather(2, x[:, :, None])[:, :, 0]
    qx = q.gather(2, x[:, :, None])[:, :, 0]
    u = _own_uniforms(valid.sum(dim=1).tolist(), L - 1, generators, device)
    ok = (u * qx < px) & valid
    m = ok.to(torch.int8).cumprod(dim=1).sum(dim=1).long()  # drafted tokens accepted
    p_m = p[rows, m]
    rejected = torch.zeros(B, dtype=torch.bool, device=device)
    if L > 1:
        j = m.clamp(max=L - 2)
        rejected = (m < L - 1) & valid[rows, j]
        p_m = torch.where(rejected[:, None], _residual(p_m, q[rows, j]), p_m)
    next_token = sample(p_m, generators)
    zero = torch.zeros(B, dtype=torch.long, device=device)
    return Acceptance(path=chain, n=m + 1, next_token=next_token, beam=zero)


def accept_chains_sampling(tree: TreeBatch, beams: torch.Tensor, probs: torch.Tensor,
                           q: torch.Tensor, generators: list) -> Acceptance:
    """Several chains per row, verified together. q (B, W, L-1, V): q[:, k, j] is the law
    chain k's token at depth j + 1 was drawn from, given its prefix and the tokens the
    chains before it (k' < k) drew at that node: the node's q for i.i.d. draws, that q with
    the earlier chains' tokens removed and renormalised for draws without replacement.

    At the path's node at depth j, the live chains are those whose tokens equal the path so
    far. Recursive rejection: r = p; for each live chain k in order, accept its token x with
    probability min(1, r(x)/q_k(x)), else r = norm(max(0, r - q_k)); when all are rejected,
    draw the next token from r. Each trial is one speculative-sampling step of r by q_k,
    whose output is r-distributed overall whatever q_k is (q_k may depend on the earlier
    trials' tokens, not on their outcomes), so the node's output is p-distributed (by
    induction over the trials from the last; i.i.d. duplicates count as separate trials).
    Without replacement no token is tried twice: a sharp q's second draw is not its first
    again (Jeon et al. 2024). A row draws one uniform per trial and one token at the end,
    so its stream depends on its own outcomes only.
    """
    B, W, L = beams.shape
    device = beams.device
    rows = torch.arange(B, device=device)
    valid = tree.valid
    live = torch.ones(B, W, dtype=torch.bool, device=device)
    best = torch.zeros(B, dtype=torch.long, device=device)
    n = torch.ones(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    next_token = torch.zeros(B, dtype=torch.long, device=device)
    for j in range(L):  # depth loop: the path's node at depth j chooses its child
        r = probs[rows, tree.unpack[rows, best, j]]  # (B, V) p at the path's node
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        for k in range(W if j < L - 1 else 0):  # the trials, chain by chain
            trial = live[:, k] & valid[:, k, j + 1] & ~done & ~moved
            if not bool(trial.any()):
                continue
            x, qk = beams[:, k, j + 1], q[:, k, j]
            u = _own_uniforms(trial.long().tolist(), 1, generators, device)[:, 0]
            ok = trial & (u * qk.gather(1, x[:, None])[:, 0] < r.gather(1, x[:, None])[:, 0])
            best = torch.where(ok, k, best)
            moved |= ok
            r = torch.where((trial & ~ok)[:, None], _residual(r, qk), r)
        finish = ~done & ~moved
        if bool(finish.any()):
            idx = finish.nonzero().flatten()
            next_token[idx] = sample(r[idx], [generators[i] for i in idx.tolist()])
        done |= finish
        if bool(done.all()):  # always so after the deepest node
            break
        token = beams[rows, best, j + 1]  # the child the moved rows went to
        live &= (beams[:, :, j + 1] == token[:, None]) & valid[:, :, j + 1]
        n += moved.long()
    return Acceptance(path=tree.unpack[rows, best], n=n, next_token=next_token, beam=best)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row, (B, V); p itself where nothing is left (p <= q
    everywhere: then a rejection had probability 0, up to rounding). Normalised, because
    a next trial compares it with q."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def _own_uniforms(counts: list[int], width: int, generators: list, device) -> torch.Tensor:
    """(B, width) uniforms: row b draws counts[b] from its own generator (the rest are 1,
    which no test accepts), so its stream does not depend on the other rows' lengths."""
    u = torch.ones(len(counts), width, device=device)
    for b, (c, g) in enumerate(zip(counts, generators)):
        if c:
            u[b, :c] = torch.rand((c,), generator=g, device=device)
    return u
