"""ReDrafter: the head, beam search, the drafter in the engine, checkpoints, export.

Tiny random models only (conftest's tiny target: vocabulary 16, hidden size 32).
"""

from __future__ import annotations

import itertools
import json

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft import SamplingParams, SpeculativeEngine
from specdraft.checkpoint import CONFIG, WEIGHTS
from specdraft.drafters import NoDrafter
from specdraft.drafters.redrafter import ReDrafter
from specdraft.errors import SpecdraftError
from specdraft.sampling import target_probs
from specdraft.models import load_target
from specdraft.heads import (MedusaHeads, ReDrafterHead, export_trtllm, future_labels,
                                 redrafter_beam_search)
from conftest import make_tiny_llama

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [3]]


def make_head(target, head="own", seed=0, **kw) -> ReDrafterHead:
    torch.manual_seed(seed)
    return ReDrafterHead.for_target(target, head=head, **kw).eval().requires_grad_(False)


def reference_ids(target, prompt, max_new_tokens):
    """Hugging Face greedy generation of one prompt, up to and including EOS."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False)[0, len(prompt):].tolist()
    for i, tok in enumerate(out):
        if tok in target.eos_ids:
            return out[: i + 1]
    return out


def generate_ids(target, drafter, prompts, **params):
    params = SamplingParams(**{"max_new_tokens": 24, **params})
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)]


# ---- the head ------------------------------------------------------------------------


@pytest.mark.parametrize("variant, reads_h", [("own", False), ("shared", False), ("shared", True)])
def test_teacher_forced_equals_inference_recurrence(tiny_target, variant, reads_h):
    head = make_head(tiny_target, variant, hidden_in_recurrence=reads_h)
    if reads_h:
        with torch.no_grad():
            head.rnn_h.weight.normal_(0, 0.5)  # V·h must matter
    B, T, K, d = 2, 7, 3, tiny_target.hidden_size
    tokens = torch.randint(0, tiny_target.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(B, T, d, generator=torch.Generator().manual_seed(2))
    out = head.teacher_forced_logits(hidden, tokens, K)
    assert out.shape == (B, T, K, tiny_target.vocab_size) and out.dtype == torch.float32
    for b, t in itertools.product(range(B), range(T)):
        state = head.initial_state(())
        for i in range(K):
            if t + 1 + i >= T:
                break
            # fed x_{t+1}, ..., x_{t+1+i}, and (reads_h) V·h_t at every step
            state = head.step(state, tokens[b, t + 1 + i], head.recurrence_bias(hidden[b, t]))
            torch.testing.assert_close(out[b, t, i], head.logits(hidden[b, t], state))
    labels = future_labels(tokens, K)
    assert labels.shape == (B, T, K)
    assert labels[0, 0, 2] == tokens[0, 4] and (labels[:, T - 2:] == -100).all()


def test_shared_head_ends_in_the_target_lm_head(tiny_target):
    head = make_head(tiny_target, "shared")
    h, s = torch.randn(3, 32), torch.randn(3, 32)
    z = torch.cat([h, s], -1)
    for block in head.blocks:
        z = block(z)
    torch.testing.assert_close(head.logits(h, s), tiny_target.logits(head.proj(z)))
    assert not any(k.startswith(("parts", "embed")) for k in head.state_dict())
    assert sum(p.numel() for p in head.parameters()) < 32 * 32 * 20  # no copy of the target's tables


# ---- beam search -----------------------------------------------------------------------


def root_log_probs(head, h, g0):
    s1 = head.step(head.initial_state((g0.shape[0],)), g0)
    return torch.log_softmax(head.logits(h, s1), -1)


def sequence_score(head, h, seq):
    """Sum of log q of seq[1:] computed one token at a time (h (d,), seq list)."""
    state, total = head.initial_state(()), 0.0
    for j in range(1, len(seq)):
        state = head.step(state, torch.tensor(seq[j - 1]))
        total += torch.log_softmax(head.logits(h, state), -1)[seq[j]].item()
    return total


def test_beam_search_shapes_and_invariants(tiny_target):
    head = make_head(tiny_target)
    B, W, L = 3, 6, 4
    h = torch.randn(B, 32, generator=torch.Generator().manual_seed(3))
    g0 = torch.tensor([5, 0, 11])
    res = redrafter_beam_search(head, h, g0, W, L)
    assert res.beams.shape == (B, W, L) and res.valid.shape == (B, W, L)
    assert res.scores.dtype == torch.float32 and res.token_logprobs.shape == (B, W, L - 1)
    assert (res.beams[:, :, 0] == g0[:, None]).all() and res.valid.all()
    assert (res.scores[:, :-1] >= res.scores[:, 1:]).all()  # best first
    torch.testing.assert_close(res.token_logprobs.sum(-1), res.scores)
    for b in range(B):
        beams = [tuple(x) for x in res.beams[b].tolist()]
        assert len(set(beams)) == W  # no duplicate beams
        for w, seq in enumerate(beams):
            assert res.scores[b, w].item() == pytest.approx(sequence_score(head, h[b], seq), abs=1e-4)
        # Row b's beams do not depend on the other rows.
        alone = redrafter_beam_search(head, h[b: b + 1], g0[b: b + 1], W, L)
        assert torch.equal(alone.beams[0], res.beams[b])


def test_only_the_root_expands_at_the_first_step(tiny_target):
    head = make_head(tiny_target)
    h, g0 = torch.randn(2, 32), torch.tensor([3, 7])
    res = redrafter_beam_search(head, h, g0, 5, 2)
    top = root_log_probs(head, h, g0).topk(5, dim=-1)
    assert torch.equal(res.beams[:, :, 1], top.indices)  # W distinct children of [g0]
    torch.testing.assert_close(res.scores, top.values)


def test_wide_search_is_exhaustive_and_never_returns_junk(tiny_target):
    """W above the number of distinct continuations: every sequence once, the rest invalid."""
    head = make_head(tiny_target)
    V = tiny_target.vocab_size
    h, g0 = torch.randn(2, 32, generator=torch.Generator().manual_seed(4)), torch.tensor([1, 2])
    for L, W in ((2, V + 4), (3, V * V + 7)):
        res = redrafter_beam_search(head, h, g0, W, L)
        n = V ** (L - 1)
        full = res.valid.all(dim=-1)
        assert (full.sum(dim=1) == n).all() and full[:, :n].all()
        assert torch.isfinite(res.scores[full]).all() and torch.isinf(res.scores[~full]).all()
        assert not res.valid[:, n:, 1:].any() and res.valid[:, :, 0].all()  # prefix-closed
        for b in range(2):
            drafted = {tuple(x) for x in res.beams[b, :n, 1:].tolist()}
            assert drafted == set(itertools.product(range(V), repeat=L - 1))
    # A narrower search returns a subset of all sequences: rank by rank, no better.
    exhaustive = redrafter_beam_search(head, h, g0, V * V, 3)
    narrow = redrafter_beam_search(head, h, g0, 7, 3)
    assert (narrow.scores <= exhaustive.scores[:, :7] + 1e-5).all()


def test_beam_length_one_is_plain_decoding(tiny_target):
    res = redrafter_beam_search(make_head(tiny_target), torch.randn(2, 32), torch.tensor([4, 5]), 3, 1)
    assert res.beams.shape == (2, 3, 1) and res.valid.all()
    assert torch.isfinite(res.scores[:, 0]).all() and torch.isinf(res.scores[:, 1:]).all()


# ---- the drafter in the engine --------------------------------------------------------


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_greedy_output_is_the_targets(tiny_target, variant):
    drafter = ReDrafter(make_head(tiny_target, variant), beam_width=4, beam_length=5)
    plain = generate_ids(tiny_target, NoDrafter(), PROMPTS)
    assert generate_ids(tiny_target, drafter, PROMPTS) == plain  # batch 3, ragged
    for prompt, expected in zip(PROMPTS, plain):
        assert generate_ids(tiny_target, drafter, [prompt]) == [expected]  # batch 1
        assert reference_ids(tiny_target, prompt, 24) == expected


def test_greedy_exact_with_more_beams_than_continuations(tiny_target):
    V = tiny_target.vocab_size
    drafter = ReDrafter(make_head(tiny_target), beam_width=V + 5, beam_length=2)
    kw = dict(max_new_tokens=16, ignore_eos=True)
    assert generate_ids(tiny_target, drafter, PROMPTS, **kw) == generate_ids(tiny_target, NoDrafter(), PROMPTS, **kw)


def test_sampling_runs_and_is_reproducible(tiny_target):
    drafter = ReDrafter(make_head(tiny_target))
    kw = dict(temperature=1.0, seed=7, max_new_tokens=12)
    first = generate_ids(tiny_target, drafter, PROMPTS, **kw)
    assert first == generate_ids(tiny_target, drafter, PROMPTS, **kw)
    assert all(0 <= t < tiny_target.vocab_size for ids in first for t in ids)
    wide = ReDrafter(make_head(tiny_target), beam_width=tiny_target.vocab_size + 5, beam_length=2, sample_drafts=False)
    assert len(generate_ids(tiny_target, wide, PROMPTS, **kw)) == 3  # invalid slots under sampling


@pytest.mark.parametrize("beam_width", [1, 2])
def test_sampled_chain_draws_from_q_and_keeps_greedy_rows_on_the_argmax(tiny_target, beam_width):
    """Sampling rows, at any W: the proposal is one chain per row carrying q (a distribution
    per depth); a greedy row of the same batch drafts exactly the beam search of one's
    tokens; the same seeds draw the same chain in a new batch (the generators start again
    with each batch); a batch of greedy rows only gets the W beams."""
    from specdraft.drafters.base import DraftContext

    drafter = ReDrafter(make_head(tiny_target), beam_width=beam_width, beam_length=4)
    B, d = 3, tiny_target.model.config.hidden_size
    torch.manual_seed(1)
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(), SamplingParams(temperature=0.7, seed=4)]
    ctx = DraftContext(tokens=[torch.tensor([1, 2, 3])] * B, g0=torch.tensor([3, 3, 3]), hidden=torch.randn(B, d),
                       budget=torch.full((B,), 4), greedy=torch.tensor([False, True, False]),
                       request_ids=[0, 1, 2], params=params)
    drafter.start(ctx)
    first = drafter.propose(ctx)
    assert first.beams.shape == (B, 1, 4) and first.q.shape == (B, 1, 3, tiny_target.vocab_size)
    assert torch.allclose(first.q.sum(-1), torch.ones(B, 1, 3))
    drafted = first.beams[:, :, 1:]
    assert (first.q.gather(3, drafted[..., None]) > 0).all()  # every drawn token has q > 0
    beams = ReDrafter(drafter.head, beam_width=1, beam_length=4).propose(replace(ctx, greedy=torch.ones(B, dtype=torch.bool)))
    assert torch.equal(first.beams[1], beams.beams[1])  # the greedy row: the argmax chain
    drafter.start(ctx)
    assert torch.equal(drafter.propose(ctx).beams, first.beams)
    one = ReDrafter(drafter.head, beam_width=1, beam_length=4)
    one.start(ctx)
    assert torch.equal(one.propose(ctx).beams, first.beams)  # W does not matter to sampled chains
    all_greedy = drafter.propose(replace(ctx, greedy=torch.ones(B, dtype=torch.bool)))
    assert all_greedy.q is None and all_greedy.beams.shape == (B, beam_width, 4)


def test_sampled_chain_has_its_own_length(tiny_target, tmp_path):
    """A checkpoint's sample_length sets the chain drawn for sampling rows (the beams keep
    beam_length), and the reach the adaptive policy plans with follows the mode of the step;
    a beam length given at load time is one shape for both; sample_length 1 is refused."""
    from specdraft.drafters.base import DraftContext

    head = make_head(tiny_target, beam_width=1, beam_length=3)
    head.config.sample_length = 5
    head.save(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / CONFIG).read_text())["sample_length"] == 5
    drafter = ReDrafter.load(tmp_path / "ck", tiny_target)
    assert (drafter.L, drafter.sample_L) == (3, 5)
    B, d = 2, tiny_target.model.config.hidden_size
    ctx = DraftContext(tokens=[torch.tensor([1, 2, 3])] * B, g0=torch.tensor([3, 4]), hidden=torch.randn(B, d),
                       budget=torch.full((B,), 8), greedy=torch.tensor([False, True]), request_ids=[0, 1],
                       params=[SamplingParams(temperature=1.0, seed=3), SamplingParams()])
    drafter.start(ctx)
    sampled = drafter.propose(ctx)
    assert sampled.beams.shape == (B, 1, 5) and sampled.q.shape == (B, 1, 4, tiny_target.vocab_size)
    assert drafter.max_depth(ctx) == 4 and drafter.max_depth() == 4
    greedy = replace(ctx, greedy=torch.ones(B, dtype=torch.bool))
    assert drafter.propose(greedy).beams.shape == (B, 1, 3) and drafter.max_depth(greedy) == 2
    clipped = replace(ctx, budget=torch.tensor([3, 2]))  # no row drafts past its budget
    assert drafter.propose(clipped).beams.shape == (B, 1, 3)
    both = ReDrafter.load(tmp_path / "ck", tiny_target, beam_length=4)
    assert (both.L, both.sample_L) == (4, 4)
    assert ReDrafter(drafter.head, sample_length=2).sample_L == 2
    assert ReDrafter(drafter.head, sample_drafts=False).max_depth() == 2  # never samples: the beams' reach
    config = json.loads((tmp_path / "ck" / CONFIG).read_text())
    for bad in (1, -1, True, "4"):
        (tmp_path / "ck" / CONFIG).write_text(json.dumps({**config, "sample_length": bad}))
        with pytest.raises(SpecdraftError, match="sample_length") as e:
            ReDrafter.load(tmp_path / "ck", tiny_target)
        one_line(e)


def test_h_is_the_state_that_chose_g0(tiny_target):
    """Alignment of h with g0, exactly: a shared head whose output is LM(h) (P = [I 0], no
    blocks) must draft g0 itself as its best first token, since LM(h) chose g0."""
    head = make_head(tiny_target, "shared", num_blocks=0)
    d = tiny_target.hidden_size
    with torch.no_grad():
        head.proj.weight.copy_(torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
    seen = []

    class Recording(ReDrafter):
        def propose(self, ctx):
            proposal = super().propose(ctx)
            if proposal.beams.shape[2] > 1:  # the last step of a request may draft nothing
                seen.append((ctx.g0.clone(), proposal.beams[:, 0, 1].clone()))
            return proposal

    generate_ids(tiny_target, Recording(head, beam_width=2, beam_length=3), PROMPTS, ignore_eos=True)
    assert len(seen) > 5 and all(torch.equal(g0, first) for g0, first in seen)


def greedy_corpus(target, n, prompt_len, new_tokens, seed):
    """(tokens (n, P+G), hidden (n, P+G, d), loss mask (n, P+G)): the target's own greedy
    continuations of random prompts; positions whose next token is generated are kept."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, target.vocab_size, (n, prompt_len), generator=g)
    with torch.no_grad():
        seq = target.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        hidden = target.base(input_ids=seq).last_hidden_state
    keep = torch.arange(seq.shape[1])[None, :].expand_as(seq) >= prompt_len - 1
    return seq, hidden, keep


