"""``specdraft fit`` and the pieces it adds: draft vocabularies, the position corpus, the
corpus trainer and its held-out walk. Tiny random target, synthetic chat data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specdraft import SamplingParams, SpeculativeEngine, cli
from specdraft.data import iter_conversations
from specdraft.data.sharegpt import split_of
from specdraft.drafters import NoDrafter
from specdraft.drafters.registry import build_drafter
from specdraft.heads import ReDrafterHead
from specdraft.train.corpus import Corpus, corpus_manifest, extract, to_output_space
from specdraft.train.examples import load_examples
from specdraft.vocab import DraftVocab

from test_train_redrafter import PROMPTS, cyclic_sharegpt


# ---- draft vocabularies ----------------------------------------------------------------------


def test_draft_vocab_worked_example():
    vocab = DraftVocab.from_counts(torch.tensor([5, 0, 9, 1, 7, 0]), 3)
    assert vocab.ids().tolist() == [0, 2, 4]
    assert vocab.d2t.tolist() == [0, 1, 2] and vocab.t2d.tolist() == [True, False, True, False, True, False]
    assert vocab.to_draft(torch.tensor([4, 1, -100, 0])).tolist() == [2, -1, -1, 0]
    assert vocab.to_target(torch.tensor([2, 0])).tolist() == [4, 0]
    full = vocab.scatter(torch.tensor([[1.0, 2.0, 3.0]]))
    assert full[0, [0, 2, 4]].tolist() == [1.0, 2.0, 3.0] and torch.isinf(full[0, [1, 3, 5]]).all()
    assert vocab.coverage(torch.tensor([5, 0, 9, 1, 7, 0])) == pytest.approx(21 / 22)
    # Ties go to the lower id; the kept ids are increasing.
    assert DraftVocab.from_counts(torch.tensor([1, 3, 3, 3]), 2).ids().tolist() == [1, 2]


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_draft_vocab_head_round_trips_and_stays_exact(tiny_target, tmp_path, variant):
    """Saved and loaded, the vocabulary's buffers come back; the head's inference logits
    are -inf outside it; greedy decoding with it is the target's own."""
    torch.manual_seed(1)
    vocab = DraftVocab(8, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5, 7, 8, 11, 13]))
    head = ReDrafterHead.for_target(tiny_target, head=variant, draft_vocab=vocab)
    head.save(tmp_path / "h")
    saved = load_file(tmp_path / "h" / "model.safetensors")
    assert saved["draft_vocab.d2t"].dtype == torch.long and saved["draft_vocab.t2d"].dtype == torch.bool
    loaded = ReDrafterHead.load(tmp_path / "h", tiny_target)
    assert torch.equal(loaded.draft_vocab.ids(), vocab.ids())
    h, s = torch.randn(3, 32), torch.randn(3, 32)
    logits = loaded.logits(h, s)
    assert logits.shape == (3, tiny_target.vocab_size)
    outside = ~vocab.t2d
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, vocab.t2d]).all()
    assert torch.allclose(logits[:, vocab.t2d], loaded.draft_logits(h, s), atol=1e-5)
    params = SamplingParams(max_new_tokens=16)
    ref = [r.token_ids for r in SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS, params)]
    drafter = build_drafter(f"redrafter:{tmp_path / 'h'}", tiny_target, beam_width=2, beam_length=3)
    got = [r.token_ids for r in SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]
    assert got == ref


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_beam_search_over_a_draft_vocab_finds_the_full_vocabulary_beams(tiny_target, variant):
    """The search runs over the N draft ids; its beams and scores are those of a search
    over the full-vocabulary logits (-inf outside the vocabulary), in target ids."""
    from specdraft.heads.beam_search import _gather_beams, beam_search, redrafter_beam_search

    torch.manual_seed(2)
    vocab = DraftVocab(8, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5, 7, 8, 11, 13]))
    head = ReDrafterHead.for_target(tiny_target, head=variant, draft_vocab=vocab)
    h, g0 = torch.randn(3, 32), torch.tensor([1, 4, 9])
    s1 = head.step(head.initial_state((3, 1)), g0[:, None])
    for W, L in ((1, 4), (3, 3), (8, 2)):
        got = redrafter_beam_search(head, h, g0, W, L)
        ref = beam_search(g0, s1, lambda s, d: torch.log_softmax(head.logits(h[:, None], s), dim=-1),
                          lambda s, parent, token: head.step(_gather_beams(s, parent), token), W, L)
        assert torch.equal(got.beams, ref.beams) and torch.equal(got.valid, ref.valid)
        assert torch.allclose(got.scores, ref.scores, atol=1e-5)
        assert vocab.t2d[got.beams[:, :, 1:][got.valid[:, :, 1:]]].all()  # drafted tokens are in the vocabulary


def test_inconsistent_vocab_buffers_are_refused(tiny_target, tmp_path):
    from safetensors.torch import save_file

    from specdraft.errors import SpecdraftError

    vocab = DraftVocab(4, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5]))
    ReDrafterHead.for_target(tiny_target, draft_vocab=vocab).save(tmp_path / "h")
    state = load_file(tmp_path / "h" / "model.safetensors")
    state["draft_vocab.t2d"][1] = True  # 5 ids marked, 4 listed
    save_file(state, tmp_path / "h" / "model.safetensors")
    with pytest.raises(SpecdraftError, match="inconsistent"):
        ReDrafterHead.load(tmp_path / "h", tiny_target)


# ---- the corpus --------------------------------------------------------------------------------


