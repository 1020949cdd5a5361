"""Dynamic tree attention: verify every candidate beam in one target forward pass.

Beams share prefixes (all start with the token the target chose last, many share more).
``pack_beams`` keeps each distinct prefix once, and says for every packed token which
packed tokens it may attend to (its ancestors and itself). The target then runs on the
packed tokens with a 4D boolean mask and explicit position ids; ``TreeBatch.unpack`` maps
each (beam, depth) back to the packed position whose logits/hidden state belong to it.

Shapes: B rows (sequences), W beams per row, L tokens per beam, N packed tokens per row
(N = max over rows of the distinct prefixes; shorter rows are padded). Everything is
vectorised over B, W and L: there is no Python loop over beams or tokens (except in
the host helpers at the end, ``row_owners``, ``row_ranks`` and ``node_values``, which walk
one row's few nodes for the adaptive policy).

Packed order is depth-major (all depth-0 tokens, then depth 1, ...; within a depth by
beam index), so a parent always precedes its children.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class TreeBatch:
    """A packed candidate tree per row.

    tokens:  (B, N) long   packed token ids (padding slots hold token 0)
    depth:   (B, N) long   depth of each packed token (0 = the root g0); padding: 0
    mask:    (B, N, N) bool  mask[b, t, s] = packed token s is t itself or an ancestor of t;
                             padding tokens see only themselves (so no attention row is empty)
    real:    (B, N) bool   False on padding slots
    unpack:  (B, W, L) long  packed position of beam w's token at depth l (0 where invalid)
    owner:   (B, W, L) long  smallest beam index sharing beam w's prefix through depth l
    valid:   (B, W, L) bool  the candidate mask the tree was built from (prefix-closed)
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    real: torch.Tensor
    unpack: torch.Tensor
    owner: torch.Tensor
    valid: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: torch.Tensor) -> "TreeBatch":
        """The same tree restricted to ``rows`` (1D long)."""
        return TreeBatch(**{k: getattr(self, k).index_select(0, rows) for k in self.__dataclass_fields__})


