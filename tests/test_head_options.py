"""ReDrafter beyond the paper: context attention (``heads.context``, ``--context C``),
fused feature layers (``--feature-layers``) and h in the recurrence
(``--hidden-in-recurrence``). The engine's window of recent target states and its
feature-layer states, exactness, and that a fresh head of each kind is the paper's."""

from __future__ import annotations

import pytest
import torch

from specdraft import SamplingParams, SpeculativeEngine
from specdraft.drafters import NoDrafter
from specdraft.drafters.redrafter import ReDrafter
from specdraft.drafters.base import single_beam
from specdraft.heads import ReDrafterHead
from specdraft.heads.beam_search import redrafter_beam_search
from specdraft.recent import RecentStates

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [3]]
C = 4


def context_head(target, seed=0, **kw) -> ReDrafterHead:
    """A head whose context attention is not the identity (W_o, the bias: random)."""
    torch.manual_seed(seed)
    head = ReDrafterHead.for_target(target, context=C, **kw)
    with torch.no_grad():
        head.context.out.weight.normal_(0, 0.5)
        head.context.bias.normal_(0, 1.0)
    return head.eval().requires_grad_(False)


def run(target, drafter, prompts, **params):
    params = SamplingParams(**{"max_new_tokens": 20, "ignore_eos": True, **params})
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)]


def test_recent_states_keep_each_rows_latest():
    d = 2
    tail = torch.arange(2 * 2 * d, dtype=torch.float32).view(2, 2, d)
    recent = RecentStates.start(tail, torch.tensor([2, 1]), window=3)
    assert recent.lengths.tolist() == [2, 1]
    assert torch.equal(recent.states[0, 1:], tail[0]) and torch.equal(recent.states[1, 2], tail[1, 1])
    new = torch.full((2, 3, d), 9.0)
    new[0, 0], new[1, :2] = 7.0, torch.tensor([[5.0, 5.0], [6.0, 6.0]])
    recent.push(new, torch.tensor([1, 2]))  # row 0 gains one state, row 1 two
    assert recent.lengths.tolist() == [3, 3]
    assert recent.states[0].tolist() == [tail[0, 0].tolist(), tail[0, 1].tolist(), [7.0, 7.0]]
    assert recent.states[1].tolist() == [tail[1, 1].tolist(), [5.0, 5.0], [6.0, 6.0]]
    recent.select(torch.tensor([1]))
    assert recent.lengths.tolist() == [3] and recent.states.shape == (1, 3, d)


def test_a_fresh_context_head_is_the_papers_head(tiny_target):
    """W_o starts at zero: a_t = h_t, so drafts equal the paper head's with the same weights."""
    torch.manual_seed(0)
    fresh = ReDrafterHead.for_target(tiny_target, context=C).eval()
    paper = ReDrafterHead.for_target(tiny_target).eval()
    paper.load_state_dict({k: v for k, v in fresh.state_dict().items() if not k.startswith("context.")})
    seen = {}

    class Recording(ReDrafter):
        def propose(self, ctx):
            proposal = super().propose(ctx)
            seen.setdefault(self.head is fresh, []).append(proposal.beams.clone())
            return proposal

    kw = dict(beam_width=2, beam_length=3)
    assert run(tiny_target, Recording(fresh, **kw), PROMPTS) == run(tiny_target, Recording(paper, **kw), PROMPTS)
    assert all(torch.equal(a, b) for a, b in zip(seen[True], seen[False])) and len(seen[True]) > 3


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_greedy_output_is_the_targets_with_context(tiny_target, variant):
    drafter = ReDrafter(context_head(tiny_target, head=variant), beam_width=3, beam_length=4)
    plain = run(tiny_target, NoDrafter(), PROMPTS)
    assert run(tiny_target, drafter, PROMPTS) == plain  # batch 3, ragged, a one-token prompt
    assert [run(tiny_target, drafter, [p])[0] for p in PROMPTS] == plain


def test_sampling_with_context_is_reproducible(tiny_target):
    drafter = ReDrafter(context_head(tiny_target))
    kw = dict(temperature=1.0, seed=3, max_new_tokens=12)
    assert run(tiny_target, drafter, PROMPTS, **kw) == run(tiny_target, drafter, PROMPTS, **kw)


