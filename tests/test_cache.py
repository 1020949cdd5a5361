"""CompactCache (specdraft.cache) on the tiny random target: after tree forwards and
commits, every row's committed slots hold exactly the keys/values that running its
tokens sequentially through the model with a fresh DynamicCache produces; the tree's
hidden states equal separate sequential runs of each candidate prefix."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdraft.cache import CompactCache
from specdraft.tree import pack_beams

ATOL = 2e-5


def sequential_kv(target, seq: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (H, T, D) keys and values of ``seq`` from a plain causal run of the model
    with a fresh DynamicCache: the prompt in one pass, then one token at a time."""
    cache = DynamicCache(config=target.model.config)
    split = max(1, len(seq) - 4)
    with torch.no_grad():
        target.model(torch.tensor([seq[:split]]), past_key_values=cache, use_cache=True)
        for tok in seq[split:]:
            target.model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def last_hidden(target, seqs: list[list[int]]) -> torch.Tensor:
    """(len(seqs), d): the model's own last-layer hidden state (after the final norm) at
    the end of each sequence (one right-padded causal pass; padding comes after the end)."""
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    return out.hidden_states[-1][torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]


def prefill(target, cache: CompactCache, prompts: list[list[int]]) -> None:
    """Right-padded prompts in one pass, then commit each row's real tokens (as the engine does)."""
    B, P = len(prompts), max(map(len, prompts))
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    pos = torch.arange(P)
    real = pos[None, :] < lengths[:, None]
    mask = ((pos[None, :, None] >= pos[None, None, :]) & real[:, None, :]) | (torch.eye(P, dtype=torch.bool) & ~real[:, :, None])
    with torch.no_grad():
        target.forward(tokens, pos[None].expand(B, -1), mask[:, None], cache)
    cache.commit(pos[None].expand(B, -1), lengths)


def tree_step(target, cache: CompactCache, seqs: list[list[int]], beams: torch.Tensor, valid: torch.Tensor,
              choice: list[tuple[int, int]], check_hidden: bool = True) -> None:
    """Verify ``beams`` on top of the cache, check every candidate's hidden state against a
    sequential run, then commit beam choice[b][0]'s first choice[b][1] tokens. ``seqs`` (the
    committed tokens per row) is extended in place."""
    tree = pack_beams(beams, valid)
    positions = cache.lengths[:, None] + tree.depth
    with torch.no_grad():
        hidden = target.forward(tree.tokens, positions, cache.attention_mask(tree.mask), cache)
    B, W, L = beams.shape
    for b in range(B if check_hidden else 0):
        cands = [(w, j) for w in range(W) for j in range(L) if valid[b, w, j]]
        want = last_hidden(target, [seqs[b] + beams[b, w, : j + 1].tolist() for w, j in cands])
        got = hidden[b, [int(tree.unpack[b, w, j]) for w, j in cands]]
        assert torch.allclose(got, want, atol=ATOL), (b, (got - want).abs().max())
    beam = torch.tensor([c[0] for c in choice])
    n = torch.tensor([c[1] for c in choice])
    cache.commit(tree.unpack[torch.arange(B), beam], n)
    for b, (w, k) in enumerate(choice):
        seqs[b].extend(beams[b, w, :k].tolist())


def check_committed(target, cache: CompactCache, seqs: list[list[int]]) -> None:
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    assert cache.width == max(len(s) for s in seqs)
    for b, seq in enumerate(seqs):
        for layer, (k, v) in zip(cache.layers, sequential_kv(target, seq)):
            T = len(seq)
            assert torch.allclose(layer.keys[b, :, :T], k, atol=ATOL), (b, (layer.keys[b, :, :T] - k).abs().max())
            assert torch.allclose(layer.values[b, :, :T], v, atol=ATOL), (b, (layer.values[b, :, :T] - v).abs().max())


def random_beams(gen, g0: list[int], W: int, L: int, vocab: int, lengths: list[list[int]]):
    beams = torch.randint(1, vocab, (len(g0), W, L), generator=gen)
    beams[:, :, 0] = torch.tensor(g0)[:, None]
    beams[:, -1, :2] = beams[:, 0, :2]  # shared prefixes
    valid = torch.arange(L)[None, None, :] < torch.tensor(lengths)[:, :, None]
    return beams, valid


@pytest.fixture()
def setup(tiny_target):
    gen = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 2, 3]]
    # Capacity 8 < longest prompt + tree: the first tree forward must grow the buffers.
    cache = CompactCache(tiny_target.num_layers, len(prompts), capacity=8, device="cpu")
    prefill(tiny_target, cache, prompts)
    return tiny_target, cache, [list(p) for p in prompts], gen