def train(module, logits_fn, seq, keep, K, steps, lr=1e-2):
    labels = future_labels(seq, K).masked_fill(~keep[:, :, None], -100)
    module.train().requires_grad_(True)
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(logits_fn().flatten(0, 2), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return module.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def cycling_target(tmp_path_factory):
    """A tiny target whose greedy continuations are varied cycles (not one fixed token)."""
    return load_target(str(make_tiny_llama(tmp_path_factory.mktemp("cyc") / "m", vocab_size=64, seed=1)))


def tokens_per_step(target, drafter, prompts):
    results = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    return sum(r.new_tokens for r in results) / sum(r.steps for r in results)


def test_trained_head_gets_multi_token_acceptance(cycling_target):
    """Distilled on the target's own greedy outputs, beam search + tree verification must
    accept several tokens per step: training's (h_t, x_{t+1}) pairs and the engine's
    (h, g0) must agree, and accepted beams must be read back from the right tree nodes."""
    target = cycling_target
    seq, hidden, keep = greedy_corpus(target, 96, 4, 24, seed=1)
    head = make_head(target, beam_length=5)
    train(head, lambda: head.teacher_forced_logits(hidden, seq, 4), seq, keep, K=4, steps=100)
    prompts = torch.randint(1, 64, (6, 5), generator=torch.Generator().manual_seed(9)).tolist()
    tau = tokens_per_step(target, ReDrafter(head, beam_width=4), prompts)
    untrained = tokens_per_step(target, ReDrafter(make_head(target), beam_width=4), prompts)
    assert tau > 1.5 and tau > untrained + 0.4, (tau, untrained)
    assert generate_ids(target, ReDrafter(head), prompts) == generate_ids(target, NoDrafter(), prompts)


# ---- checkpoints -----------------------------------------------------------------------


def test_checkpoint_roundtrip_and_beam_defaults(tiny_target, tmp_path):
    head = make_head(tiny_target, "shared", num_blocks=3, beam_width=3, beam_length=4)
    head.save(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / CONFIG).read_text())
    assert cfg["kind"] == "redrafter" and cfg["target"]["vocab_size"] == tiny_target.vocab_size
    assert set(load_file(str(tmp_path / "ck" / WEIGHTS))) == set(head.state_dict())
    drafter = ReDrafter.load(tmp_path / "ck", tiny_target)
    assert (drafter.W, drafter.L) == (3, 4)
    assert (ReDrafter.load(tmp_path / "ck", tiny_target, beam_width=9, beam_length=2).W,) == (9,)
    h, s = torch.randn(2, 32), torch.randn(2, 32)
    torch.testing.assert_close(drafter.head.logits(h, s), head.logits(h, s))
    assert generate_ids(tiny_target, drafter, PROMPTS) == generate_ids(tiny_target, ReDrafter(head), PROMPTS)
    with pytest.raises(SpecdraftError, match="beam width"):
        ReDrafter.load(tmp_path / "ck", tiny_target, beam_width=0)