def test_the_engines_window_is_the_teacher_forced_one(tiny_target):
    """At every step, the state the head starts from (a_t) equals a_t computed from one
    target pass over the final text, with the window the training corpus uses: the target
    states from the prompt's second-to-last token on, the last C of them. Every other step
    runs plain (no drafted token), so both ways of pushing states are checked."""
    head = context_head(tiny_target)
    seen = []

    class Recording(ReDrafter):
        def propose(self, ctx):
            roots = self.root_states(ctx)
            seen.extend((i, len(t), roots[b]) for b, (i, t) in enumerate(zip(ctx.request_ids, ctx.tokens)))
            if len(seen) % 2:
                return single_beam(ctx.g0)
            return super().propose(ctx)

    out = run(tiny_target, Recording(head, beam_width=2, beam_length=3), PROMPTS)
    checked = 0
    for i, (prompt, generated) in enumerate(zip(PROMPTS, out)):
        ids = prompt + generated
        with torch.no_grad():
            hidden = tiny_target.base(input_ids=torch.tensor([ids])).last_hidden_state[0]
        first = max(0, len(prompt) - 2)
        for n, root in [(n, r) for j, n, r in seen if j == i]:
            t = n - 2  # the state whose logits chose g0 = ids[n - 1]
            lo = max(first, t - C + 1)
            states = torch.zeros(1, C, hidden.shape[-1])
            after = torch.zeros(1, C, dtype=torch.long)
            states[0, C - (t + 1 - lo):] = hidden[lo: t + 1]
            after[0, C - (t + 1 - lo):] = torch.tensor(ids[lo + 1: t + 2])
            with torch.no_grad():
                want = head.contextualize_recent(hidden[t][None], states, after, torch.tensor([t + 1 - lo]))[0]
            assert torch.allclose(root, want, atol=1e-5), (prompt, n)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("option, reason", [({"context": C}, "context attention"),
                                            ({"feature_layers": [0]}, "fused feature layers"),
                                            ({"hidden_in_recurrence": True}, "h in its recurrence")])
def test_export_refuses_a_head_beyond_the_paper_with_the_reason(tiny_target, tmp_path, option, reason):
    from specdraft.errors import SpecdraftError
    from specdraft.heads import export_trtllm

    ReDrafterHead.for_target(tiny_target, **option).save(tmp_path / "h")
    with pytest.raises(SpecdraftError, match=reason):  # the layout would silently drop those weights
        export_trtllm(tmp_path / "h", tmp_path / "out")


def test_a_context_head_round_trips(tiny_target, tmp_path):
    head = context_head(tiny_target)
    head.save(tmp_path / "h")
    loaded = ReDrafterHead.load(tmp_path / "h", tiny_target)
    assert loaded.config.context == C and loaded.config.context_heads == head.config.context_heads
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in head.state_dict().items())
    drafter = ReDrafter(loaded)
    assert drafter.context_window == C
    assert run(tiny_target, drafter, PROMPTS) == run(tiny_target, NoDrafter(), PROMPTS)


# ---- fused feature layers ----------------------------------------------------------------------

LAYERS = [0, 1]


def with_random(target, module: str, std: float, seed=0, **kw) -> ReDrafterHead:
    """A head built with options ``kw`` whose ``module`` (an option's part, which starts as
    the identity or zero) has random weights, so that the option matters."""
    torch.manual_seed(seed)
    head = ReDrafterHead.for_target(target, **kw)
    with torch.no_grad():
        getattr(head, module).weight.normal_(0, std)
    return head.eval().requires_grad_(False)


def papers_twin(head: ReDrafterHead, target, module: str) -> ReDrafterHead:
    """The paper's head with ``head``'s weights, without ``module``."""
    paper = ReDrafterHead.for_target(target).eval()
    paper.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith(module + ".")})
    return paper


def fused_head(target, seed=0, **kw) -> ReDrafterHead:
    """A head whose fusion is not the identity (F random)."""
    return with_random(target, "fuse", 0.3, seed, feature_layers=LAYERS, **kw)


@pytest.mark.parametrize("option, module", [({"feature_layers": LAYERS}, "fuse"),
                                            ({"hidden_in_recurrence": True}, "rnn_h")], ids=["fused", "reads-h"])