def mixed_sharegpt(path: Path, n_train: int = 24, n_heldout: int = 6) -> Path:
    """Cyclic conversations (see test_train_redrafter), some of them in the held-out split."""
    records = json.loads(cyclic_sharegpt(path, n=n_train + n_heldout).read_text())
    held_ids = [f"h{i}" for i in range(100000) if split_of(f"h{i}") == "heldout"][:n_heldout]
    for record, cid in zip(records[n_train:], held_ids):
        record["id"] = cid
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    return mixed_sharegpt(tmp_path / "sg.json")


def test_corpus_holds_what_the_target_computes(tiny_target, data, tmp_path):
    """Every stored state is the target's own at that position, every greedy label its
    argmax there, and gather's inputs/labels follow the documented layout."""
    examples = load_examples(str(data), tiny_target.tokenizer, seq_len=48, K=3, eos_ids=tiny_target.eos_ids)
    extract(tiny_target, examples, tmp_path / "c", corpus_manifest(tiny_target, examples, 48), chunk=5,
            max_batch_tokens=100, progress=False)
    corpus = Corpus(tmp_path / "c")
    assert len(corpus.chunks) == 5 and corpus.tokens == sum(len(examples[i].input_ids) for i in range(len(examples)))
    first = examples[0]
    ids = torch.tensor([first.input_ids])
    with torch.no_grad():
        hidden = tiny_target.base(input_ids=ids).last_hidden_state[0]
        argmax = tiny_target.logits(hidden).argmax(-1)
    answer = [y != -100 for y in first.labels]
    trained = [t for t in range(len(answer) - 2) if answer[t + 2]]
    batch = corpus.gather(list(range(len(trained))), 3)
    assert batch.t.tolist() == trained
    assert torch.allclose(batch.hidden.float(), hidden[trained].to(torch.bfloat16).float())
    for row, t in enumerate(trained):
        for i in range(3):
            valid = all(t + 2 + j < len(answer) and answer[t + 2 + j] for j in range(i + 1))
            assert batch.labels[row, i] == (argmax[t + 1 + i] if valid else -100)
            if valid:  # (inputs past a label's end are never read)
                assert batch.inputs[row, i] == first.input_ids[t + 1 + i]
    # The no-distillation labels (--labels text): the conversation's own next tokens, same validity.
    text = corpus.gather(list(range(len(trained))), 3, label="text")
    for row, t in enumerate(trained):
        for i in range(3):
            valid = all(t + 2 + j < len(answer) and answer[t + 2 + j] for j in range(i + 1))
            assert text.labels[row, i] == (first.input_ids[t + 2 + i] if valid else -100)
    # --kl-weight's states: h_{t+1+i}, whose logits chose the depth-i label, where t+1+i is stored.
    states, present = corpus.gather(list(range(len(trained))), 3, soft=True).soft
    for row, t in enumerate(trained):
        for i in range(3):
            assert present[row, i] == (t + 1 + i in trained)
            if present[row, i]:
                assert torch.equal(states[row, i], hidden[t + 1 + i].to(torch.bfloat16))
                if batch.labels[row, i] != -100:
                    assert tiny_target.logits(states[row, i].float()).argmax() == batch.labels[row, i]
    assert present.any() and not present.all()
    # ... in every chunk: h_{t+1+i} is the stored position 1+i further on, where that one is t+1+i.
    every = np.arange(len(corpus))
    whole = corpus.gather(every, 3, soft=True)
    for i in range(3):
        nxt = corpus.gather(np.minimum(every + 1 + i, len(corpus) - 1), 3)
        same = (nxt.chunk == whole.chunk) & (nxt.t == whole.t + 1 + i)
        assert torch.equal(whole.soft[1][:, i], same) and torch.equal(whole.soft[0][same, i], nxt.hidden[same])
    from specdraft.train.fit import BLOCK, CorpusTask
    n = min(BLOCK, len(corpus))
    for labels, expect in (("target", corpus.gather(range(n), 3)), ("text", corpus.gather(range(n), 3, label="text"))):
        assert torch.equal(CorpusTask(corpus, None, 3, "cpu", labels=labels).micro_batch([0]).labels[:n], expect.labels)
    # Rerunning skips the chunks that are there; another setting is refused.
    assert extract(tiny_target, examples, tmp_path / "c", corpus_manifest(tiny_target, examples, 48), chunk=5,
                   progress=False).tokens == 0
    # The same examples read from another path (a moved run folder, a new run reusing the corpus) match.
    moved = corpus_manifest(tiny_target, examples, 48)
    moved["data"] = {**moved["data"], "path": str(tmp_path / "elsewhere.jsonl")}
    assert extract(tiny_target, examples, tmp_path / "c", moved, chunk=5, progress=False).tokens == 0
    from specdraft.errors import SpecdraftError
    with pytest.raises(SpecdraftError, match="other settings"):
        extract(tiny_target, examples, tmp_path / "c", corpus_manifest(tiny_target, examples, 40), chunk=5,
                progress=False)


