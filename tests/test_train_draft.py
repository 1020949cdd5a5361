"""``specdraft train draft``: the draft's shape and initialisation, pretraining, distillation
fine-tuning with each loss, exact resumption, DDP, and the saved folder as a drafter (ours
and transformers' assisted generation). Tiny random target (vocab 16), synthetic data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft import SamplingParams, SpeculativeEngine, cli
from specdraft.drafters import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter, parameter_count
from specdraft.drafters.registry import build_drafter
from specdraft.train.draft import (DraftShape, TargetFacts, build_draft, choose_shape, embedding_basis,
                                   load_draft)

PROMPTS = [[1, 4, 5, 1], [1, 9, 3, 8, 2, 1], [1, 7, 1]]
SMALL = ["--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32"]


def cyclic_text(path: Path, lines: int = 60, seed: int = 0) -> Path:
    """Lines counting through t2..t15 cyclically from a random start: learnable."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        start = rng.randrange(14)
        out.append(" ".join(f"t{2 + (start + j) % 14}" for j in range(rng.randrange(6, 12))))
    path.write_text("\n".join(out) + "\n")
    return path


def sharegpt(path: Path, n: int = 16, seed: int = 0) -> Path:
    rng = random.Random(seed)
    records = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(f"t{rng.randrange(2, 16)}" for _ in range(rng.randrange(3, 7)))},
        {"from": "gpt", "value": "t2 t3"}]} for i in range(n)]
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def distilled(tiny_target_path, tmp_path_factory) -> Path:
    """The tiny target's own answers (T = 0 and 1) to 16 prompts: the fine-tuning data."""
    root = tmp_path_factory.mktemp("draft-data")
    out = root / "responses.jsonl"
    assert cli.main(["distill", "--target", str(tiny_target_path), "--data", str(sharegpt(root / "sg.json")),
                     "--out", str(out), "--temperatures", "0,1", "--max-new-tokens", "12", "--limit", "16",
                     "--no-progress"]) == 0
    return out


def train(target_path, out, *extra) -> int:
    return cli.main(["train", "draft", "--target", str(target_path), "--out", str(out), "--no-progress",
                     "--batch-size", "4", *extra])


def entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy(target, drafter):
    params = SamplingParams(max_new_tokens=16)
    return [r.token_ids for r in SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(PROMPTS, params)]


# ---- shape and initialisation ----------------------------------------------------------------


def test_default_shape_is_within_ten_percent_of_the_target():
    smol = TargetFacts(vocab=49152, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, tied=True,
                       parameters=134_515_008)
    shape, how = choose_shape(smol)
    assert shape == DraftShape(layers=4, hidden=192, heads=3, kv_heads=1, head_dim=64, intermediate=512,
                               tie_embeddings=True)
    assert shape.parameters(smol.vocab) == 11_011_776 and "default" in how  # 8.2% of SmolLM2-135M
    llama7b = TargetFacts(vocab=32000, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                          tied=False, parameters=6_738_415_616)
    shape, _ = choose_shape(llama7b)  # the paper's ~115M drafter: 4 layers, hidden 1024, 8 heads, MLP 2816
    assert (shape.layers, shape.hidden, shape.heads, shape.intermediate, shape.tie_embeddings) == (4, 1024, 8, 2816,
                                                                                                  False)
    assert shape.parameters(llama7b.vocab) < 0.02 * llama7b.parameters
    assert choose_shape(smol, layers=2)[0].hidden == 192  # 256 would be 14.2M (10.5%)
    assert choose_shape(smol, max_fraction=0.3)[0].hidden == 512


@pytest.mark.parametrize("tie", [False, True])
def test_built_draft_is_a_llama_with_the_counted_parameters(tiny_target, tie):
    facts = TargetFacts.of(tiny_target)
    assert facts.parameters == parameter_count(tiny_target.model) and not facts.tied
    shape, _ = choose_shape(facts, hidden=16, layers=2, tie=tie)
    draft = build_draft(tiny_target, shape, from_target=True)
    assert type(draft).__name__ == "LlamaForCausalLM"
    assert parameter_count(draft) == shape.parameters(facts.vocab)
    assert draft.config.vocab_size == 16 and draft.config.eos_token_id == 0
    basis = embedding_basis(torch.cat([tiny_target.model.get_input_embeddings().weight,
                                       tiny_target.head.weight]).float(), 16)
    torch.testing.assert_close(basis.T @ basis, torch.eye(16), atol=1e-5, rtol=0)
    torch.testing.assert_close(draft.get_output_embeddings().weight, tiny_target.head.weight @ basis)