@pytest.fixture(scope="module")
def other_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("others")
    return {"vocab": load_target(str(make_tiny_llama(root / "v", vocab_size=24))),
            "hidden": load_target(str(make_tiny_llama(root / "h", hidden_size=48)))}


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_load_errors_are_one_line(tiny_target, other_targets, tmp_path):
    good = make_head(tiny_target).save(tmp_path / "good")

    def fails(path, target=tiny_target, match=None):
        with pytest.raises(SpecdraftError, match=match) as e:
            ReDrafter.load(path, target)
        return one_line(e)

    fails(tmp_path / "missing", match="not found")
    (tmp_path / "file").write_text("x")
    fails(tmp_path / "file", match="not a drafter checkpoint")
    fails(good, other_targets["vocab"], match="vocab_size")
    fails(good, other_targets["hidden"], match="hidden_size")

    def variant(name, config=None, weights=None):
        folder = tmp_path / name
        folder.mkdir()
        raw = json.loads((good / CONFIG).read_text())
        (folder / CONFIG).write_text(config(raw) if callable(config) else json.dumps(raw))
        if weights is not None:
            weights(folder / WEIGHTS)
        return folder

    copy = lambda p: p.write_bytes((good / WEIGHTS).read_bytes())
    fails(variant("noweights"), match="no model.safetensors")
    fails(variant("pickle", weights=lambda p: torch.save({}, p.with_name("pytorch_model.bin"))),
          match="only safetensors")
    fails(variant("corrupt", weights=lambda p: p.write_bytes(b"\x00garbage" * 10)), match="not a valid safetensors")
    fails(variant("badjson", config=lambda raw: "{nope", weights=copy), match="corrupt")
    fails(variant("medusa", config=lambda raw: json.dumps({**raw, "kind": "medusa"}), weights=copy),
          match="expected a 'redrafter'")
    fails(variant("nokind", config=lambda raw: json.dumps({k: v for k, v in raw.items() if k != "kind"}),
                  weights=copy), match="no 'kind'")
    fails(variant("blocks", config=lambda raw: json.dumps({**raw, "num_blocks": 3}), weights=copy),
          match="do not match")
    fails(variant("variant", config=lambda raw: json.dumps({**raw, "head": "shared"}), weights=copy),
          match="do not match")
    fails(variant("badhead", config=lambda raw: json.dumps({**raw, "head": "tied"}), weights=copy), match="head")
    fails(variant("shape", weights=lambda p: save_file(
        {**load_file(str(good / WEIGHTS)), "rnn_u.bias": torch.zeros(5)}, str(p))), match="shape")
    medusa = MedusaHeads.for_target(tiny_target).save(tmp_path / "medusa-real")
    fails(medusa, match="is a 'medusa' checkpoint")