def test_agreeing_labels_keep_the_chains_the_engine_can_feed(tiny_target, data, tmp_path):
    """--labels agreeing: depth i keeps the target's label only where the text's inputs
    x_{t+1+j} were the target's choices greedy[t+j] for 0 < j <= i (a right draft feeds
    exactly that), else -100; depth 1 is the plain target label."""
    examples = load_examples(str(data), tiny_target.tokenizer, seq_len=48, K=3, eos_ids=tiny_target.eos_ids)
    extract(tiny_target, examples, tmp_path / "c", corpus_manifest(tiny_target, examples, 48), chunk=64,
            max_batch_tokens=400, progress=False)
    # A random target never agrees with the text; make it agree at two of every three slots.
    path = tmp_path / "c" / "chunk-000000"
    tokens, greedy = np.load(path / "tokens.npy"), np.load(path / "greedy.npy")
    u = np.nonzero((greedy[:-1] >= 0) & (np.arange(len(greedy) - 1) % 3 != 0))[0]
    greedy[u] = tokens[u + 1]
    np.save(path / "greedy.npy", greedy)
    corpus = Corpus(tmp_path / "c")
    assert len(corpus.chunks) == 1
    every = np.arange(len(corpus))
    target, agreeing = corpus.gather(every, 3), corpus.gather(every, 3, label="agreeing")
    t = target.t.numpy()
    for i in range(3):
        ok = np.ones(len(t), dtype=bool)
        for j in range(1, i + 1):
            ok &= tokens[np.minimum(t + 1 + j, len(tokens) - 1)] == greedy[t + j]
        expect = torch.where(torch.from_numpy(ok), target.labels[:, i], -100)
        assert torch.equal(agreeing.labels[:, i], expect)
        if i:  # both kinds of chain are there, so the rule was exercised both ways
            assert (agreeing.labels[:, i] != -100).any() and (target.labels[:, i] != agreeing.labels[:, i]).any()
    assert torch.equal(agreeing.inputs, target.inputs)


# ---- the command -------------------------------------------------------------------------------


def fit(target_path, data, out, *extra) -> int:
    return cli.main(["fit", "--target", str(target_path), "--data", str(data), "--out", str(out), "--dtype",
                     "float32", "--seq-len", "48", "--draft-vocab", "10", "-K", "3", "--batch-positions", "32",
                     "--eval-every", "4", "--no-progress", *extra])


@pytest.fixture
def answers(tiny_target, data, tmp_path) -> Path:
    from drafters_for_tests import greedy_answer_file

    prompts = [c.messages[:1] for c in iter_conversations(data, "heldout")]
    greedy_answer_file(tiny_target, prompts, tmp_path / "answers.jsonl")
    return tmp_path / "answers.jsonl"


@pytest.mark.parametrize("context, layers", [(0, ""), (3, ""), (0, "0,1")], ids=["paper", "context", "features"])
def test_fit_end_to_end_then_exact_and_walk_is_engine_tau(tiny_target_path, tiny_target, data, answers, tmp_path,
                                                          context, layers):
    """With --context (--feature-layers), the walk agreeing with the engine also shows that
    the corpus's context windows (feature states) are the ones the engine keeps."""
    out = tmp_path / "run"
    assert fit(tiny_target_path, data, out, "--heldout-data", str(answers), "--epochs", "20", "--lr", "1e-2",
               "--context", str(context), *(["--feature-layers", layers] if layers else [])) == 0
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab["ids"]) == 10 and 0 < vocab["heldout_coverage"] <= 1
    curve = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert curve[0]["positions"] == 0 and curve[-1]["positions"] > 0 and (out / "curve.png").is_file()
    assert curve[-1]["eval_acc1_0"] > curve[0]["eval_acc1_0"]  # it learned
    final = out / "final"
    head = ReDrafterHead.load(final, tiny_target)
    assert head.config.draft_vocab == 10 and head.dtype == tiny_target.dtype == torch.float32  # runs as the target
    assert load_file(final / "model.safetensors")["rnn_w.weight"].dtype == torch.bfloat16  # stored half size
    # The curve's τ is the engine's greedy τ on those answers (W = 1, every L).
    from drafters_for_tests import engine_forwards
    from specdraft.train.examples import load_examples as load
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    examples = load(str(answers), tiny_target.tokenizer, seq_len=48, K=3, eos_ids=tiny_target.eos_ids)
    examples = [examples[i] for i in range(len(examples))]
    tokens = sum(len(r["response_ids"]) for r in records)
    from specdraft.train.fit_eval import CorpusEvaluator
    from specdraft.train.heads import HeadObjective
    assert head.config.context == context and head.config.feature_layers == [int(x) for x in layers.split(",") if x]
    found = CorpusEvaluator(Corpus(out / "heldout-corpus"), head.draft_vocab, 3, tiny_target.device, window=context)(
        HeadObjective(head.float(), 3))
    assert found["eval_tau_w1_l4"] > 1.2  # the check has teeth
    # Chains drawn from the head: as T -> 0, sum_x min(p, q) -> [argmax q == argmax p], and on
    # the target's greedy answers argmax p is the text's next token (where its state is stored).
    from specdraft.train.fit_eval import sampled_acceptance
    held, objective = Corpus(out / "heldout-corpus"), HeadObjective(head.float(), 3)
    cold = sampled_acceptance(held, objective, tiny_target, head.draft_vocab, 3, temperature=1e-4, window=context)
    mb = held.gather(np.arange(len(held)), 3, label="text", window=context, soft=True)
    valid = (mb.labels != -100) & mb.soft[1]
    labels = to_output_space(head.draft_vocab, mb.labels)
    right = torch.zeros_like(valid)
    with torch.no_grad():
        for i, logits in objective.depth_logits(mb.hidden, mb.inputs, mb.window, mb.features):
            right[:, i] = (logits.argmax(-1) == labels[:, i]) & valid[:, i]
    for i in range(3):
        assert cold[f"eval_accept_t0.0001_{i}"] == pytest.approx(float(right[:, i].sum() / valid[:, i].sum()), abs=1e-3)
    streak = right.float().cumprod(1)
    for L in (2, 3, 4):
        assert cold[f"eval_tau_t0.0001_l{L}"] == pytest.approx(1 + float(streak[:, :L - 1].sum(1).mean()), abs=1e-3)
    warm = sampled_acceptance(held, objective, tiny_target, head.draft_vocab, 3, window=context, chains=3)
    assert all(0 < warm[f"eval_accept_t1_{i}"] < 1 for i in range(3))
    for i in range(3):  # a second and third draw only add, never past 1
        assert warm[f"eval_accept_t1_{i}"] < warm[f"eval_accept_t1_c2_{i}"] < warm[f"eval_accept_t1_c3_{i}"] <= 1
    assert 1 < warm["eval_tau_t1_l2"] < warm["eval_tau_t1_l3"] < warm["eval_tau_t1_l4"]
    for L in (2, 3, 4):
        drafter = build_drafter(f"redrafter:{final}", tiny_target, beam_width=1, beam_length=L)
        steps = engine_forwards(tiny_target, drafter, records, examples)  # asserts the target's own tokens
        assert abs(steps - tokens / found[f"eval_tau_w1_l{L}"]) < 0.05, L


