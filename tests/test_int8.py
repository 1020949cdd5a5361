"""The drafter's linears in int8 (``specdraft.int8``, ``--int8-drafter``): close to float32,
and exact in the engine whatever they propose.

Tiny random models only (conftest's tiny target: vocabulary 16, hidden size 32).
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeEngine, int8
from specdraft.drafters import NoDrafter
from specdraft.drafters.combined import CombinedDrafter
from specdraft.drafters.lookup import LookupDrafter
from specdraft.drafters.redrafter import ReDrafter
from specdraft.heads import ReDrafterHead
from specdraft.vocab import DraftVocab


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [3]]


def make_head(target, head="own", draft_vocab=None, seed=0) -> ReDrafterHead:
    torch.manual_seed(seed)
    vocab = None
    if draft_vocab is not None:
        vocab = DraftVocab(len(draft_vocab), int(target.vocab_size))
        vocab.set_ids(torch.tensor(draft_vocab))
    return ReDrafterHead.for_target(target, head=head, draft_vocab=vocab).eval().requires_grad_(False)


def generate_ids(target, drafter, prompts, **params):
    params = SamplingParams(**{"max_new_tokens": 24, **params})
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)]


def test_the_pinned_torch_has_the_kernel():
    assert int8.available()  # x86 builds of torch ship fbgemm; without it --int8-drafter does nothing


def test_int8_linear_is_close_to_float32_in_any_leading_shape():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200)
    q = int8.Int8Linear(lin)
    x = torch.randn(3, 2, 96)
    ref, got = lin(x), q(x)
    assert got.shape == ref.shape == (3, 2, 200) and got.dtype == torch.float32
    assert not torch.equal(got, ref)  # it really is another computation
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


def test_quantize_linears_replaces_only_linears_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert int8.quantize_linears(model, ["0", "1", "2"]) == 2
    assert isinstance(model[0], int8.Int8Linear) and isinstance(model[2], int8.Int8Linear)
    assert int8.quantize_linears(model, ["0", "2"]) == 0


@pytest.mark.parametrize("variant, vocab", [("own", None), ("own", [0, 2, 3, 5, 7, 9]),
                                            ("shared", [0, 2, 3, 5, 7, 9])])
def test_int8_head_logits_close_and_greedy_output_is_the_targets(tiny_target, variant, vocab):
    head = make_head(tiny_target, variant, vocab)
    h, state = torch.randn(4, 1, tiny_target.hidden_size), torch.randn(4, 2, tiny_target.hidden_size)
    ref = head.draft_logits(h, state)
    drafter = ReDrafter(head, beam_width=2, beam_length=4)
    assert drafter.quantize() and drafter.int8 and not drafter.quantize()  # once
    got = head.draft_logits(h, state)
    assert not torch.equal(got, ref) and ((got - ref).norm() / ref.norm()).item() < 0.05
    plain = generate_ids(tiny_target, NoDrafter(), PROMPTS)
    assert generate_ids(tiny_target, drafter, PROMPTS) == plain  # batch 3, ragged
    assert [generate_ids(tiny_target, drafter, [p])[0] for p in PROMPTS] == plain  # batch 1


def test_what_is_not_quantised(tiny_target):
    """A shared head without a draft vocabulary ends in the target's own LM head: left as is.
    A combination quantises its parts that can be."""
    assert not ReDrafter(make_head(tiny_target, "shared")).quantize()
    combined = CombinedDrafter([LookupDrafter(), ReDrafter(make_head(tiny_target))])
    assert combined.quantize() and combined.int8
    assert not NoDrafter().quantize()
    assert not LookupDrafter().quantize()
    kw = dict(max_new_tokens=16, ignore_eos=True)
    assert generate_ids(tiny_target, combined, PROMPTS, **kw) == generate_ids(tiny_target, NoDrafter(), PROMPTS, **kw)