# ---- export ----------------------------------------------------------------------------


def trtllm_logits(tensors, config, h, s):
    """The TensorRT-LLM layout's output computed from its own names: [h; s] → blocks → out."""
    z = torch.cat([h, s], -1)
    N = config["num_draft_layers"]
    for i in range(N):
        A, c = tensors[f"lm_head.{i}.linear.weight"], tensors[f"lm_head.{i}.linear.bias"]
        z = z + torch.nn.functional.silu(z @ A.T + c)
    return z @ tensors[f"lm_head.{N}.weight"].T


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_export_trtllm_layout(tiny_target, tmp_path, variant):
    head = make_head(tiny_target, variant)
    export_trtllm(head.save(tmp_path / "ck"), tmp_path / "trt", target=tiny_target)
    tensors = load_file(str(tmp_path / "trt" / WEIGHTS))
    config = json.loads((tmp_path / "trt" / CONFIG).read_text())
    d, V = tiny_target.hidden_size, tiny_target.vocab_size
    assert config == {"hidden_size": d, "exit_dim": 2 * d, "num_draft_layers": 2, "rnn": True, "vocab_size": V}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "lm_head.0.linear.weight": (2 * d, 2 * d), "lm_head.0.linear.bias": (2 * d,),
        "lm_head.1.linear.weight": (2 * d, 2 * d), "lm_head.1.linear.bias": (2 * d,),
        "lm_head.2.weight": (V, 2 * d), "rnn_u.weight": (d, d), "rnn_u.bias": (d,), "rnn_w.weight": (d, d)}
    h, x = torch.randn(3, d), torch.tensor([1, 5, 9])
    s = torch.nn.functional.silu(tiny_target.model.get_input_embeddings()(x) @ tensors["rnn_w.weight"].T
                                 + tensors["rnn_u.bias"])  # s_1 from s_0 = 0
    torch.testing.assert_close(s, head.step(head.initial_state((3,)), x))
    torch.testing.assert_close(trtllm_logits(tensors, config, h, s), head.logits(h, s), rtol=1e-4, atol=1e-4)