def test_kl_term_is_the_targets_distribution_over_the_draft_vocabulary(tiny_target):
    """HeadObjective's loss with λ: CE + λ·KL(p‖q), p the target's softmax over the draft
    vocabulary's rows (renormalised), counted only where the state is present."""
    from specdraft.train.heads import HeadObjective

    torch.manual_seed(0)
    vocab = DraftVocab.from_counts(torch.arange(tiny_target.vocab_size, 0, -1), 10)
    head = ReDrafterHead.for_target(tiny_target, head="shared", draft_vocab=vocab).float()
    d, N, K = tiny_target.hidden_size, 6, 2
    hidden, states = torch.randn(N, d), torch.randn(N, K, d)
    inputs, labels = torch.randint(0, tiny_target.vocab_size, (N, K)), torch.randint(0, 10, (N, K))
    labels[0, 1] = -100
    present = torch.ones(N, K, dtype=torch.bool)
    present[1, 0] = present[2, 1] = False
    denom = torch.ones(K)
    ce_only, _ = HeadObjective(head, K)(hidden, inputs, labels, None, denom)
    both, stats = HeadObjective(head, K, kl_weight=0.5)(hidden, inputs, labels, states, denom, None, None, present)
    expect = torch.zeros(())
    logq = dict(HeadObjective(head, K).depth_logits(hidden, inputs))
    for i in range(K):
        rows = (labels[:, i] != -100).nonzero().flatten()
        q = torch.log_softmax(logq[i], -1)
        for r in rows.tolist():
            if present[r, i]:
                p = torch.log_softmax(tiny_target.logits(states[r, i])[vocab.ids()], -1)
                expect = expect + (p.exp() * (p - q[r])).sum()
    assert stats[:, 1].sum() == pytest.approx(expect.item(), rel=1e-4) and expect > 0
    assert (both - ce_only).item() == pytest.approx(0.5 * expect.item(), rel=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_objective_counts_only_labelled_rows(tiny_target, compiled):
    """Every row runs through the head (one matrix shape per batch), but the loss, its
    gradient and the hit counts are those of the labelled rows alone: equal to the objective
    on the labelled rows' F.cross_entropy, and an unlabelled row's inputs get no gradient."""
    from torch.nn import functional as F

    from specdraft.train.heads import HeadObjective

    torch.manual_seed(1)
    vocab = DraftVocab.from_counts(torch.arange(tiny_target.vocab_size, 0, -1), 10)
    head = ReDrafterHead.for_target(tiny_target, head="shared", draft_vocab=vocab).float()
    d, N, K = tiny_target.hidden_size, 12, 3
    hidden = torch.randn(N, d, requires_grad=True)
    inputs, labels = torch.randint(0, tiny_target.vocab_size, (N, K)), torch.randint(0, 10, (N, K))
    labels[2:5, 0] = labels[7, :] = -100
    denom = (labels != -100).sum(0).float()
    objective = HeadObjective(head, K, compiled_loss=compiled)
    loss, stats = objective(hidden, inputs, labels, None, denom)
    loss.backward()
    expected, hits = torch.zeros(()), torch.zeros(K)
    for i, logits in objective.depth_logits(hidden.detach(), inputs):
        rows = labels[:, i] != -100
        expected = expected + F.cross_entropy(logits[rows], labels[rows, i], reduction="sum") / denom[i]
        hits[i] = (logits[rows].argmax(-1) == labels[rows, i]).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.equal(stats[:, 2], hits) and torch.equal(stats[:, 4], denom)
    assert torch.all(hidden.grad[7] == 0) and torch.all(hidden.grad[0] != 0)  # row 7 has no label at any depth


def test_interrupted_fit_continues_to_the_same_weights(tiny_target_path, data, answers, tmp_path):
    common = ["--heldout-data", str(answers), "--epochs", "3", "--save-every", "0"]
    assert fit(tiny_target_path, data, tmp_path / "a", *common) == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *common, "--stop-after-steps", "3") == 0
    assert not (tmp_path / "b" / "final").exists()
    assert (tmp_path / "b" / "latest" / "model.safetensors").is_file()  # usable mid-schedule
    assert fit(tiny_target_path, data, tmp_path / "b", *common, "--stop-after-steps", "7") == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *common) == 0
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    curve = lambda r: [json.loads(x) for x in (tmp_path / r / "curve.jsonl").read_text().splitlines()]  # noqa: E731
    assert curve("a") == curve("b")  # each evaluation once, with the same numbers
    # OUT/best: the head at the first evaluation with the highest τ at the trained depth (L = K + 1),
    # the same in both runs although b's evaluations fell in three sittings.
    best = [json.loads((tmp_path / r / "best.json").read_text()) for r in "ab"]
    top = max(curve("a"), key=lambda e: (e["eval_tau_w1_l4"], -e["step"]))
    assert best[0] == best[1] == {"step": top["step"], "tokens": top["positions"], "eval_tau_w1_l4": top["eval_tau_w1_l4"]}
    a, b = (load_file(tmp_path / r / "best" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "b" / "best.tmp").exists()


@pytest.mark.parametrize("drafter", ["redrafter", "draft"])
def test_ctrl_c_saves_a_checkpoint_and_a_usable_latest(tiny_target_path, tiny_target, data, answers, tmp_path,
                                                       monkeypatch, capsys, drafter):
    """Ctrl-C (or SIGTERM, which fit turns into one) between steps: exit 130, the checkpoint
    and OUT/latest are saved, and the same command finishes the schedule from there."""
    from specdraft.train import common

    extra = ["--drafter", drafter, "--heldout-data", str(answers), "--epochs", "2", "--save-every", "0"]
    extra += ["--copy-layers", "0", "--batch-sequences", "4", "--gamma", "2"] if drafter == "draft" else []
    calls, clock = [0], common.clock_says

    def interrupt_at_step_two(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt  # after the second optimizer step: the state is consistent
        return clock(*args)

    monkeypatch.setattr(common, "clock_says", interrupt_at_step_two)
    assert fit(tiny_target_path, data, tmp_path / "r", *extra) == 130
    err = capsys.readouterr().err
    assert "interrupted; saved" in err and "Traceback" not in err and "stopped at step 2 of" in err
    assert (tmp_path / "r" / "latest").is_dir() and not (tmp_path / "r" / "final").exists()
    build_drafter(f"{drafter}:{tmp_path / 'r' / 'latest'}", tiny_target)  # usable mid-schedule
    monkeypatch.setattr(common, "clock_says", clock)
    assert fit(tiny_target_path, data, tmp_path / "r", *extra) == 0
    assert (tmp_path / "r" / "final").is_dir()
    assert re.search(r"resuming( training)? at step 2\b", capsys.readouterr().err)


def test_example_spans_repeat_or_cut_the_second_part_to_its_share():
    from specdraft.train.fit_stages import example_spans

    starts, ends = example_spans([(0, 40), (40, 50)], 16, 0.5)  # the docstring's example
    assert starts.tolist() == [0, 16, 32, 40, 40, 40] and ends.tolist() == [40, 40, 40, 50, 50, 50]
    starts, ends = example_spans([(0, 100), (100, 200)], 16, 0.2)  # 7 + 2: the second part cut
    assert starts.tolist() == [0, 16, 32, 48, 64, 80, 96, 100, 116] and set(ends[7:].tolist()) == {200}
    starts, ends = example_spans([(0, 100), (100, 200)], 16, None)  # each block once, cut at its part's end
    assert starts.tolist() == [0, 16, 32, 48, 64, 80, 96, 100, 116, 132, 148, 164, 180, 196]
    assert ends.tolist() == [100] * 7 + [200] * 7


def test_fit_trains_on_the_targets_own_answers_at_a_stated_share(tiny_target_path, tiny_target, data, answers,
                                                                 tmp_path, capsys):
    """--own-answers: the target answers training prompts (never held-out ones), the answers
    get their own corpus, joined after the data's, and make --own-share of the examples;
    stopped and continued, the run ends with the weights of an uninterrupted one."""
    from specdraft.train.fit import BLOCK, CorpusTask
    from specdraft.train.fit_stages import example_spans

    own = ["--heldout-data", str(answers), "--own-answers", "3", "--own-temperatures", "0,1", "--own-share", "0.5",
           "--epochs", "2", "--save-every", "0"]
    assert fit(tiny_target_path, data, tmp_path / "a", *own) == 0
    out = tmp_path / "a"
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    train_ids = [c.id for c in iter_conversations(data, "train")][:3]
    assert [(r["prompt_id"], r["temperature"]) for r in records] == [(i, t) for i in train_ids for t in (0.0, 1.0)]
    assert not {c.id for c in iter_conversations(data, "heldout")} & {r["prompt_id"] for r in records}
    # ... and a retrieval datastore of them, ready as retrieval:OUT/datastore.
    from specdraft.datastore import Datastore

    store = Datastore.load(out / "datastore")
    assert store.tokens.tolist() == [t for r in records for t in r["response_ids"] + [-1]]
    corpus = Corpus(out / "corpus").joined(Corpus(out / "answers-corpus"))
    assert corpus.parts[1][1] > corpus.parts[1][0] == len(Corpus(out / "corpus"))  # the answers hold positions
    spans = example_spans(corpus.parts, BLOCK, 0.5)
    n_own = int((spans[0] >= corpus.parts[1][0]).sum())
    assert n_own == len(spans[0]) - n_own
    err = capsys.readouterr().err
    assert f"{n_own} of {len(spans[0])} examples per epoch from the target's own answers" in err
    assert re.search(r"answers-corpus: extracted [1-9]\d* tokens .* tokens/s", err)  # each extraction's rate
    # An example of the second part is a block of the answers corpus's own positions.
    i = len(spans[0]) - 1
    got = CorpusTask(corpus, None, 3, "cpu", spans=spans).micro_batch([i])
    start = spans[0][i] - corpus.parts[1][0]
    expect = Corpus(out / "answers-corpus").gather(np.arange(start, min(start + BLOCK, corpus.parts[1][1] -
                                                                        corpus.parts[1][0])), 3)
    assert torch.equal(got.hidden, expect.hidden) and torch.equal(got.inputs, expect.inputs)
    assert fit(tiny_target_path, data, tmp_path / "b", *own, "--stop-after-steps", "3") == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *own) == 0
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_own_offset_answers_later_prompts_only(tiny_target, data, tmp_path):
    """--own-offset N: a round of own answers starts at the Nth training prompt, so a round
    after an earlier one (--init-from) answers prompts none before it did."""
    from specdraft.train.fit_config import FitConfig
    from specdraft.train.fit_stages import own_answers

    config = FitConfig(out=tmp_path, own_answers=2, own_offset=1, heldout_max_new_tokens=4, progress=False,
                       data=str(data))
    own_answers(config, tiny_target, tmp_path / "answers.jsonl")
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == [c.id for c in iter_conversations(data, "train")][1:3]


def test_budget_stops_extraction_and_a_rerun_continues(tiny_target_path, data, answers, tmp_path, capsys):
    out = tmp_path / "run"
    assert fit(tiny_target_path, data, out, "--heldout-data", str(answers), "--budget", "0.001s") == 0
    assert "rerun the same command" in capsys.readouterr().err
    assert not (out / "final").exists()
    assert not (out / "vocab.json").exists()  # made from the whole corpus, when training begins
    assert fit(tiny_target_path, data, out, "--heldout-data", str(answers), "--epochs", "1") == 0
    assert (out / "final" / "model.safetensors").is_file()


def test_a_rerun_after_training_began_does_not_extend_the_corpus(tiny_target_path, data, answers, tmp_path,
                                                                 monkeypatch):
    """Once training has a checkpoint, its corpus is fixed (the checkpoint records its
    chunks): a rerun with a larger --tokens or a fresh budget trains on, extracting nothing."""
    import specdraft.train.fit as fit_module

    out = tmp_path / "run"
    common = ["--heldout-data", str(answers), "--epochs", "3", "--save-every", "0"]
    assert fit(tiny_target_path, data, out, *common, "--stop-after-steps", "2") == 0
    folders = []
    real = fit_module.extract
    monkeypatch.setattr(fit_module, "extract", lambda target, examples, folder, *a, **k: (
        folders.append(Path(folder).name), real(target, examples, folder, *a, **k))[1])
    assert fit(tiny_target_path, data, out, *common, "--tokens", "100000000") == 0
    assert folders == ["heldout-corpus"]  # the training corpus was not touched
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--budget", "soon"], "--budget must be a duration"),
    (["--tokens", "lots"], "--tokens must be a count"),
    (["--draft-vocab", "-1"], "draft-vocab"),
    (["--heldout-data", "/nonexistent.jsonl"], "not found"),
    (["--context", "-1"], "--context must be >= 0"),
    (["--drafter", "medusa", "--context", "4"], "redrafter option"),
    (["--drafter", "medusa", "--hidden-in-recurrence"], "redrafter option"),
    (["--feature-layers", "a,b"], "--feature-layers must be"),
    (["--feature-layers", "0,99"], "no layer 99"),
    (["--kl-weight", "-1"], "--kl-weight must be >= 0"),
    (["--kl-weight", "1", "--labels", "text"], "--kl-weight must be >= 0"),
])
def test_bad_fit_options_are_one_line_errors(tiny_target_path, data, tmp_path, capsys, argv, message):
    assert fit(tiny_target_path, data, tmp_path / "x", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_export_refuses_a_draft_vocab_head_with_the_reason(tiny_target, tmp_path):
    from specdraft.errors import SpecdraftError
    from specdraft.heads import export_trtllm

    vocab = DraftVocab(4, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5]))
    ReDrafterHead.for_target(tiny_target, draft_vocab=vocab).save(tmp_path / "h")
    with pytest.raises(SpecdraftError, match="no draft vocabulary"):
        export_trtllm(tmp_path / "h", tmp_path / "out")


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_medusa_heads_with_a_draft_vocab_round_trip_and_stay_exact(tiny_target, tmp_path, variant):
    from specdraft.heads import MedusaHeads

    vocab = DraftVocab(8, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5, 7, 8, 11, 13]))
    heads = MedusaHeads.for_target(tiny_target, num_heads=3, head=variant, draft_vocab=vocab)
    if variant == "own":  # Medusa's start: each head is the target's own head, on the kept rows
        assert torch.equal(heads.heads[0].out.weight, tiny_target.head.weight[vocab.ids()].float())
    heads.save(tmp_path / "m")
    loaded = MedusaHeads.load(tmp_path / "m", tiny_target)
    logits = loaded.logits(torch.randn(2, 32))
    assert logits.shape == (2, 3, tiny_target.vocab_size) and torch.isinf(logits[..., ~vocab.t2d]).all()
    params = SamplingParams(max_new_tokens=16)
    ref = [r.token_ids for r in SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS, params)]
    drafter = build_drafter(f"medusa:{tmp_path / 'm'}", tiny_target, beam_width=3, beam_length=4)
    got = [r.token_ids for r in SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]
    assert got == ref


