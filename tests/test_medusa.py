"""Medusa-style heads (the ReDrafter paper's baseline): heads, top-W trees, the drafter
in the engine, checkpoints. Tiny random models only."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specdraft import SamplingParams, SpeculativeEngine
from specdraft.checkpoint import CONFIG
from specdraft.drafters import NoDrafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.errors import SpecdraftError
from specdraft.models import load_target
from specdraft.heads import MedusaHeads, ReDrafterHead, future_labels, independent_beam_search
from conftest import make_tiny_llama

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [3]]


def random_heads(target, head="own", seed=0, **kw) -> MedusaHeads:
    """Heads with random residual blocks (for_target starts them at zero)."""
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(target, head=head, **kw)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads.eval().requires_grad_(False)


def generate_ids(target, drafter, prompts, **params):
    params = SamplingParams(**{"max_new_tokens": 24, **params})
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)]


def test_fresh_heads_start_as_the_target_next_token_predictor(tiny_target):
    heads = MedusaHeads.for_target(tiny_target, num_heads=3)
    h = torch.randn(4, tiny_target.hidden_size)
    logits = heads.logits(h)
    assert logits.shape == (4, 3, tiny_target.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], tiny_target.logits(h))


def test_teacher_forced_layout(tiny_target):
    heads = random_heads(tiny_target, num_heads=3)
    hidden = torch.randn(2, 6, tiny_target.hidden_size)
    out = heads.teacher_forced_logits(hidden)
    assert out.shape == (2, 6, 3, tiny_target.vocab_size)
    torch.testing.assert_close(out[1, 4], heads.logits(hidden[1, 4]))
    labels = future_labels(torch.arange(6)[None].repeat(2, 1), 3)
    assert labels[0, 1].tolist() == [3, 4, 5]  # head i at position t predicts x_{t+2+i}


def test_top_w_tree_is_the_best_of_the_cartesian_product():
    V, K, W = 5, 3, 7
    log_probs = torch.log_softmax(torch.randn(2, K, V, generator=torch.Generator().manual_seed(0)), -1)
    g0 = torch.tensor([1, 4])
    res = independent_beam_search(log_probs, g0, W, K + 1)
    for b in range(2):
        every = sorted(((sum(log_probs[b, k, y].item() for k, y in enumerate(seq)), seq)
                        for seq in itertools.product(range(V), repeat=K)), reverse=True)
        assert [tuple(x) for x in res.beams[b, :, 1:].tolist()] == [seq for _, seq in every[:W]]
        assert res.scores[b].tolist() == pytest.approx([s for s, _ in every[:W]], abs=1e-5)
    assert (res.beams[:, :, 0] == g0[:, None]).all() and res.valid.all()
    wide = independent_beam_search(log_probs, g0, V ** K + 3, K + 1)  # more beams than sequences
    assert wide.valid.all(-1).sum(1).tolist() == [V ** K] * 2 and not wide.valid[:, V ** K:, 1:].any()


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_greedy_output_is_the_targets(tiny_target, variant):
    drafter = MedusaDrafter(random_heads(tiny_target, variant, num_heads=4), beam_width=6)
    plain = generate_ids(tiny_target, NoDrafter(), PROMPTS)
    assert generate_ids(tiny_target, drafter, PROMPTS) == plain  # batch 3, ragged
    for prompt, expected in zip(PROMPTS, plain):
        assert generate_ids(tiny_target, drafter, [prompt]) == [expected]  # batch 1
        ids = torch.tensor([prompt])
        ref = tiny_target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                         do_sample=False)[0, len(prompt):].tolist()
        assert ref[: len(expected)] == expected


def test_trained_heads_get_multi_token_acceptance(tmp_path):
    """Heads distilled on the target's own greedy continuations accept several tokens per
    step: head k must be aligned with the token k positions after g0."""
    target = load_target(str(make_tiny_llama(tmp_path / "m", vocab_size=64, seed=1)))
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 64, (96, 4), generator=g)
    with torch.no_grad():
        seq = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=24, min_new_tokens=24)
        hidden = target.base(input_ids=seq).last_hidden_state
    labels = future_labels(seq, 3)
    labels[:, :3] = -100  # next tokens inside the prompt are not the target's
    heads = MedusaHeads.for_target(target, num_heads=3).train()
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(heads.teacher_forced_logits(hidden).flatten(0, 2),
                                                 labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter = MedusaDrafter(heads.eval().requires_grad_(False), beam_width=4)
    test = torch.randint(1, 64, (6, 5), generator=g).tolist()
    results = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(test, SamplingParams(max_new_tokens=32, ignore_eos=True))
    tau = sum(r.new_tokens for r in results) / sum(r.steps for r in results)
    assert tau > 1.5, tau
    assert [r.token_ids for r in results] == generate_ids(target, NoDrafter(), test, max_new_tokens=32,
                                                          ignore_eos=True)


def test_checkpoint_roundtrip_and_errors(tiny_target, tmp_path):
    heads = random_heads(tiny_target, "shared", num_heads=3, num_blocks=2, beam_width=5)
    heads.save(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / CONFIG).read_text())
    assert cfg["kind"] == "medusa" and cfg["beam_length"] == 4 and cfg["num_heads"] == 3
    drafter = MedusaDrafter.load(tmp_path / "ck", tiny_target)
    assert (drafter.W, drafter.L) == (5, 4)
    h = torch.randn(2, tiny_target.hidden_size)
    torch.testing.assert_close(drafter.heads.logits(h), heads.logits(h))
    assert generate_ids(tiny_target, drafter, PROMPTS) == generate_ids(tiny_target, MedusaDrafter(heads), PROMPTS)
    for kwargs, match in (({"beam_length": 5}, "at most 4"), ({"beam_width": 0}, "beam width")):
        with pytest.raises(SpecdraftError, match=match):
            MedusaDrafter.load(tmp_path / "ck", tiny_target, **kwargs)
    torch.manual_seed(0)
    ReDrafterHead.for_target(tiny_target).save(tmp_path / "redrafter")
    with pytest.raises(SpecdraftError, match="is a 'redrafter' checkpoint, expected a 'medusa'"):
        MedusaDrafter.load(tmp_path / "redrafter", tiny_target)
    with pytest.raises(SpecdraftError, match="not found"):
        MedusaDrafter.load(tmp_path / "nothing", tiny_target)
