"""``specdraft train redrafter``: the objective, the loop (resume, hidden cache, DDP), and
the saved heads as exact drafters. Tiny random target, synthetic chat data."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft import SamplingParams, SpeculativeEngine, cli
from specdraft.data import IGNORE, iter_conversations
from specdraft.drafters import NoDrafter
from specdraft.drafters.registry import build_drafter
from specdraft.heads import MedusaHeads, ReDrafterHead, future_labels
from specdraft.train.common import Plan
from specdraft.train.examples import Example, collate
from specdraft.train.heads import HeadObjective

PROMPTS = [[1, 4, 5, 1], [1, 9, 3, 8, 2, 1], [1, 7, 1]]


def cyclic_sharegpt(path: Path, n: int = 24, seed: int = 0) -> Path:
    """Conversations whose answers count through t2..t15 cyclically from a random start:
    learnable from the fed tokens, so a head's loss can fall quickly."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        start = rng.randrange(14)
        answer = " ".join(f"t{2 + (start + j) % 14}" for j in range(10))
        question = " ".join(f"t{rng.randrange(2, 16)}" for _ in range(4))
        records.append({"id": f"c{i}", "conversations": [{"from": "human", "value": question},
                                                          {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(records))
    return path


def train_count(path: Path) -> int:
    return sum(1 for _ in iter_conversations(path, "train"))


@pytest.fixture
def data(tmp_path) -> Path:
    return cyclic_sharegpt(tmp_path / "sg.json")


def train(target_path, data, out, *extra) -> int:
    return cli.main(["train", "redrafter", "--target", str(target_path), "--data", str(data), "--out", str(out),
                     "--seq-len", "48", "--batch-size", "4", "--no-progress", *extra])


def log_entries(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def greedy(target, drafter):
    params = SamplingParams(max_new_tokens=16)
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]


# ---- the objective ------------------------------------------------------------------------


def random_examples(V: int, lengths=(9, 13)) -> list[Example]:
    g = torch.Generator().manual_seed(4)
    out = []
    for n, T in enumerate(lengths):
        ids = torch.randint(0, V, (T,), generator=g)
        labels = torch.where(torch.rand(T, generator=g) < 0.6, ids, torch.full_like(ids, IGNORE))
        out.append(Example(key=str(n), input_ids=ids.tolist(), labels=labels.tolist()))
    return out


@pytest.mark.parametrize("arch, variant", [("redrafter", "own"), ("redrafter", "shared"), ("redrafter", "reads-h"),
                                           ("medusa", "own")])
def test_objective_logits_equal_the_heads_teacher_forced_logits(tiny_target, arch, variant):
    K = 3
    torch.manual_seed(0)
    reads_h = variant == "reads-h"  # a shared head whose recurrence reads h
    head = (ReDrafterHead.for_target(tiny_target, head="shared" if reads_h else variant, hidden_in_recurrence=reads_h)
            if arch == "redrafter"
            else MedusaHeads.for_target(tiny_target, num_heads=K, head=variant))
    with torch.no_grad():  # Medusa starts with zero blocks: make them matter
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    objective = HeadObjective(head, K)
    examples = random_examples(tiny_target.vocab_size)
    batch = collate(examples, K)
    hidden = torch.randn(len(examples), batch.input_ids.shape[1], tiny_target.hidden_size,
                         generator=torch.Generator().manual_seed(5))
    if arch == "redrafter":
        reference = head.teacher_forced_logits(hidden, batch.input_ids, K)  # (B, T, K, V)
    else:
        reference = head.teacher_forced_logits(hidden)
    labels = torch.stack([future_labels(torch.tensor(e.labels + [IGNORE] * (batch.input_ids.shape[1] - len(e.labels)))[None],
                                        K)[0] for e in examples])
    assert torch.equal(batch.labels, labels[batch.rows, batch.cols])
    assert (labels[batch.rows, batch.cols] != IGNORE).any(1).all()  # only positions with a label
    assert (labels != IGNORE).sum() == (batch.labels != IGNORE).sum()  # and all of them
    valid = batch.labels != IGNORE
    with torch.no_grad():
        for i, logits in objective.depth_logits(hidden[batch.rows, batch.cols], batch.inputs):
            expected = reference[batch.rows, batch.cols, i][valid[:, i]]
            torch.testing.assert_close(logits[valid[:, i]], expected)
    tcols = batch.target_cols
    assert torch.equal(tcols[valid], (batch.cols[:, None] + 1 + torch.arange(K)).expand_as(tcols)[valid])


class RightForDepths:
    """A stand-in head objective whose top-1 guess is right at depths < m and wrong after:
    under teacher forcing the depth-i label is the token fed at depth i + 1 (token 0 never
    occurs in the data, so guessing 0 is always wrong)."""

    def __init__(self, V: int, m: int):
        self.V, self.m, self.training = V, m, False

    def depth_logits(self, hidden, inputs):
        for i in range(inputs.shape[1]):
            guess = inputs[:, i + 1] if i < self.m else torch.zeros_like(inputs[:, 0])
            yield i, torch.nn.functional.one_hot(guess, self.V).float() * 10.0


@pytest.mark.parametrize("m", [0, 1, 3])
def test_heldout_evaluator_replays_the_greedy_walk(tiny_target, m):
    """Per-depth accuracy, and τ_L from the engine's walk: a prefill step emits an answer's
    first token; a step at t emits min(r_t, L - 1) drafted tokens (r_t = leading right
    guesses, cut where the answer ends) and the target's next one; over each answer (two
    answers in the last example: a multi-turn one)."""
    from specdraft.train.heads import HeadEvaluator

    K, V = 4, tiny_target.vocab_size
    g = torch.Generator().manual_seed(7)
    examples = []
    for n, T in enumerate((11, 7, 16)):
        ids = torch.randint(1, V, (T,), generator=g).tolist()
        labels = [IGNORE] * (1 + n) + ids[1 + n:]
        if n == 2:
            labels[9:11] = [IGNORE, IGNORE]  # a user turn between two answers
        examples.append(Example(key=str(n), input_ids=ids, labels=labels))
    evaluator = HeadEvaluator(examples, tiny_target, K, batch_size=2)
    found = evaluator.fields(evaluator.sums(RightForDepths(V, m)))
    for i in range(K):
        assert found[f"eval_acc1_{i}"] == (1.0 if i < m else 0.0)
    for L in range(2, K + 2):
        tokens = steps = 0
        for e in examples:
            y = e.labels + [IGNORE]
            starts = [t for t in range(len(e.labels)) if y[t] != IGNORE and (t == 0 or y[t - 1] == IGNORE)]
            for first in starts:  # each answer: the prefill emits its first token
                last = next(t for t in range(first, len(y)) if y[t + 1] == IGNORE)
                t, tokens, steps = first - 1, tokens + 1, steps + 1
                while t + 2 <= last:  # x_{t+2}..x_{t+2+r}: r right guesses and the target's token
                    r = 0
                    while r < min(m, L - 1, last - t - 2) and y[t + 2 + r] != IGNORE:
                        r += 1
                    tokens, steps, t = tokens + 1 + r, steps + 1, t + 1 + r
        assert tokens == sum(len([v for v in e.labels if v != IGNORE]) for e in examples)
        assert found[f"eval_tau_w1_l{L}"] == pytest.approx(tokens / steps, abs=1e-4)
        if m == 0:
            assert found[f"eval_tau_w1_l{L}"] == 1.0


@pytest.mark.parametrize("arch", ["redrafter", "medusa"])
def test_heldout_walk_is_the_engines_greedy_tau(tiny_target_path, tiny_target, data, tmp_path, arch):
    """On the target's greedy answers the evaluator's τ_L is the engine's own greedy τ at
    W = 1: the same tokens, and steps within one per answer (the engine's prefill emits
    the first token alone)."""
    from accelerate import Accelerator

    from specdraft.train.examples import record_examples
    from specdraft.train.heads import HeadEvaluator

    from drafters_for_tests import engine_forwards, greedy_answer_file

    answers = tmp_path / "answers.jsonl"
    prompts = [c.messages[:1] for c in iter_conversations(data, "train")][:10]
    records = greedy_answer_file(tiny_target, prompts, answers)
    out = tmp_path / "run"
    assert train(tiny_target_path, answers, out, "--arch", arch, "--epochs", "8", "--lr", "1e-2", "-K", "3",
                 "--save-every", "100") == 0
    examples = record_examples(records, tiny_target.tokenizer, 64, 3, {"path": str(answers)})
    examples = [examples[i] for i in range(len(examples))]
    head = (ReDrafterHead if arch == "redrafter" else MedusaHeads).load(out / "final", tiny_target)
    found = HeadEvaluator(examples, tiny_target, 3, batch_size=4)(Accelerator(cpu=True), HeadObjective(head, 3))
    answer_tokens = sum(len(r["response_ids"]) for r in records)
    for L in (2, 3, 4):
        drafter = build_drafter(f"{arch}:{out / 'final'}", tiny_target, beam_width=1, beam_length=L)
        steps = engine_forwards(tiny_target, drafter, records, examples)
        walk_steps = answer_tokens / found[f"eval_tau_w1_l{L}"]
        assert abs(steps - walk_steps) < 0.05, (L, steps, walk_steps)
    assert found["eval_tau_w1_l4"] > 1.2  # the head does get some right: the check has teeth


def test_plan_covers_every_example_once_per_epoch():
    plan = Plan(num_examples=10, batch_size=2, grad_accum=2, num_processes=2, epochs=2, max_steps=None, seed=1)
    assert plan.micro_per_epoch == 3 and plan.steps_per_epoch == 2 and plan.total_steps == 4
    for epoch in range(2):
        seen = [i for step in range(epoch * 2, epoch * 2 + 2) for e, m in plan.micro_batches(step)
                for rank in range(2) for i in plan.indices(e, m, rank)]
        assert len(seen) == 12 and set(seen) == set(range(10))  # wrapped around to fill the last batch
    assert plan.order(0) != plan.order(1)


# ---- training runs --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["redrafter", "medusa"])
def test_training_lowers_the_loss_and_saves_an_exact_drafter(tiny_target_path, tiny_target, data, tmp_path, arch):
    out = tmp_path / "run"
    held = heldout_sharegpt(tmp_path / "held.json")
    assert train(tiny_target_path, data, out, "--arch", arch, "--epochs", "6", "--lr", "1e-2",
                 "--log-every", "6", "--save-every", "100", "-K", "4", "--eval-data", str(held),
                 "--eval-every", "12") == 0
    log = log_entries(out)
    assert log[-1]["step"] == 36 and log[-1]["loss"] < 0.6 * log[0]["loss"]
    assert log[-1]["acc1_0"] > log[0]["acc1_0"] and {"ce_3", "acc5_3", "lr", "tokens"} <= set(log[0])
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["kind"] == arch and config["training"]["data"]["conversations"] == train_count(data)
    assert config["training"]["steps"] == 36 and config["training"]["options"]["lr"] == 1e-2
    assert config["training"]["data"]["source"] == "sharegpt"
    drafter = build_drafter(f"{arch}:{out / 'final'}", tiny_target)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())
    # Held-out scores (conversations of ShareGPT's held-out split, never trained on):
    # before training, every 12 steps, and at the end; the cyclic answers are learnt.
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 12, 24, 36]
    assert evals[-1]["eval_acc1_0"] > evals[0]["eval_acc1_0"] + 0.3
    assert 1.0 < evals[-1]["eval_tau_w1_l5"] <= 5.0 and evals[-1]["eval_tokens"] > 0
    assert config["training"]["heldout_examples"] == 8
    # OUT/best: the head at its best held-out τ at the trained depth (first of equals), loadable
    best = json.loads((out / "best.json").read_text())
    top = max(evals, key=lambda e: (e["eval_tau_w1_l5"], -e["step"]))
    assert (best["step"], best["eval_tau_w1_l5"]) == (top["step"], top["eval_tau_w1_l5"])
    assert json.loads((out / "best" / "config.json").read_text())["training"]["steps"] == best["step"]
    assert greedy(tiny_target, build_drafter(f"{arch}:{out / 'best'}", tiny_target)) == greedy(tiny_target,
                                                                                              NoDrafter())


def heldout_sharegpt(path: Path, n: int = 8) -> Path:
    """Cyclic conversations whose ids all fall in ShareGPT's held-out split."""
    from specdraft.data.sharegpt import split_of

    ids = [f"h{i}" for i in range(100000) if split_of(f"h{i}") == "heldout"][:n]
    records = json.loads(cyclic_sharegpt(path, n=n, seed=1).read_text())
    for record, cid in zip(records, ids):
        record["id"] = cid
    path.write_text(json.dumps(records))
    return path


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tiny_target_path, data, tmp_path):
    common = ["--epochs", "3", "--grad-accum", "2", "--save-every", "2", "--log-every", "1"]
    assert train(tiny_target_path, data, tmp_path / "a", *common, "--hidden-cache", str(tmp_path / "ca")) == 0
    assert train(tiny_target_path, data, tmp_path / "b", *common, "--hidden-cache", str(tmp_path / "cb"),
                 "--stop-after-steps", "5") == 0
    assert not (tmp_path / "b" / "final").exists()
    assert train(tiny_target_path, data, tmp_path / "b", *common, "--hidden-cache", str(tmp_path / "cb"),
                 "--resume") == 0
    a, b = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda entries: [{k: v for k, v in e.items() if "per_s" not in k and k != "seconds"} for e in entries]  # noqa: E731
    assert strip(log_entries(tmp_path / "a")) == strip(log_entries(tmp_path / "b"))  # each step once, same numbers
    # Epochs after the first read the target's states from the cache: the target never runs.
    epochs = [e for e in log_entries(tmp_path / "a") if e["epoch"] >= 1]
    assert epochs and not any("target_tokens_per_s" in e for e in epochs)


