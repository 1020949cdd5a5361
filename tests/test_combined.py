"""The A+B drafter: the union of its parts' beams, built from a spec, rejected when unsound."""

from __future__ import annotations

import pytest
import torch

from drafters_for_tests import RandomBeamsDrafter, SampledChainDrafter
from specdraft import SamplingParams, SpeculativeEngine
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.drafters.base import DraftContext
from specdraft.drafters.combined import CombinedDrafter
from specdraft.drafters.registry import build_drafter
from specdraft.errors import SpecdraftError
from specdraft.heads import ReDrafterHead


def context(histories: list[list[int]]) -> DraftContext:
    tokens = [torch.tensor(h) for h in histories]
    B = len(tokens)
    return DraftContext(tokens=tokens, g0=torch.tensor([h[-1] for h in histories]), hidden=torch.zeros(B, 4),
                        budget=torch.full((B,), 16), greedy=torch.ones(B, dtype=torch.bool), request_ids=list(range(B)))


def test_union_keeps_every_parts_beams_in_order():
    ctx = context([[1, 2, 3, 1, 2], [4, 5, 6]])
    lookup, beams = LookupDrafter(beam_width=1, beam_length=3), RandomBeamsDrafter(9, beam_width=2, beam_length=5)
    a = lookup.propose(ctx)
    beams.gen.manual_seed(0)
    b = beams.propose(ctx)
    beams.gen.manual_seed(0)
    union = CombinedDrafter([lookup, beams]).propose(ctx)
    assert union.beams.shape == (2, 3, 5) and union.q is None
    assert torch.equal(union.beams[:, :1, :3], a.beams) and torch.equal(union.valid[:, :1, :3], a.valid)
    assert not union.valid[:, :1, 3:].any()  # the shorter part is padded with invalid slots
    assert torch.equal(union.beams[:, 1:], b.beams) and torch.equal(union.valid[:, 1:], b.valid)
    assert union.beams[0, 0, 1:3].tolist() == [3, 1]  # lookup's continuation of "1 2"


def test_combined_greedy_equals_autoregressive_on_a_ragged_batch(tiny_target):
    prompts = [[3, 4, 5, 3, 4], [5, 6, 7, 8, 9, 10, 11], [2, 3]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeEngine(tiny_target, NoDrafter()).generate(prompts, params)]
    drafter = CombinedDrafter([LookupDrafter(beam_width=1, beam_length=4),
                               RandomBeamsDrafter(16, beam_width=2, beam_length=3, seed=2)])
    results = SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(prompts, params)
    assert [r.token_ids for r in results] == want
    assert sum(r.steps for r in results) < sum(len(w) for w in want)  # drafts were accepted


def test_spec_builds_the_union_and_bad_specs_are_user_errors(tiny_target, tmp_path):
    ReDrafterHead.for_target(tiny_target, head="shared", beam_width=2, beam_length=3).save(tmp_path / "head")
    drafter = build_drafter(f"lookup+redrafter:{tmp_path / 'head'}", tiny_target, beam_width=3)
    assert isinstance(drafter, CombinedDrafter) and drafter.name == "lookup+redrafter"
    lookup, head = drafter.parts
    assert (head.W, head.L) == (3, 3)  # shapes go to the trained part; lookup keeps its own
    assert (lookup.W, lookup.L) == LookupDrafter.default_shape()
    for bad in ("lookup+none", "lookup+lookup", "lookup+", "lookup+unknown"):
        with pytest.raises(SpecdraftError):
            build_drafter(bad, tiny_target)


def test_a_sampling_part_cannot_be_combined():
    ctx = context([[1, 2, 3]])
    ctx.greedy[:] = False
    ctx.params = [SamplingParams(temperature=1.0)]
    drafter = CombinedDrafter([LookupDrafter(), SampledChainDrafter(9, beam_length=3)])
    with pytest.raises(SpecdraftError, match="deterministic"):
        drafter.propose(ctx)


def test_auto_is_lookup_with_the_shipped_head_on_the_default_target_only(tiny_target):
    from specdraft.drafters.registry import resolve_auto
    from specdraft.models import DEFAULT_TARGET

    assert isinstance(build_drafter("auto", tiny_target), LookupDrafter)  # no head shipped for it
    assert resolve_auto(tiny_target) == "lookup"
    named_default = type("T", (), {"name": DEFAULT_TARGET})()
    assert resolve_auto(named_default) == "lookup+redrafter:default"


def test_a_sampling_redrafter_part_proposes_alone_when_every_row_samples(tiny_target):
    """A ReDrafter head at W = 1 samples its chain (q). In a combination it does so alone
    when every row samples or a row is seeded; with a greedy row and no seeded one in the
    batch the parts' deterministic beams are united (no q), the head's beam being its beam
    search's."""
    from specdraft.drafters.redrafter import ReDrafter

    torch.manual_seed(0)
    head = ReDrafterHead.for_target(tiny_target, head="own").eval().requires_grad_(False)
    d = tiny_target.model.config.hidden_size
    ctx = context([[1, 2, 3], [4, 5, 4, 5]])
    ctx.greedy[:] = False
    ctx.params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    ctx.hidden = torch.randn(2, d)
    drafter = CombinedDrafter([LookupDrafter(), ReDrafter(head, beam_width=1, beam_length=3)])
    alone = drafter.propose(ctx)
    assert alone.q is not None and alone.beams.shape[1] == 1
    ctx.greedy[1] = True
    ctx.params[1] = SamplingParams()
    assert drafter.propose(ctx).q is not None  # row 0 is seeded: its draft may not depend on row 1
    ctx.params[0] = SamplingParams(temperature=1.0)
    union = drafter.propose(ctx)
    beams = ReDrafter(head, beam_width=1, beam_length=3).propose_deterministic(ctx)
    assert union.q is None and union.beams.shape[1] > 1
    assert torch.equal(union.beams[:, -1:, :3], beams.beams)  # the head's part: its beam search