def test_copying_every_layer_reproduces_the_target(tiny_target):
    facts = TargetFacts.of(tiny_target)
    shape, _ = choose_shape(facts, copy_layers=[0, 1])
    assert (shape.hidden, shape.layers, shape.intermediate) == (32, 2, 64)
    draft = build_draft(tiny_target, shape, copy_layers=[0, 1])
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, tiny_target.model(ids).logits)
    drafter = DraftModelDrafter(draft, gamma=3, tokenizer=tiny_target.tokenizer)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())


# ---- pretraining ------------------------------------------------------------------------------


def test_text_corpora_files_html_gz_and_packing(tmp_path):
    import gzip

    from specdraft.data.text import expand_paths, html_to_text, iter_file_documents, pack, read_document

    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("t2 t3\n")
    (root / "sub" / "b.html").write_text("<html><head><title>x</title><style>p{}</style></head><body>"
                                         "<h1>Title</h1><p>one &amp; two\n three</p><script>no()</script>"
                                         "<pre>  keep\n   indent</pre></body></html>")
    (root / "sub" / "c.1.gz").write_bytes(gzip.compress(b"man page\n"))
    (root / "d.bin").write_bytes(b"\0\1\2")
    (root / "e.png").write_bytes(b"\x89PNG")
    files = expand_paths([str(root)])
    assert [p.relative_to(root).as_posix() for p in files] == ["a.txt", "sub/b.html", "sub/c.1.gz"]
    assert expand_paths([str(root / "**" / "*.html"), str(root / "sub" / "b.html")]) == [root / "sub" / "b.html"]
    text = html_to_text((root / "sub" / "b.html").read_text())
    assert "Title" in text and "one & two three" in text and "  keep\n   indent" in text
    assert "no()" not in text and "p{}" not in text and "x" not in text.split()
    assert read_document(root / "sub" / "c.1.gz") == "man page\n" and read_document(root / "d.bin") is None
    assert [name for name, _ in iter_file_documents(files)] == [str(p) for p in files]
    assert pack(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pretrain_lowers_the_lm_loss_and_saves_a_hf_draft(tiny_target_path, tiny_target, distilled, tmp_path):
    text = cyclic_text(tmp_path / "corpus.txt")
    out = tmp_path / "pre"
    assert train(tiny_target_path, out, "--stage", "pretrain", "--text", str(text), "--seq-len", "16",
                 "--epochs", "8", "--lr", "1e-2", "--log-every", "4", "--eval-every", "20", *SMALL) == 0
    log = entries(out / "log.jsonl")
    assert log[-1]["loss"] < 0.6 * log[0]["loss"] and log[-1]["acc1"] > log[0]["acc1"]
    evals = entries(out / "eval.jsonl")
    assert evals[0]["step"] == 0 and evals[-1]["step"] == log[-1]["step"]
    assert evals[-1]["eval_ce"] < evals[0]["eval_ce"]
    assert {"eval_accept", "eval_tau", "eval_mbsu", "eval_greedy_accept"} <= set(evals[-1])
    final = out / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "specdraft.json"} <= {p.name for p in final.iterdir()}
    meta = json.loads((final / "specdraft.json").read_text())
    assert meta["stages"][0]["stage"] == "pretrain" and meta["stages"][0]["data"]["text"]["files"] == 1
    drafter = build_drafter(f"draft:{final}", tiny_target)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())
    # the next stage continues this folder and records both stages
    ft = tmp_path / "ft"
    assert train(tiny_target_path, ft, "--stage", "finetune", "--data", str(distilled), "--draft", str(final),
                 "--max-steps", "2") == 0
    meta = json.loads((ft / "final" / "specdraft.json").read_text())
    assert [s["stage"] for s in meta["stages"]] == ["pretrain", "finetune"] and meta["init"]["source"] == str(final)