def test_gradient_accumulation_matches_a_larger_batch(tiny_target_path, data, tmp_path):
    assert train(tiny_target_path, data, tmp_path / "a", "--max-steps", "4", "--batch-size", "4") == 0
    assert train(tiny_target_path, data, tmp_path / "b", "--max-steps", "4", "--batch-size", "2",
                 "--grad-accum", "2") == 0
    a, b = load_file(tmp_path / "a" / "final" / "model.safetensors"), load_file(tmp_path / "b" / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_kl_term_and_distill_data(tiny_target_path, tiny_target, data, tmp_path):
    assert train(tiny_target_path, data, tmp_path / "kl", "--max-steps", "3", "--kl-weight", "0.5",
                 "--head", "shared") == 0
    entry = log_entries(tmp_path / "kl")[-1]
    assert entry["kl_0"] > 0
    assert entry["loss"] == pytest.approx(sum(entry[f"ce_{i}"] + 0.5 * entry[f"kl_{i}"] for i in range(5)), abs=1e-3)
    for mode in ("responses", "next-k"):
        path = tmp_path / f"{mode}.jsonl"
        assert cli.main(["distill", "--target", str(tiny_target_path), "--data", str(data), "--out", str(path),
                         "--mode", mode, "--limit", "6", "--max-new-tokens", "8", "-K", "5", "--no-progress"]) == 0
        out = tmp_path / f"train-{mode}"
        assert train(tiny_target_path, path, out, "--epochs", "2", "--save-every", "100") == 0
        config = json.loads((out / "final" / "config.json").read_text())
        assert config["training"]["data"]["source"] == "distill" and config["training"]["data"]["records"] == 6
        assert log_entries(out)[-1]["labels"] > 0
    assert train(tiny_target_path, tmp_path / "next-k.jsonl", tmp_path / "bad", "--kl-weight", "1") == 2
    assert train(tiny_target_path, tmp_path / "next-k.jsonl", tmp_path / "bad", "-K", "6") == 2


def test_refusals(tiny_target_path, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny_target_path, data, out, "--max-steps", "2", "--hidden-cache", str(tmp_path / "c")) == 0
    capsys.readouterr()
    assert train(tiny_target_path, data, out, "--max-steps", "2") == 2
    assert "--resume" in capsys.readouterr().err
    assert train(tiny_target_path, data, out, "--max-steps", "2", "--resume", "--lr", "0.01") == 2
    assert "lr 0.001 -> 0.01" in capsys.readouterr().err
    assert train(tiny_target_path, data, tmp_path / "other", "--max-steps", "2", "--seq-len", "40",
                 "--hidden-cache", str(tmp_path / "c")) == 2
    assert "seq_len" in capsys.readouterr().err
    assert train(tiny_target_path, data, tmp_path / "x", "--arch", "medusa", "--head", "shared",
                 "--num-blocks", "0") == 2
    assert train(tiny_target_path, tmp_path / "missing.jsonl", tmp_path / "x") == 2
    assert train(tiny_target_path, data, tmp_path / "x", "--eval-data", str(tmp_path / "missing.jsonl")) == 2
    assert train(tiny_target_path, data, tmp_path / "x", "--eval-data", str(data), "--eval-examples", "0") == 2
    assert "--eval-examples" in capsys.readouterr().err


# ---- two processes ------------------------------------------------------------------------

def test_two_process_launch_with_accelerate(tiny_target_path, tiny_target, data, tmp_path):
    """`accelerate launch` with two CPU processes (DDP over gloo). Note: accelerate's own
    --cpu flag selects its single-process launcher; --multi_gpu with specdraft's
    --device cpu runs torch.distributed on CPU."""
    accelerate = Path(sys.executable).parent / "accelerate"
    program = ["-m", "specdraft"]
    out = tmp_path / "ddp"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", *program,
           "train", "redrafter", "--target", str(tiny_target_path), "--data", str(data), "--out", str(out),
           "--device", "cpu", "--seq-len", "48", "--batch-size", "2", "--epochs", "2", "--save-every", "3",
           "--no-progress", "--hidden-cache", str(tmp_path / "cache")]
    # PYTHONFAULTHANDLER: a rank that aborts (a gloo teardown race was seen once in ~10 suite
    # runs) prints every thread's Python stack into the failure message.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = log_entries(out)
    assert log[-1]["step"] == 2 * math.ceil(train_count(data) / 4)  # 2 epochs, 2 processes x 2 sequences
    checkpoint = sorted((out / "checkpoints").iterdir())[-1]
    assert {"random_states_0.pkl", "random_states_1.pkl", "COMPLETE"} <= {p.name for p in checkpoint.iterdir()}
    assert list((tmp_path / "cache").glob("rank001-*.safetensors"))
    drafter = build_drafter(f"redrafter:{out / 'final'}", tiny_target)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())