def test_fit_trains_medusa_heads_too(tiny_target_path, tiny_target, data, answers, tmp_path):
    out = tmp_path / "m"
    assert fit(tiny_target_path, data, out, "--drafter", "medusa", "--heldout-data", str(answers), "--epochs", "2") == 0
    params = SamplingParams(max_new_tokens=16)
    ref = [r.token_ids for r in SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS, params)]
    drafter = build_drafter(f"medusa:{out / 'final'}", tiny_target, beam_width=2, beam_length=3)
    got = [r.token_ids for r in SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]
    assert got == ref and drafter.heads.config.draft_vocab == 10


def test_fit_compile_target_extracts_through_the_compiled_stack(tiny_target_path, data, answers, tmp_path,
                                                                 monkeypatch):
    """--compile-target compiles the target before the training corpus (not the held-out
    one) and extracts through it. With the eager backend the compiled graph runs eager's
    kernels, so both runs' corpora are equal, array by array."""
    from specdraft.models import Target

    real, calls = Target.compile, []
    monkeypatch.setattr(Target, "compile", lambda self, backend="inductor": calls.append(backend) or real(self, "eager"))
    argv = ("--heldout-data", str(answers), "--epochs", "1", "--feature-layers", "0,1")
    assert fit(tiny_target_path, data, tmp_path / "eager", *argv) == 0 and calls == []
    assert fit(tiny_target_path, data, tmp_path / "compiled", *argv, "--compile-target") == 0 and calls == ["inductor"]
    chunks = sorted(p.name for p in (tmp_path / "eager" / "corpus").glob("chunk-*"))
    assert chunks and chunks == sorted(p.name for p in (tmp_path / "compiled" / "corpus").glob("chunk-*"))
    for chunk in chunks:
        for name in ("tokens", "greedy", "pos", "hidden", "features"):
            a, b = (np.load(tmp_path / run / "corpus" / chunk / f"{name}.npy") for run in ("eager", "compiled"))
            assert np.array_equal(a, b), (chunk, name)
    assert fit(tiny_target_path, data, tmp_path / "d", "--drafter", "draft", "--compile-target") == 2  # no such stage


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_warm_start_takes_a_full_vocabulary_head_into_a_draft_vocabulary(tiny_target, tmp_path, variant):
    """--init-from: a full-vocabulary head seeds a draft-vocabulary one, whose logits are
    then the warm head's own at the draft ids (so training continues, not restarts)."""
    from specdraft.errors import SpecdraftError
    from specdraft.train.fit import warm_start

    torch.manual_seed(2)
    warm = ReDrafterHead.for_target(tiny_target, head=variant)
    for p in warm.parameters():
        torch.nn.init.normal_(p, std=0.2)
    vocab = DraftVocab(8, int(tiny_target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5, 7, 8, 11, 13]))
    head = ReDrafterHead.for_target(tiny_target, head=variant, draft_vocab=vocab)
    warm_start(head, warm)
    assert torch.equal(head.draft_vocab.ids(), vocab.ids())
    h, s = torch.randn(3, 32), torch.randn(3, 32)
    assert torch.allclose(head.draft_logits(h, s), warm.logits(h, s)[:, vocab.ids()], atol=1e-5)
    other = ReDrafterHead.for_target(tiny_target, head="shared" if variant == "own" else "own", draft_vocab=vocab)
    with pytest.raises(SpecdraftError, match="--init-from"):
        warm_start(other, warm)