# ---- fine-tuning --------------------------------------------------------------------------------


@pytest.mark.parametrize("loss, variant", [("fkl", "exact"), ("rkl", "exact"), ("tvd", "exact"),
                                           ("tvdpp", "exact"), ("tvdpp", "sampled"), ("tvdpp", "uniform")])
def test_finetune_lowers_the_loss_and_raises_heldout_acceptance(tiny_target_path, distilled, tmp_path, loss, variant):
    out = tmp_path / "ft"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--loss", loss,
                 "--tvdpp-variant", variant, "--heldout-fraction", "0.25", "--epochs", "12", "--lr", "2e-2",
                 "--log-every", "3", "--eval-every", "0", *SMALL) == 0
    log = entries(out / "log.jsonl")
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]
    evals = entries(out / "eval.jsonl")
    assert len(evals) == 2 and evals[-1]["eval_accept"] > evals[0]["eval_accept"] + 0.05
    config = json.loads((out / "final" / "specdraft.json").read_text())
    assert config["stages"][-1]["loss"] == loss and config["stages"][-1]["data"]["source"] == "distill"
    assert config["stages"][-1]["data"]["heldout_records"] > 0


def test_heldout_greedy_walk_is_the_engines_greedy_tau(tiny_target_path, tiny_target, distilled, tmp_path):
    """The evaluator's replayed walk on the target's greedy answers gives the engine's own
    greedy τ at each γ: the same tokens, and steps within one per answer (the engine's
    prefill emits the first token alone)."""
    from drafters_for_tests import engine_forwards, greedy_answer_file

    from specdraft.data.sharegpt import iter_conversations
    from specdraft.train.draft import Evaluator
    from specdraft.train.examples import record_examples

    answers = tmp_path / "answers.jsonl"
    prompts = [c.messages[:1] for c in iter_conversations(sharegpt(tmp_path / "sg.json"), "train")][:10]
    records = greedy_answer_file(tiny_target, prompts, answers)
    out = tmp_path / "ft"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(answers), "--epochs", "6",
                 "--lr", "2e-2", "--heldout-fraction", "0", *SMALL) == 0
    examples = record_examples(records, tiny_target.tokenizer, 1024, 1, {"path": str(answers)})
    examples = [examples[i] for i in range(len(examples))]
    draft, _ = load_draft(out / "final", tiny_target)
    evaluator = Evaluator(examples, tiny_target, batch_size=4, chunk=64, gamma=3, target_parameters=1)
    found = evaluator.fields(evaluator.sums(draft).tolist(), draft)
    answer_tokens = sum(len(r["response_ids"]) for r in records)
    for gamma in (1, 2, 3):
        steps = engine_forwards(tiny_target, DraftModelDrafter.load(out / "final", tiny_target, gamma=gamma),
                                records, examples)
        walk_steps = answer_tokens / found[f"eval_tau_walk_g{gamma}"]
        assert abs(steps - walk_steps) < 0.05, (gamma, steps, walk_steps)
    assert found["eval_tau_walk_g3"] > 1.0  # the draft does get some right: the check has teeth


def test_on_policy_finetune(tiny_target_path, distilled, tmp_path):
    """Prompts continued by the draft itself, scored by the target."""
    out = tmp_path / "onp"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--loss", "fkl",
                 "--on-policy", "--on-policy-tokens", "8", "--heldout-fraction", "0.25", "--epochs", "10",
                 "--lr", "2e-2", "--log-every", "3", "--eval-every", "0", *SMALL) == 0
    log = entries(out / "log.jsonl")
    assert log[-1]["loss"] < 0.8 * log[0]["loss"] and all(e["positions"] > 0 for e in log)
    evals = entries(out / "eval.jsonl")
    assert evals[-1]["eval_accept"] > evals[0]["eval_accept"] + 0.05
    assert json.loads((out / "final" / "specdraft.json").read_text())["stages"][-1]["on_policy"] is True
    assert train(tiny_target_path, tmp_path / "x", "--stage", "finetune", "--data", str(distilled), "--on-policy",
                 "--hidden-cache", str(tmp_path / "c")) == 2