def test_a_fresh_head_beyond_the_paper_is_the_papers_head(tiny_target, option, module):
    torch.manual_seed(0)
    fresh = ReDrafterHead.for_target(tiny_target, **option).eval()
    paper = papers_twin(fresh, tiny_target, module)
    h = torch.randn(3, tiny_target.hidden_size)
    features = torch.randn(3, len(LAYERS), tiny_target.hidden_size) * 5
    assert torch.equal(fresh.fuse_features(h, features), h)  # the fusion starts as the identity
    assert not torch.as_tensor(fresh.recurrence_bias(h)).any()  # and V·h at zero
    g0 = torch.tensor([3, 5, 7])
    with torch.no_grad():  # so both draft the same beams with the same scores (the output is the target's anyway)
        ours, theirs = (redrafter_beam_search(x, x.fuse_features(h, features), g0, 2, 3) for x in (fresh, paper))
    assert torch.equal(ours.beams, theirs.beams) and torch.equal(ours.scores, theirs.scores)


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_greedy_output_is_the_targets_with_feature_layers(tiny_target, variant):
    drafter = ReDrafter(fused_head(tiny_target, head=variant, context=C), beam_width=3, beam_length=4)
    assert drafter.feature_layers == tuple(LAYERS)
    plain = run(tiny_target, NoDrafter(), PROMPTS)
    assert run(tiny_target, drafter, PROMPTS) == plain
    assert [run(tiny_target, drafter, [p])[0] for p in PROMPTS] == plain


def test_the_engines_feature_states_are_the_targets(tiny_target):
    """At every step, ctx.features is the target's states after the feature layers at the
    token before g0, as one full pass over the final text computes them (verify steps and
    plain steps alike)."""
    seen = []

    class Recording(ReDrafter):
        def propose(self, ctx):
            seen.extend((i, len(t), ctx.features[b].clone()) for b, (i, t) in enumerate(zip(ctx.request_ids, ctx.tokens)))
            if len(seen) % 2:
                return single_beam(ctx.g0)
            return super().propose(ctx)

    out = run(tiny_target, Recording(fused_head(tiny_target), beam_width=2, beam_length=3), PROMPTS)
    checked = 0
    for i, (prompt, generated) in enumerate(zip(PROMPTS, out)):
        with torch.no_grad():
            states = tiny_target.states(tuple(LAYERS), input_ids=torch.tensor([prompt + generated]))[1]
        for n, features in [(n, f) for j, n, f in seen if j == i]:
            want = states[0, n - 2]
            assert torch.allclose(features, want, atol=1e-5), (prompt, n)
            checked += 1
    assert checked > 20


def test_a_head_reading_missing_layers_is_refused(tiny_target, tmp_path):
    from specdraft.errors import SpecdraftError

    ReDrafterHead.for_target(tiny_target, feature_layers=[tiny_target.num_layers]).save(tmp_path / "h")
    with pytest.raises(SpecdraftError, match="layers"):
        ReDrafterHead.load(tmp_path / "h", tiny_target)


# ---- h in the recurrence -----------------------------------------------------------------------


def reading_head(target, seed=0, **kw) -> ReDrafterHead:
    """A head whose recurrence reads h (V random)."""
    return with_random(target, "rnn_h", 0.5, seed, hidden_in_recurrence=True, **kw)


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_greedy_output_is_the_targets_when_the_recurrence_reads_h(tiny_target, variant):
    drafter = ReDrafter(reading_head(tiny_target, head=variant, feature_layers=LAYERS), beam_width=3, beam_length=4)
    plain = run(tiny_target, NoDrafter(), PROMPTS)
    assert run(tiny_target, drafter, PROMPTS) == plain
    assert [run(tiny_target, drafter, [p])[0] for p in PROMPTS] == plain


def test_a_reading_head_round_trips_and_drafts_differently(tiny_target, tmp_path):
    head = reading_head(tiny_target)
    head.save(tmp_path / "h")
    loaded = ReDrafterHead.load(tmp_path / "h", tiny_target)
    assert loaded.config.hidden_in_recurrence
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in head.state_dict().items())
    paper = papers_twin(head, tiny_target, "rnn_h")
    h, g0 = torch.randn(2, tiny_target.hidden_size), torch.tensor([3, 5])
    with torch.no_grad():  # V·h changes the drafts' scores: the recurrence does read it
        ours, theirs = (redrafter_beam_search(x, h, g0, 2, 3).scores for x in (loaded, paper))
    assert not torch.allclose(ours, theirs)

