"""Tree packing (specdraft.tree): property tests against a brute-force model of the
candidate tree, plus hand-worked examples written out literally."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from specdraft.tree import pack_beams, prefix_owner, unpack_beams

T, F = True, False


# ---- brute force ------------------------------------------------------------------------

def brute_prefixes(beams: list[list[int]], lengths: list[int]) -> set[tuple[int, ...]]:
    """Every distinct valid prefix (g0 included) of one row's beams."""
    return {tuple(beam[: j + 1]) for beam, n in zip(beams, lengths) for j in range(n)}


def brute_owner(beams: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """owner[i][j]: smallest k whose valid prefix through j equals beam i's; i where invalid."""
    W, L = len(beams), len(beams[0])
    out = []
    for i in range(W):
        row = []
        for j in range(L):
            if j >= lengths[i]:
                row.append(i)
                continue
            row.append(min(k for k in range(W) if j < lengths[k] and beams[k][: j + 1] == beams[i][: j + 1]))
        out.append(row)
    return out


@st.composite
def beam_batches(draw):
    """(beams (B, W, L), valid (B, W, L)) with a tiny vocabulary so that prefixes collide.

    valid is prefix-closed (a random length 1..L per beam), column 0 always valid, and
    every beam of a row starts with the row's g0."""
    B = draw(st.integers(1, 3))
    W = draw(st.integers(1, 5))
    L = draw(st.integers(1, 5))
    V = draw(st.integers(1, 3))
    flat = draw(st.lists(st.integers(0, V - 1), min_size=B * W * L, max_size=B * W * L))
    beams = torch.tensor(flat, dtype=torch.long).view(B, W, L)
    g0 = torch.tensor(draw(st.lists(st.integers(0, 9), min_size=B, max_size=B)))
    beams[:, :, 0] = g0[:, None]
    lengths = torch.tensor(draw(st.lists(st.integers(1, L), min_size=B * W, max_size=B * W))).view(B, W)
    valid = torch.arange(L)[None, None, :] < lengths[:, :, None]
    return beams, valid


@settings(max_examples=200, deadline=None)
@given(beam_batches())
def test_pack_matches_brute_force(batch):
    beams, valid = batch
    B, W, L = beams.shape
    tree = pack_beams(beams, valid)
    N = tree.size
    assert tree.tokens.shape == tree.depth.shape == tree.real.shape == (B, N)
    assert tree.mask.shape == (B, N, N) and tree.mask.dtype == torch.bool
    assert tree.unpack.shape == tree.owner.shape == (B, W, L)

    # Unpacking gives the beams back on valid positions (0 elsewhere).
    assert torch.equal(unpack_beams(tree), torch.where(valid, beams, torch.zeros_like(beams)))

    lengths = valid.sum(-1)
    counts = []
    for b in range(B):
        bl = beams[b].tolist()
        ln = lengths[b].tolist()
        prefixes = brute_prefixes(bl, ln)
        counts.append(len(prefixes))
        # Slot of every valid (beam, depth); one slot per distinct prefix and vice versa.
        slot_of: dict[tuple[int, ...], int] = {}
        for w in range(W):
            for j in range(ln[w]):
                pre = tuple(bl[w][: j + 1])
                s = int(tree.unpack[b, w, j])
                assert slot_of.setdefault(pre, s) == s, "one prefix packed in two slots"
        assert set(slot_of) == prefixes
        prefix_at = {s: pre for pre, s in slot_of.items()}
        assert len(prefix_at) == len(prefixes), "two prefixes share a slot"
        n_real = len(prefixes)
        # Real slots are exactly the first n_real, each holding a distinct prefix:
        # no (parent path, token) pair appears twice.
        assert sorted(prefix_at) == list(range(n_real))
        assert tree.real[b].tolist() == [s < n_real for s in range(N)]
        for s in range(N):
            if s < n_real:
                pre = prefix_at[s]
                assert int(tree.tokens[b, s]) == pre[-1]
                assert int(tree.depth[b, s]) == len(pre) - 1
                if len(pre) > 1:  # parents precede children
                    assert slot_of[pre[:-1]] < s
                # Sees exactly its ancestors and itself, nothing else (no padding either).
                expect = [t < n_real and pre[: len(prefix_at[t])] == prefix_at[t] for t in range(N)]
                assert tree.mask[b, s].tolist() == expect
            else:  # padding: token 0, depth 0, sees only itself
                assert int(tree.tokens[b, s]) == 0 and int(tree.depth[b, s]) == 0
                assert tree.mask[b, s].tolist() == [t == s for t in range(N)]
        # The packed token at depth 0 is the root g0, in slot 0.
        assert int(tree.unpack[b, 0, 0]) == 0
        assert tree.owner[b].tolist() == brute_owner(bl, ln)
        # Unused unpack entries are 0.
        assert all(int(tree.unpack[b, w, j]) == 0 for w in range(W) for j in range(ln[w], L))
    assert N == max(counts)
    assert tree.real.sum(1).tolist() == counts
    assert torch.equal(tree.valid, valid)
    assert torch.equal(prefix_owner(beams, valid), tree.owner)


@settings(max_examples=50, deadline=None)
@given(beam_batches())
def test_select_rows_is_row_restriction(batch):
    beams, valid = batch
    tree = pack_beams(beams, valid)
    rows = torch.arange(beams.shape[0]).flip(0)
    sub = tree.select(rows)
    for name in tree.__dataclass_fields__:
        assert torch.equal(getattr(sub, name), getattr(tree, name)[rows])


def test_default_valid_is_all_true():
    beams = torch.tensor([[[4, 1, 2], [4, 1, 3]]])
    a = pack_beams(beams)
    b = pack_beams(beams, torch.ones_like(beams, dtype=torch.bool))
    for name in a.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name))