@pytest.mark.parametrize("variant", ["own", "shared"])
def test_warm_start_grows_a_head_by_identity_blocks(tiny_target, tmp_path, variant):
    """--init-from with more --num-blocks: the warm blocks are copied, the extra ones start at
    zero (the identity), so the grown head scores as the warm one; fewer blocks is an error."""
    from specdraft.errors import SpecdraftError
    from specdraft.train.fit import warm_start

    torch.manual_seed(3)
    warm = ReDrafterHead.for_target(tiny_target, head=variant, num_blocks=1)
    for p in warm.parameters():
        torch.nn.init.normal_(p, std=0.2)
    grown = ReDrafterHead.for_target(tiny_target, head=variant, num_blocks=3)
    warm_start(grown, warm)
    assert torch.equal(grown.blocks[0].linear.weight, warm.blocks[0].linear.weight)
    assert not grown.blocks[2].linear.weight.any() and not grown.blocks[2].linear.bias.any()
    h, s = torch.randn(3, 32), torch.randn(3, 32)
    assert torch.allclose(grown.logits(h, s), warm.logits(h, s), atol=1e-6)
    with pytest.raises(SpecdraftError, match="at least its --num-blocks"):
        warm_start(ReDrafterHead.for_target(tiny_target, head=variant, num_blocks=0), warm)