def test_resumed_run_equals_an_uninterrupted_one(tiny_target_path, distilled, tmp_path):
    common = ["--stage", "finetune", "--data", str(distilled), "--loss", "tvdpp", "--tvdpp-variant", "sampled",
              "--epochs", "3", "--grad-accum", "2", "--save-every", "2", "--log-every", "1", "--eval-every", "2",
              "--init-from-target", "--tie-embeddings", *SMALL]
    assert train(tiny_target_path, tmp_path / "a", *common, "--hidden-cache", str(tmp_path / "ca")) == 0
    assert train(tiny_target_path, tmp_path / "b", *common, "--hidden-cache", str(tmp_path / "cb"),
                 "--stop-after-steps", "3") == 0
    assert not (tmp_path / "b" / "final").exists()
    assert train(tiny_target_path, tmp_path / "b", *common, "--hidden-cache", str(tmp_path / "cb"), "--resume") == 0
    a, b = (load_file(tmp_path / x / "final" / "model.safetensors") for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda es: [{k: v for k, v in e.items() if "per_s" not in k and k != "seconds"} for e in es]  # noqa: E731
    assert strip(entries(tmp_path / "a" / "log.jsonl")) == strip(entries(tmp_path / "b" / "log.jsonl"))
    assert entries(tmp_path / "a" / "eval.jsonl") == entries(tmp_path / "b" / "eval.jsonl")


def test_saved_draft_is_a_transformers_assistant_model(tiny_target_path, tiny_target, distilled, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ft"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--max-steps", "3",
                 "--loss", "fkl", "--save-dtype", "bfloat16", *SMALL) == 0
    from safetensors import safe_open

    with safe_open(str(out / "final" / "model.safetensors"), "pt") as f:  # shipped at half the size
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    draft, meta = load_draft(out / "final", tiny_target)
    assert meta["kind"] == "draft-model" and meta["target"]["vocab_size"] == 16
    assert draft.dtype == torch.float32  # loaded at the target's dtype
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_path))
    assistant = AutoModelForCausalLM.from_pretrained(str(out / "final"))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0,
                  eos_token_id=0)
        assert torch.equal(target.generate(ids, **kw), target.generate(ids, assistant_model=assistant, **kw))
    drafter = DraftModelDrafter.load(out / "final", tiny_target, gamma=3)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())


@pytest.mark.parametrize("tie", ["--tie-embeddings", "--no-tie-embeddings"])
def test_a_draft_borrowing_the_targets_embeddings_stores_only_its_own_layers(tiny_target_path, tiny_target,
                                                                              distilled, tmp_path, tie):
    """--embeddings target: trained with the target's matrices frozen, saved without them,
    loaded sharing the target's storage; --draft-vocab: drafts only over the N most frequent
    answer tokens. Greedy output stays the target's."""
    out = tmp_path / "borrow"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--max-steps", "4",
                 "--loss", "tvd", "--copy-layers", "1", "--layers", "1", tie, "--embeddings", "target",
                 "--draft-vocab", "8", "--lr", "1e-2", "--save-dtype", "bfloat16") == 0
    final = out / "final"
    weights = load_file(final / "model.safetensors")
    assert weights and not {"model.embed_tokens.weight", "lm_head.weight"} & set(weights)
    meta = json.loads((final / "specdraft.json").read_text())
    assert meta["embeddings"] == "target" and meta["draft_vocab"]["size"] == 8
    assert meta["parameters"] == sum(w.numel() for w in weights.values())
    evals = entries(out / "eval.jsonl")  # labels outside the vocabulary leave the CE, never make it NaN
    assert evals and all(e["eval_ce"] == e["eval_ce"] and e["eval_ce"] < float("inf") for e in evals)
    drafter = DraftModelDrafter.load(final, tiny_target, gamma=3)
    model = drafter.draft.model
    assert model.get_output_embeddings().weight.data_ptr() == tiny_target.head.weight.data_ptr()  # shared
    if tie == "--no-tie-embeddings":
        assert (model.get_input_embeddings().weight.data_ptr()
                == tiny_target.model.get_input_embeddings().weight.data_ptr())
    assert drafter.num_parameters == meta["parameters"]
    logits = drafter._logits(torch.randn(5, tiny_target.hidden_size))
    assert logits.shape == (5, 8)  # only the 8 draft tokens' rows are multiplied...
    widened = drafter._widen(logits.softmax(dim=-1))  # ...and a q over them is zero elsewhere
    assert torch.equal(widened > 0, drafter.vocab.t2d.expand(5, -1))
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())
    # The layer trained (the run did something) while the borrowed matrices did not move.
    trained, _ = load_draft(final, tiny_target)
    layer = tiny_target.base.layers[1].mlp.down_proj.weight
    assert not torch.allclose(trained.model.layers[0].mlp.down_proj.weight, layer.float(), atol=1e-3)
    # `export hf`: a standalone folder (matrices written back) that transformers loads as is
    # and uses as an assistant model; its logits are the borrowing draft's.
    from transformers import AutoModelForCausalLM

    assert cli.main(["export", "hf", "--drafter", str(final), "--target", str(tiny_target_path),
                     "--out", str(tmp_path / "alone")]) == 0
    alone = AutoModelForCausalLM.from_pretrained(str(tmp_path / "alone"))
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.allclose(alone(ids).logits, trained(ids).logits, atol=1e-5)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_path))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=0)
    assert torch.equal(target.generate(ids, **kw), target.generate(ids, assistant_model=alone, **kw))


