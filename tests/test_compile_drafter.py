"""``--compile-drafter`` for a ReDrafter head (``ReDrafter.compile``): the beam search traced
whole, without graph breaks, the same beams as eager, and the engine's guarantees kept.

Tiny random models only (conftest's tiny target: vocabulary 16, hidden size 32). The ``eager``
backend runs dynamo's capture, guards and recompiles with eager numerics, so beams and seeded
texts compare bitwise; one test runs inductor itself (frozen weights) in float32.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeEngine
from specdraft.build import warm_up
from specdraft.drafters import NoDrafter
from specdraft.drafters.base import DraftContext
from specdraft.drafters.combined import CombinedDrafter
from specdraft.drafters.lookup import LookupDrafter
from specdraft.drafters.redrafter import ReDrafter
from specdraft.heads import ReDrafterHead
from specdraft.vocab import DraftVocab

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9] * 3]
VOCAB = [0, 2, 3, 5, 7, 9, 11, 12]


def make_drafter(target, head="shared", vocab=VOCAB, feature_layers=None, seed=0) -> ReDrafter:
    torch.manual_seed(seed)
    draft_vocab = None
    if vocab is not None:
        draft_vocab = DraftVocab(len(vocab), int(target.vocab_size))
        draft_vocab.set_ids(torch.tensor(vocab))
    made = ReDrafterHead.for_target(target, head=head, draft_vocab=draft_vocab, feature_layers=feature_layers)
    if made.fuse is not None:
        with torch.no_grad():
            made.fuse.weight.normal_(0, 0.3)  # not the identity: the features matter
    return ReDrafter(made.eval().requires_grad_(False), beam_width=2, beam_length=3)


def contexts(target, drafter) -> list[DraftContext]:
    """The contexts the engine hands ``drafter`` while decoding PROMPTS greedily, batch 1 and 2."""
    seen, propose = [], drafter.propose

    def recording(ctx):
        seen.append(ctx)
        return propose(ctx)

    drafter.propose = recording
    engine = SpeculativeEngine(target, drafter, max_tree_tokens=None)
    for rows in (PROMPTS[:1], PROMPTS):
        engine.generate(rows, SamplingParams(max_new_tokens=10, ignore_eos=True))
    del drafter.propose
    return seen


@pytest.mark.parametrize("head, vocab, layers", [("shared", VOCAB, [0]), ("own", None, None)])
def test_compiled_beam_search_has_no_graph_break_and_gives_eager_beams(tiny_target, head, vocab, layers):
    """The search (fusion, recurrence, blocks, output layer, top-k per depth) is one graph:
    nothing in it falls back to Python between kernels (a draft vocabulary's cached rows
    compare data pointers, so a compiled head reads a module copy of them instead). Its beams
    and confidences are the eager drafter's, context by context."""
    from torch._dynamo.utils import counters

    eager = make_drafter(tiny_target, head, vocab, layers)
    compiled = make_drafter(tiny_target, head, vocab, layers)
    assert compiled.compile(backend="eager") and compiled.compiled
    counters.clear()
    for ctx in contexts(tiny_target, eager):
        ours, ref = compiled.propose_deterministic(ctx), eager.propose_deterministic(ctx)
        assert torch.equal(ours.beams, ref.beams) and torch.equal(ours.valid, ref.valid)
        torch.testing.assert_close(ours.confidence, ref.confidence)  # stock vs packed linears: last bits
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2  # batch 1 and batch 2 each got a graph


def test_compiled_head_decodes_as_plain_and_warm_up_covers_its_shapes(tiny_target):
    """After ``warm_up`` (generations at batch 1 and 2, then ``warmed``: every L) nothing
    compiles again while decoding such batches, greedy output is plain decoding's, and a
    seeded sampled text is the uncompiled drafter's (sampled chains stay eager)."""
    drafter = make_drafter(tiny_target, feature_layers=[0])
    drafter.compile(backend="eager")
    engine = SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None)
    warm_up(engine)
    assert drafter.compiled_head.stance == "eager_on_recompile"  # what serving runs under
    drafter.compiled_head.stance = "fail_on_recompile"  # here: prove that warm-up left nothing to compile
    reference = SpeculativeEngine(tiny_target, make_drafter(tiny_target, feature_layers=[0]), max_tree_tokens=None)
    plain = SpeculativeEngine(tiny_target, NoDrafter())
    for rows in (PROMPTS[:1], PROMPTS):
        greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
        ours = engine.generate(rows, greedy)
        assert [r.token_ids for r in ours] == [r.token_ids for r in plain.generate(rows, greedy)]
        assert max(max(r.accepted_hist) for r in ours) > 1  # drafts were accepted
        sampled = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=3)
        assert ([r.token_ids for r in engine.generate(rows, sampled)]
                == [r.token_ids for r in reference.generate(rows, sampled)])


def test_inductor_compiles_the_head_frozen_and_its_beams_match_eager(tiny_target, monkeypatch):
    """With inductor on CPU the head's graphs compile frozen with GEMM autotuning (inductor's
    config says so while it compiles), and in float32 the beams are eager's on every context
    (the tiny head's scores are far from ties)."""
    import torch._inductor.compile_fx as compile_fx_module
    import torch._inductor.config as inductor_config

    seen, real = [], compile_fx_module.compile_fx

    def recording(gm, example_inputs, *args, **kwargs):
        seen.append((inductor_config.freezing, inductor_config.max_autotune))
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    eager, compiled = make_drafter(tiny_target), make_drafter(tiny_target)
    assert compiled.compile()
    ctxs = contexts(tiny_target, eager)
    for ctx in ctxs[:4] + ctxs[-2:]:  # batch 1 and batch 2
        assert torch.equal(compiled.propose_deterministic(ctx).beams, eager.propose_deterministic(ctx).beams)
    assert seen and all(flags == (True, True) for flags in seen)
    assert not inductor_config.freezing  # only around the head's calls, not process-wide


def test_what_is_not_compiled(tiny_target):
    """An int8 head (fbgemm's quantised ops do not trace) stays eager; a combination
    compiles the parts that can be."""
    int8_head = make_drafter(tiny_target, "own", None)
    assert int8_head.quantize() and not int8_head.compile(backend="eager")
    combined = CombinedDrafter([LookupDrafter(), make_drafter(tiny_target)])
    assert combined.compile(backend="eager") and combined.compiled