def prefix_owner(beams: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """owner[b, i, j] = smallest beam k whose first j+1 tokens equal beam i's (k <= i).

    beams, valid: (B, W, L). Where valid[b, i, j] is False the owner is i itself (unused).
    """
    same = (beams[:, :, None, :] == beams[:, None, :, :])
    same &= valid[:, :, None, :] & valid[:, None, :, :]
    # A shared prefix through depth j needs equality at every depth up to j.
    shared = same.to(torch.int8).cumprod(dim=-1).bool()  # (B, W_i, W_k, L)
    # argmax returns the first maximal index: the smallest matching beam k.
    owner = shared.to(torch.int8).argmax(dim=2)  # (B, W, L)
    self_idx = torch.arange(beams.shape[1], device=beams.device)[None, :, None]
    return torch.where(valid, owner, self_idx.expand_as(owner))


def pack_beams(beams: torch.Tensor, valid: torch.Tensor | None = None) -> TreeBatch:
    """Deduplicate shared prefixes of ``beams`` (B, W, L) into a packed tree.

    ``valid`` (B, W, L) marks which candidate tokens exist; it must be prefix-closed
    (a valid token has all earlier tokens of its beam valid) and valid[:, :, 0] all True.
    """
    B, W, L = beams.shape
    device = beams.device
    if valid is None:
        valid = torch.ones_like(beams, dtype=torch.bool)
    owner = prefix_owner(beams, valid)
    beam_idx = torch.arange(W, device=device)[None, :, None]
    owns = (owner == beam_idx) & valid  # (B, W, L): this beam contributes this token

    # Depth-major flattening so that parents come before children.
    owns_flat = owns.transpose(1, 2).reshape(B, L * W)
    n_tokens = owns_flat.sum(dim=1)
    N = int(n_tokens.max())
    slot = owns_flat.long().cumsum(dim=1) - 1  # packed position of each owned token
    slot_of = slot.reshape(B, L, W).transpose(1, 2)  # (B, W, L), meaningful where owns

    # Each (beam, depth) reads the slot of the beam that owns that prefix.
    unpack = torch.gather(slot_of, 1, owner)
    unpack = torch.where(valid, unpack, torch.zeros_like(unpack))

    # Scatter owned tokens into their packed slots; unused slots stay as padding.
    dump = torch.full_like(slot, N)  # non-owned entries go to an overflow column
    target = torch.where(owns_flat, slot, dump)
    depth_flat = torch.arange(L, device=device).repeat_interleave(W)[None, :].expand(B, -1)
    tokens = torch.zeros(B, N + 1, dtype=beams.dtype, device=device)
    tokens.scatter_(1, target, beams.transpose(1, 2).reshape(B, L * W))
    depth = torch.zeros(B, N + 1, dtype=torch.long, device=device)
    depth.scatter_(1, target, depth_flat)
    real = torch.arange(N, device=device)[None, :] < n_tokens[:, None]

    # Ancestor mask: a beam's token at depth j sees its beam's slots at depths <= j.
    onehot = torch.nn.functional.one_hot(unpack, N).bool() & valid[..., None]
    path = onehot.to(torch.int8).cumsum(dim=2).bool()  # (B, W, L, N): slots on the path to (w, j)
    rows = torch.zeros(B, N + 1, N, dtype=torch.bool, device=device)
    rows.scatter_(1, target[:, :, None].expand(-1, -1, N), path.transpose(1, 2).reshape(B, L * W, N))
    mask = rows[:, :N]
    # Padding slots attend to themselves only, so softmax never sees an all-masked row.
    eye = torch.eye(N, dtype=torch.bool, device=device)[None]
    mask = mask | (eye & ~real[:, :, None])
    return TreeBatch(tokens=tokens[:, :N], depth=depth[:, :N], mask=mask, real=real,
                     unpack=unpack, owner=owner, valid=valid)


def unpack_beams(tree: TreeBatch) -> torch.Tensor:
    """Inverse of packing: (B, W, L) token ids read back from the packed tokens.

    Invalid candidate positions come back as 0.
    """
    out = torch.gather(tree.tokens, 1, tree.unpack.flatten(1)).view_as(tree.unpack)
    return torch.where(tree.valid, out, torch.zeros_like(out))


# ---- the owner geometry the adaptive policy reads ---------------------------------------


def row_owners(beams: list[list[int]], valid: list[list[bool]]) -> list[list[int]]:
    """``prefix_owner`` of one row, on the host: beams, valid W lists of L (``valid``
    prefix-closed); owner[w][j] = the smallest beam k whose first j + 1 tokens equal beam
    w's, both valid through j; w itself where (w, j) is not valid."""
    W, L = len(beams), len(beams[0])
    owner = [[w] * L for w in range(W)]
    for w in range(W):
        for j in range(L):
            if not valid[w][j]:
                break
            start = owner[w][j - 1] if j else 0  # a prefix shared through j is shared through j - 1
            owner[w][j] = next(k for k in range(start, w + 1) if valid[k][j] and beams[k][j] == beams[w][j]
                               and (j == 0 or owner[k][j - 1] == owner[w][j - 1]))
    return owner


def row_ranks(owner: list[list[int]], valid: list[list[bool]]) -> list[list[int]]:
    """rank[w][j] of one row: how many distinct earlier siblings (same parent, a smaller
    owner beam) token (w, j) has; 0 at depth 0. ``owner`` from ``row_owners``."""
    W, L = len(owner), len(owner[0])
    owns = [[owner[w][j] == w and valid[w][j] for j in range(L)] for w in range(W)]

    def parent(x: int, j: int) -> int:
        return owner[x][j - 1] if j else 0

    return [[sum(1 for k in range(owner[w][j]) if owns[k][j] and parent(k, j) == parent(w, j))
             for j in range(L)] for w in range(W)]


def node_values(owner: list[list[int]], valid: list[list[bool]], rates: list[float], kappa: float,
                conf: list[list[float]] | None) -> dict[tuple[int, int], float]:
    """{(depth j >= 1, owner beam w): P(the node is accepted)} for one row's nodes (``owner``
    from ``row_owners``): the product along its path of p = min(1, kappa c) (c its
    confidence, ``conf`` W lists of L; NaN or None: none), else a_j (1 - a_j)^rank, a_j =
    ``rates[j - 1]`` and rank its index among its siblings (``row_ranks``)."""
    W, L = len(owner), len(owner[0])
    rank = row_ranks(owner, valid)
    values: dict[tuple[int, int], float] = {}
    for j in range(1, L):
        for w in range(W):
            if owner[w][j] != w or not valid[w][j]:
                continue
            p = rates[j - 1] * (1 - rates[j - 1]) ** rank[w][j]
            if conf is not None and not math.isnan(conf[w][j]):
                p = min(max(kappa * conf[w][j], 0.0), 1.0)
            values[(j, w)] = p * values.get((j - 1, owner[w][j - 1]), 1.0)  # the parent's value
    return values


def children_confidence(tree_owner: torch.Tensor, valid: torch.Tensor, confidence: torch.Tensor,
                        beam: torch.Tensor) -> torch.Tensor:
    """predicted (B, L): at depth j, the summed confidence (capped at 1) of the children of
    the accepted beam's node at depth j - 1: the drafter's P(the path goes one deeper)."""
    B, W, L = tree_owner.shape
    if W == 1:  # a chain: the only child of the path's node at depth j - 1 is its token at j
        return torch.where(valid[:, 0], confidence[:, 0].float(), 0.0).clamp(max=1.0)  # NaN stays NaN
    rows = torch.arange(B, device=beam.device)
    parent = torch.nn.functional.pad(tree_owner[:, :, :-1], (1, 0))
    on_path = parent[rows, beam]  # (B, L): the accepted beam's parent owner at each depth
    owns = (tree_owner == torch.arange(W, device=beam.device)[None, :, None]) & valid
    children = owns & (parent == on_path[:, None, :])
    conf = confidence.float()
    total = torch.where(children, conf.nan_to_num(0.0), 0.0).sum(dim=1).clamp(max=1.0)
    unknown = (children & torch.isnan(conf)).any(dim=1)
    return torch.where(unknown, torch.nan, total)