def test_refusals(tiny_target_path, distilled, tmp_path, capsys):
    nextk = tmp_path / "nextk.jsonl"
    nextk.write_text(json.dumps({"kind": "next-k", "prompt_id": "a", "input_ids": [1, 2], "positions": [0],
                                 "chains": [[2, 3]], "k": 1}) + "\n")
    assert train(tiny_target_path, tmp_path / "x", "--stage", "finetune", "--data", str(nextk)) == 2
    assert "responses" in capsys.readouterr().err
    assert train(tiny_target_path, tmp_path / "x", "--stage", "pretrain") == 2
    assert "--text" in capsys.readouterr().err
    assert train(tiny_target_path, tmp_path / "x", "--stage", "finetune", "--data", str(distilled),
                 "--draft", str(tiny_target_path), "--hidden", "16") == 2
    assert train(tiny_target_path, tmp_path / "x", "--stage", "finetune", "--data", str(distilled),
                 "--copy-layers", "0,7") == 2
    assert "no layer 7" in capsys.readouterr().err
    out = tmp_path / "run"
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--max-steps", "1",
                 *SMALL) == 0
    capsys.readouterr()
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--max-steps", "1",
                 *SMALL) == 2
    assert "--resume" in capsys.readouterr().err
    assert train(tiny_target_path, out, "--stage", "finetune", "--data", str(distilled), "--max-steps", "1",
                 "--resume", "--loss", "fkl", *SMALL) == 2
    assert "loss" in capsys.readouterr().err


# ---- two processes ------------------------------------------------------------------------------


def test_two_process_launch_with_accelerate(tiny_target_path, tiny_target, distilled, tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    out = tmp_path / "ddp"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", "-m", "specdraft",
           "train", "draft", "--stage", "finetune", "--target", str(tiny_target_path), "--data", str(distilled),
           "--out", str(out), "--device", "cpu", "--batch-size", "2", "--epochs", "2", "--save-every", "3",
           "--heldout-fraction", "0.25", "--no-progress", *SMALL]
    # PYTHONFAULTHANDLER: a rank that aborts (a gloo teardown race was seen once in ~10 suite
    # runs) prints every thread's Python stack into the failure message.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = entries(out / "log.jsonl")
    args = json.loads((out / "train_args.json").read_text())
    assert log[-1]["step"] == 2 * -(-args["data"]["records"] // 4)  # 2 epochs, 2 processes x 2 sequences
    assert entries(out / "eval.jsonl")[-1]["eval_positions"] > 0
    checkpoint = sorted((out / "checkpoints").iterdir())[-1]
    assert {"random_states_0.pkl", "random_states_1.pkl", "COMPLETE"} <= {p.name for p in checkpoint.iterdir()}
    drafter = build_drafter(f"draft:{out / 'final'}", tiny_target)
    assert greedy(tiny_target, drafter) == greedy(tiny_target, NoDrafter())
