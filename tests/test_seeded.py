"""A seeded sampling request's text depends on its prompt, its settings and its seed, never
on the batch it was decoded in (CI once saw the server give the same seed two texts).

Deterministic drafts (lookup, beam search, any fixed candidates) are verified with one draw
from p per depth, so a row consumes exactly one draw per token it gains, as plain decoding
does: its text is plain seeded decoding's, token for token (float32, the tiny target).
Sampled drafts (a head's or a draft model's chain) consume their own per-request streams;
their text cannot equal plain decoding's, but it must not change with the batch around it.
"""

from __future__ import annotations

import pytest
import torch

from drafters_for_tests import RandomBeamsDrafter
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.drafters.combined import CombinedDrafter
from specdraft.drafters.redrafter import ReDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.heads import ReDrafterHead
from specdraft.sampling import SamplingParams

from conftest import make_tiny_llama

PROMPTS = [[1, 2, 3, 4, 5, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8], [3, 3, 4, 3, 3, 4, 3], [11, 5, 11, 5, 11]]
SEEDED = [SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.95, seed=21, ignore_eos=True),
          SamplingParams(max_new_tokens=33, temperature=0.7, top_k=6, seed=22, ignore_eos=True),
          SamplingParams(max_new_tokens=37, temperature=1.3, seed=23, ignore_eos=True)]
# Neighbours that change the batch: greedy, unseeded sampling, a short limit.
OTHERS = [SamplingParams(max_new_tokens=29, ignore_eos=True),
          SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True)]


def texts(target, drafter, prompts, params) -> list[list[int]]:
    with torch.no_grad():
        return [r.token_ids for r in SpeculativeEngine(target, drafter).generate(prompts, params)]


def batches():
    """(prompts, params, index of each seeded request in the batch): alone, together, and
    together with neighbours in between."""
    yield from (([PROMPTS[i]], [SEEDED[i]], [0]) for i in range(3))
    yield PROMPTS[:3], SEEDED, [0, 1, 2]
    yield ([PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2]],
           [OTHERS[0], SEEDED[0], SEEDED[1], OTHERS[1], SEEDED[2]], [1, 2, 4])


@pytest.mark.parametrize("which", ["lookup", "random-beams"])
def test_deterministic_drafts_give_plain_seeded_text(tiny_target, which):
    plain = texts(tiny_target, NoDrafter(), PROMPTS[:3], SEEDED)
    gained_more = False
    for prompts, params, where in batches():
        drafter = LookupDrafter(3, 5) if which == "lookup" else RandomBeamsDrafter(tiny_target.vocab_size, 3, 5, seed=4)
        with torch.no_grad():
            results = SpeculativeEngine(tiny_target, drafter).generate(prompts, params)
        seeded = [results[i] for i in where]
        wanted = [plain[SEEDED.index(params[i])] for i in where]
        assert [r.token_ids for r in seeded] == wanted
        gained_more |= any(r.steps < r.new_tokens for r in seeded)
    assert gained_more, "no draft was ever accepted: the test shows nothing"


@pytest.fixture(scope="module")
def chain_drafters(tiny_target, tmp_path_factory):
    """Makers of drafters that sample their drafts: a ReDrafter head at W = 1 (one chain or
    two drawn independently), a draft model,
    a combination holding the head."""
    from specdraft.drafters.draft_model import DraftModelDrafter
    from specdraft.models import load_target

    torch.manual_seed(3)
    head = ReDrafterHead.for_target(tiny_target, head="own").eval().requires_grad_(False)
    draft_path = make_tiny_llama(tmp_path_factory.mktemp("seeded") / "draft", vocab_size=16, seed=5)
    draft = load_target(str(draft_path), dtype="float32").model
    return {"redrafter": lambda: ReDrafter(head, beam_width=1, beam_length=4),
            "redrafter-2-chains": lambda: ReDrafter(head, beam_width=1, beam_length=4, sample_chains=2),
            "draft-model": lambda: DraftModelDrafter(draft, gamma=3),
            # beside a greedy row a combination would otherwise verify the parts' union
            "lookup+redrafter": lambda: CombinedDrafter([LookupDrafter(2, 4), ReDrafter(head, beam_width=1, beam_length=4)])}


@pytest.mark.parametrize("which", ["redrafter", "redrafter-2-chains", "draft-model", "lookup+redrafter"])
def test_sampled_drafts_give_the_same_text_in_any_batch(tiny_target, chain_drafters, which):
    alone = {}
    for prompts, params, where in batches():
        out = texts(tiny_target, chain_drafters[which](), prompts, params)
        for i in where:
            key = SEEDED.index(params[i])
            alone.setdefault(key, out[i])  # the first batches are the requests alone
            assert out[i] == alone[key], f"seeded request {key} changed with its batch"


def test_deterministic_drafts_are_adapted_yet_keep_the_text(tiny_target):
    """Under the adaptive policy a seeded row with deterministic drafts is adapted like any
    other (here drafting mostly turns off: every token costs a full forward) and its text
    is still plain seeded decoding's."""
    from specdraft.adaptive import AdaptivePolicy
    from specdraft.costmodel import CostModel

    steep = CostModel([1, 2, 64], [1.0, 2.0, 64.0])
    plain = texts(tiny_target, NoDrafter(), PROMPTS[:3], SEEDED)
    with torch.no_grad():
        res = SpeculativeEngine(tiny_target, LookupDrafter(3, 5), policy=AdaptivePolicy(steep)).generate(
            PROMPTS[:3], SEEDED)
    assert [r.token_ids for r in res] == plain
    assert sum(r.off_steps for r in res) > 0, "the policy never adapted a seeded row"