# ---- hand-worked examples -----------------------------------------------------------------

def check(tree, tokens, depth, real, mask, unpack, owner):
    assert tree.tokens.tolist() == tokens
    assert tree.depth.tolist() == depth
    assert tree.real.tolist() == real
    assert tree.mask.int().tolist() == mask
    assert tree.unpack.tolist() == unpack
    assert tree.owner.tolist() == owner


def test_example_branching_tree():
    # beam 0: 5 1 2        tree:   5 ─┬─ 1 ─┬─ 2   (slots 0, 1, 3)
    # beam 1: 5 1 3                   │     └─ 3   (slot 4)
    # beam 2: 5 4 2                   └─ 4 ─── 2   (slots 2, 5)
    beams = torch.tensor([[[5, 1, 2], [5, 1, 3], [5, 4, 2]]])
    tree = pack_beams(beams)
    check(tree,
          tokens=[[5, 1, 4, 2, 3, 2]],
          depth=[[0, 1, 1, 2, 2, 2]],
          real=[[T, T, T, T, T, T]],
          mask=[[[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 0, 1, 0, 0, 0],
                 [1, 1, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],
                 [1, 0, 1, 0, 0, 1]]],
          unpack=[[[0, 1, 3], [0, 1, 4], [0, 2, 5]]],
          owner=[[[0, 0, 0], [0, 0, 1], [0, 2, 2]]])
    assert unpack_beams(tree).tolist() == beams.tolist()


def test_example_duplicates_ragged_and_padding():
    # Row 0: beam 1 repeats beam 0 but stops at depth 1; beam 2 is only g0 (its "2 0" is
    # invalid): 3 distinct prefixes 7, 7 1, 7 1 1 -> padded to N = 6.
    # Row 1: 3 0 0 / 3 1 0 / 3 0 1: prefixes 3 | 3 0, 3 1 | 3 0 0, 3 1 0, 3 0 1.
    beams = torch.tensor([[[7, 1, 1], [7, 1, 1], [7, 2, 0]],
                          [[3, 0, 0], [3, 1, 0], [3, 0, 1]]])
    valid = torch.tensor([[[T, T, T], [T, T, F], [T, F, F]],
                          [[T, T, T], [T, T, T], [T, T, T]]])
    tree = pack_beams(beams, valid)
    check(tree,
          tokens=[[7, 1, 1, 0, 0, 0],
                  [3, 0, 1, 0, 0, 1]],
          depth=[[0, 1, 2, 0, 0, 0],
                 [0, 1, 1, 2, 2, 2]],
          real=[[T, T, T, F, F, F],
                [T, T, T, T, T, T]],
          mask=[[[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0],
                 [0, 0, 0, 1, 0, 0],
                 [0, 0, 0, 0, 1, 0],
                 [0, 0, 0, 0, 0, 1]],
                [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 0, 1, 0, 0, 0],
                 [1, 1, 0, 1, 0, 0],
                 [1, 0, 1, 0, 1, 0],
                 [1, 1, 0, 0, 0, 1]]],
          unpack=[[[0, 1, 2], [0, 1, 0], [0, 0, 0]],
                  [[0, 1, 3], [0, 2, 4], [0, 1, 5]]],
          owner=[[[0, 0, 0], [0, 0, 1], [0, 2, 2]],
                 [[0, 0, 0], [0, 1, 1], [0, 0, 2]]])
    assert unpack_beams(tree).tolist() == [[[7, 1, 1], [7, 1, 0], [7, 0, 0]],
                                           [[3, 0, 0], [3, 1, 0], [3, 0, 1]]]


def test_example_chain_and_lone_root():
    # One chain 9 8 8 8: four slots, causal mask; repeated tokens at different depths
    # are different prefixes and must all stay.
    tree = pack_beams(torch.tensor([[[9, 8, 8, 8]]]))
    check(tree,
          tokens=[[9, 8, 8, 8]],
          depth=[[0, 1, 2, 3]],
          real=[[T, T, T, T]],
          mask=[[[1, 0, 0, 0],
                 [1, 1, 0, 0],
                 [1, 1, 1, 0],
                 [1, 1, 1, 1]]],
          unpack=[[[0, 1, 2, 3]]],
          owner=[[[0, 0, 0, 0]]])
    # Two beams holding only g0 (L = 1): a single slot.
    tree = pack_beams(torch.tensor([[[4], [4]]]))
    check(tree, tokens=[[4]], depth=[[0]], real=[[T]], mask=[[[1]]], unpack=[[[0], [0]]], owner=[[[0], [0]]])