def test_export_refuses_medusa(tiny_target, tmp_path):
    with pytest.raises(SpecdraftError, match="expected a 'redrafter'"):
        export_trtllm(MedusaHeads.for_target(tiny_target).save(tmp_path / "m"), tmp_path / "out")


def test_export_command_line(tiny_target, tiny_target_path, tmp_path, capsys):
    """`specdraft export trtllm` writes the layout; a bad checkpoint is a one-line error."""
    from specdraft.cli import main

    ck = ReDrafterHead.for_target(tiny_target, head="shared").save(tmp_path / "ck")
    assert main(["export", "trtllm", "--drafter", str(ck), "--target", str(tiny_target_path),
                 "--out", str(tmp_path / "trt")]) == 0
    config = json.loads((tmp_path / "trt" / "config.json").read_text())
    assert config["rnn"] is True and config["vocab_size"] == tiny_target.vocab_size
    capsys.readouterr()
    assert main(["export", "trtllm", "--drafter", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip().startswith("specdraft: error:")


def test_shipped_drafter_is_only_for_the_default_target(tiny_target):
    from specdraft.drafters.registry import build_drafter

    with pytest.raises(SpecdraftError, match="no medusa drafter is shipped"):
        build_drafter("medusa:default", tiny_target)
    with pytest.raises(SpecdraftError) as err:  # shipped, but made for SmolLM2, not this target
        build_drafter("redrafter:default", tiny_target)
    assert "\n" not in str(err.value)


def test_fit_shape_widens_a_default_chain_only_where_the_second_beam_is_nearly_free(tiny_target):
    """Under adaptive drafting a checkpoint's one beam becomes two where the cost model says a
    tree of 2L - 1 tokens costs at most WIDE_COST x a chain of L; steeper curves, a width the
    user gave, and a combination's parts each keep what they have."""
    from specdraft.adaptive import AdaptivePolicy
    from specdraft.costmodel import CostModel
    from specdraft.drafters import LookupDrafter
    from specdraft.drafters.combined import CombinedDrafter
    from specdraft.drafters.redrafter import WIDE_COST

    flat = CostModel(tokens=[1, 3, 5, 8], seconds=[1.0, 1.0, 1.05, 1.1])
    steep = CostModel(tokens=[1, 3, 5, 8], seconds=[1.0, 1.0, 1.0 + 1.01 * (WIDE_COST - 1), 2.0])
    head = make_head(tiny_target)
    head.config.beam_width = 1

    def width(cost, **shape):
        drafter = ReDrafter(head, beam_length=3, **shape)
        drafter.fit_shape(cost)
        return drafter.W

    assert width(flat) == 2 and width(steep) == 1

    small = ReDrafter(head, beam_length=3)
    small.fit_shape(flat)
    assert small.W == 2 and (small.width(1), small.width(2), small.width(16)) == (2, 1, 1)  # WIDE_MAX_ROWS
    plain = generate_ids(tiny_target, NoDrafter(), [[1, 2, 3], [4, 5]], max_new_tokens=12)
    assert generate_ids(tiny_target, small, [[1, 2, 3], [4, 5]], max_new_tokens=12) == plain  # 2 rows: one beam
    assert width(flat, beam_width=1) == 1  # the user's width
    assert ReDrafter(head, beam_width=1, beam_length=1).L == 1  # nothing drafted: nothing to widen
    part = ReDrafter(head, beam_length=3)
    SpeculativeEngine(tiny_target, CombinedDrafter([LookupDrafter(1, 3), part]), policy=AdaptivePolicy(flat))
    assert part.W == 2  # the engine fits the shape when a policy is given, through a combination
    fixed = ReDrafter(head, beam_length=3)
    SpeculativeEngine(tiny_target, fixed)
    assert fixed.W == 1  # fixed shapes stay as they are
    NoDrafter().fit_shape(flat)  # the default: nothing


def test_sampled_chains_are_independent_walks(tiny_target, tmp_path):
    """sample_chains C: a sampling row draws C chains, their first tokens distinct (drawn
    without replacement, each reported with its conditional q), each then with the q of
    its own prefix; a greedy row
    keeps only its argmax chain; sample_branch_length cuts the chains after the first (the
    draws before the cut unchanged); the config's values round-trip, bad ones are refused."""
    from specdraft.drafters.base import DraftContext

    head = make_head(tiny_target, beam_width=1, beam_length=4)
    head.config.sample_chains = 3
    head.save(tmp_path / "ck")
    drafter = ReDrafter.load(tmp_path / "ck", tiny_target)
    assert drafter.sample_C == 3
    B, d = 2, tiny_target.model.config.hidden_size
    torch.manual_seed(2)
    ctx = DraftContext(tokens=[torch.tensor([1, 2, 3])] * B, g0=torch.tensor([3, 4]), hidden=torch.randn(B, d),
                       budget=torch.full((B,), 8), greedy=torch.tensor([False, True]), request_ids=[0, 1],
                       params=[SamplingParams(temperature=1.5, seed=3), SamplingParams()])
    drafter.start(ctx)
    many = drafter.propose(ctx)
    V = tiny_target.vocab_size
    assert many.beams.shape == (B, 3, 4) and many.q.shape == (B, 3, 3, V)
    assert many.valid[0].all() and many.valid[1, 0].all() and not many.valid[1, 1:, 1:].any()
    assert torch.allclose(many.q[0].sum(-1), torch.ones(3, 3))
    q, first = many.q[0], many.beams[0, :, 1]
    assert len(set(first.tolist())) == 3  # drawn without replacement
    left = q[0, 0].clone()
    for k in range(1, 3):  # chain k's law: q_1 without the earlier chains' tokens
        left[first[k - 1]] = 0.0
        assert torch.allclose(q[k, 0], left / left.sum()) and q[k, 0, first[:k]].eq(0).all()
    head_ = drafter.head  # each chain's q_2 is the head's q given that chain's own first token
    h = ctx.hidden[:1]
    bias = head_.recurrence_bias(h)
    s1 = head_.step(head_.initial_state((1,)), ctx.g0[:1], bias)
    for k in range(3):
        logits = head_.draft_logits(h, head_.step(s1, first[k:k + 1], bias))
        expect = target_probs(logits, torch.tensor([1.5]), torch.tensor([0]), torch.tensor([1.0]))[0]
        assert torch.allclose(q[k, 1], expect, atol=1e-6)
    one = ReDrafter(head, sample_chains=1)
    one.start(ctx)
    single = one.propose(ctx)
    assert single.beams.shape == (B, 1, 4)
    assert torch.equal(single.beams[1, 0], many.beams[1, 0])  # the greedy row's argmax chain
    head.config.sample_branch_length = 2  # the chains after the first: one drafted token
    short = ReDrafter(head)
    short.start(ctx)
    branched = short.propose(ctx)
    assert branched.valid[0, 0].all() and branched.valid[0, 1:, :2].all() and not branched.valid[0, 1:, 2:].any()
    assert torch.equal(branched.beams[0, :, :2], many.beams[0, :, :2])  # the same first draws
    head.config.sample_chains = 0
    with pytest.raises(SpecdraftError, match="sample_chains"):
        head.config.validate()
    head.config.sample_chains, head.config.sample_branch_length = 2, 1
    with pytest.raises(SpecdraftError, match="sample_branch_length"):
        head.config.validate()