def test_prefill_ragged(setup):
    target, cache, seqs, _ = setup
    check_committed(target, cache, seqs)


def test_tree_commit_keeps_exactly_the_accepted_path(setup):
    target, cache, seqs, gen = setup
    V = target.vocab_size
    beams, valid = random_beams(gen, [1, 2, 3], W=3, L=4, vocab=V, lengths=[[4, 2, 4], [4, 4, 3], [1, 3, 4]])
    # Ragged acceptance: row 0 keeps only g0, row 1 a whole beam, row 2 two tokens of beam 2.
    tree_step(target, cache, seqs, beams, valid, choice=[(0, 1), (1, 4), (2, 2)])
    assert cache.capacity > 8 and all(layer.keys.shape[2] >= cache.width for layer in cache.layers)
    check_committed(target, cache, seqs)
    # A second step on top: stale entries of rejected branches must not leak in.
    beams, valid = random_beams(gen, [4, 5, 6], W=2, L=3, vocab=V, lengths=[[3, 3], [2, 3], [3, 1]])
    tree_step(target, cache, seqs, beams, valid, choice=[(1, 3), (0, 1), (0, 3)])
    check_committed(target, cache, seqs)


def test_select_rows(setup):
    target, cache, seqs, gen = setup
    V = target.vocab_size
    beams, valid = random_beams(gen, [1, 2, 3], W=2, L=3, vocab=V, lengths=[[3, 3], [3, 2], [2, 3]])
    tree_step(target, cache, seqs, beams, valid, choice=[(0, 3), (1, 2), (1, 1)])
    keep = torch.tensor([2, 0])
    cache.select_rows(keep)
    seqs = [seqs[2], seqs[0]]
    check_committed(target, cache, seqs)
    beams, valid = random_beams(gen, [7, 8], W=2, L=3, vocab=V, lengths=[[3, 2], [3, 3]])
    tree_step(target, cache, seqs, beams, valid, choice=[(0, 2), (1, 3)])
    check_committed(target, cache, seqs)


def test_truncate_then_continue(setup):
    target, cache, seqs, gen = setup
    V = target.vocab_size
    beams, valid = random_beams(gen, [1, 2, 3], W=1, L=4, vocab=V, lengths=[[4], [4], [4]])
    tree_step(target, cache, seqs, beams, valid, choice=[(0, 4), (0, 4), (0, 4)])
    # Forget the last 2 tokens of row 0 and 1 of row 2 (e.g. rejected drafts); row 1 keeps all.
    new = torch.tensor([len(seqs[0]) - 2, len(seqs[1]), len(seqs[2]) - 1])
    cache.truncate(new)
    seqs = [s[:n] for s, n in zip(seqs, new.tolist())]
    check_committed(target, cache, seqs)
    # Truncating to a longer length is a no-op.
    cache.truncate(new + 5)
    assert cache.lengths.tolist() == new.tolist()
    beams, valid = random_beams(gen, [9, 10, 11], W=2, L=3, vocab=V, lengths=[[3, 3], [2, 1], [3, 2]])
    tree_step(target, cache, seqs, beams, valid, choice=[(1, 3), (0, 2), (0, 3)])
    check_committed(target, cache, seqs)


def test_growth_preserves_contents(setup):
    target, cache, seqs, gen = setup
    V = target.vocab_size
    caps = []
    for step in range(6):  # chains of 5 fully accepted: well past the initial capacity of 8
        beams, valid = random_beams(gen, [1 + step] * 3, W=1, L=5, vocab=V, lengths=[[5], [5], [5]])
        tree_step(target, cache, seqs, beams, valid, choice=[(0, 5), (0, 3), (0, 5)], check_hidden=step == 5)
        caps.append(cache.capacity)
    assert caps[-1] >= cache.width > 8 and len(set(caps)) > 1
    check_committed(target, cache, seqs)


def test_attention_mask_layout(setup):
    _, cache, seqs, _ = setup
    tree_mask = torch.eye(2, dtype=torch.bool)[None].expand(3, -1, -1)
    m = cache.attention_mask(tree_mask)
    W = cache.width
    assert m.shape == (3, 1, 2, W + 2)
    for b, s in enumerate(seqs):
        assert m[b, 0, :, :W].tolist() == [[i < len(s) for i in range(W)]] * 2
        assert torch.equal(m[b, 0, :, W:], tree_mask[b])