# ---- fit --drafter draft ---------------------------------------------------------------------


def test_fit_trains_a_draft_model_resumably_and_it_stays_exact(tiny_target_path, tiny_target, data, answers,
                                                               tmp_path):
    """The draft model's pipeline in one command: stopped, it leaves a loadable OUT/latest;
    continued, it ends with the weights of an uninterrupted run; the result loads as
    draft:OUT/final and is exact."""
    from safetensors.torch import load_file as load

    common = ["--drafter", "draft", "--heldout-data", str(answers), "--copy-layers", "0", "--epochs", "2",
              "--batch-sequences", "4", "--save-every", "0", "--gamma", "2", "--loss", "tvd"]
    assert fit(tiny_target_path, data, tmp_path / "a", *common) == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *common, "--stop-after-steps", "2") == 0
    assert not (tmp_path / "b" / "final").exists()
    build_drafter(f"draft:{tmp_path / 'b' / 'latest'}", tiny_target, gamma=2)  # usable mid-schedule
    assert json.loads((tmp_path / "b" / "latest" / "specdraft.json").read_text())["stages"][-1]["steps"] == 2
    assert fit(tiny_target_path, data, tmp_path / "b", *common) == 0
    a, b = (load(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    curve = [json.loads(line) for line in (tmp_path / "a" / "curve.jsonl").read_text().splitlines()]
    assert curve[0]["tokens"] == 0 and curve[-1]["tokens"] > 0 and "eval_tau_walk_g2" in curve[-1]
    best = json.loads((tmp_path / "a" / "train" / "best.json").read_text())
    assert best["eval_tau_walk_g2"] == max(e["eval_tau_walk_g2"] for e in curve)
    assert json.loads((tmp_path / "b" / "train" / "best.json").read_text()) == best
    assert json.loads((tmp_path / "a" / "best" / "specdraft.json").read_text())["stages"][-1]["steps"] == best["step"]
    build_drafter(f"draft:{tmp_path / 'a' / 'best'}", tiny_target, gamma=2)  # OUT/best loads like OUT/final
    assert (tmp_path / "a" / "curve.png").is_file()
    meta = json.loads((tmp_path / "a" / "final" / "specdraft.json").read_text())
    assert meta["embeddings"] == "target" and meta["stages"][-1]["loss"] == "tvd"
    params = SamplingParams(max_new_tokens=16)
    ref = [r.token_ids for r in SpeculativeEngine(tiny_target, NoDrafter()).generate(PROMPTS, params)]
    drafter = build_drafter(f"draft:{tmp_path / 'a' / 'final'}", tiny_target, gamma=3)
    got = [r.token_ids for r in SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]
    assert got == ref


def test_fit_trains_a_draft_on_policy_resumably(tiny_target_path, tiny_target, data, answers, tmp_path):
    """--on-policy: the draft's own continuations of the conversations' prompts, scored by the
    target each step (no hidden cache); stopped and continued it ends bitwise where an
    uninterrupted run ends (the sampling RNG is in the checkpoint)."""
    from safetensors.torch import load_file as load

    common = ["--drafter", "draft", "--heldout-data", str(answers), "--copy-layers", "0", "--epochs", "1",
              "--batch-sequences", "4", "--save-every", "0", "--gamma", "2", "--on-policy", "--on-policy-tokens", "6"]
    assert fit(tiny_target_path, data, tmp_path / "a", *common) == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *common, "--stop-after-steps", "1") == 0
    assert fit(tiny_target_path, data, tmp_path / "b", *common) == 0
    a, b = (load(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "a" / "hidden-cache").exists()
    stage = json.loads((tmp_path / "a" / "final" / "specdraft.json").read_text())["stages"][-1]
    assert stage["on_policy"] is True and stage["steps"] >= 2
    build_drafter(f"draft:{tmp_path / 'a' / 'final'}", tiny_target, gamma=2)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1k"], "--budget or --max-steps"),
    (["--on-policy-tokens", "0"], "--on-policy-tokens must be >= 1"),
    (["--copy-layers", "x"], "copy-layers"),
    (["--init-from", "default", "--copy-layers", "0"], "drop --copy-layers"),
    (["--labels", "agreeing"], "is for heads"),
    (["--own-answers", "4"], "--own-answers must be >= 0 and is for heads"),
])
def test_bad_draft_fit_options_are_one_line_errors(tiny_target_path, data, tmp_path, capsys, argv, message):
    assert fit(tiny_target_path, data, tmp_path / "x", "--drafter", "draft", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_on_policy_is_a_draft_model_option(tiny_target_path, data, tmp_path, capsys):
    assert fit(tiny_target_path, data, tmp_path / "x", "--on-policy") == 2
    err = capsys.readouterr().err
    assert "--on-policy is for --drafter draft" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--own-share", "0.3"], "--own-share must be in (0, 1), with --own-answers > 0"),
    (["--own-offset", "3"], "--own-offset must be >= 0, with --own-answers > 0"),
    (["--own-answers", "2", "--own-offset", "-1"], "--own-offset must be >= 0"),
    (["--own-answers", "2", "--own-share", "1"], "--own-share must be in (0, 1)"),
    (["--own-answers", "2", "--own-temperatures", "0,x"], "--own-temperatures must be comma-separated numbers"),
])
def test_bad_own_answer_options_are_one_line_errors(tiny_target_path, data, tmp_path, capsys, argv, message):
    assert fit(tiny_target_path, data, tmp_path / "x", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("outside", [0.0, 0.2], ids=["full-vocab", "p-mass-outside"])
def test_without_replacement_rates_match_enumeration(outside):
    """The Monte Carlo rate of recursive rejection over c draws without replacement equals
    the exact sum over every ordered draw (5 tokens, c = 2 and 3), also where p keeps mass
    outside the draft vocabulary; and it beats c independent draws' rate."""
    import itertools

    from specdraft.train.fit_eval import without_replacement_rates

    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 5) * 2, -1) * (1 - outside)
    q = torch.softmax(torch.randn(3, 5) * 2, -1)

    def exact(row: int, c: int) -> float:
        total = 0.0
        for draw in itertools.permutations(range(5), c):
            left, chance, r, out, none = q[row].clone(), 1.0, p[row].clone(), outside, 1.0
            for x in draw:
                q_k = left / left.sum()
                chance *= float(q_k[x])
                none *= 1 - min(1.0, float(r[x] / q_k[x]))
                residual = (r - q_k).clamp(min=0)
                mass = float(residual.sum()) + out
                r, out = residual / mass, out / mass
                left[x] = 0.0
            total += chance * (1 - none)
        return total

    found = without_replacement_rates(p, q, 3, torch.Generator().manual_seed(1), samples=40000)
    for row in range(3):
        for c in (2, 3):
            assert float(found[row, c - 2]) == pytest.approx(exact(row, c), abs=0.01)
        # i.i.d.: a_c = a_{c-1} + (1 - a_{c-1}) * sum min(r_c, q), r_c the residual
        r, out, rate = p[row].clone(), outside, float(torch.minimum(p[row], q[row]).sum())
        for c in (2, 3):
            residual = (r - q[row]).clamp(min=0)
            mass = float(residual.sum()) + out
            r, out = residual / mass, out / mass
            rate += (1 - rate) * float(torch.minimum(r, q[row]).sum())
            assert exact(row, c) >= rate - 1e-6

