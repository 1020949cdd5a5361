"""``specdraft distill``: the target's own responses (progressive, resumable JSONL) and the
next-K greedy chains, on the tiny random target (no chat template: the plain fallback)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from specdraft import cli
from specdraft.data import encode_conversation, encode_prompt, first_turn, iter_conversations
from specdraft.distill import chain_positions, greedy_chains
from specdraft.drafters import NoDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.sampling import SamplingParams


def tiny_sharegpt(path, n=12, seed=0):
    """A ShareGPT-format file over the tiny vocabulary (t2..t15), some multi-turn."""
    rng = random.Random(seed)
    words = lambda k: " ".join(f"t{rng.randrange(2, 16)}" for _ in range(k))  # noqa: E731
    records = []
    for i in range(n):
        turns = [{"from": "human", "value": words(rng.randrange(2, 6))}, {"from": "gpt", "value": words(6)}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": words(3)}, {"from": "gpt", "value": words(4)}]
        records.append({"id": f"conv{i}", "conversations": turns})
    path.write_text(json.dumps(records))
    return path


def distill(target_path, data, out, *extra) -> int:
    return cli.main(["distill", "--target", str(target_path), "--data", str(data), "--out", str(out),
                     "--no-progress", *extra])


def lines(path) -> list[str]:
    return path.read_text().splitlines()


# ---- next-K chains ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [2, 512])
def test_greedy_chains_equal_step_by_step_greedy_decoding(tiny_target, chunk):
    x = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    positions = [0, 1, 5, 11, 22, 23]
    chains = greedy_chains(tiny_target, x, positions, K=4, chunk=chunk)
    assert chains.shape == (len(positions), 5)
    for t, chain in zip(positions, chains.tolist()):
        seq, expected = x[: t + 1], []
        for _ in range(5):
            nxt = int(tiny_target.model(torch.tensor([seq])).logits[0, -1].argmax())
            expected.append(nxt)
            seq.append(nxt)
        assert chain == expected


def test_next_k_mode_writes_chains_at_assistant_positions_and_resumes(tiny_target_path, tiny_target, tmp_path):
    data = tiny_sharegpt(tmp_path / "sg.json")
    out = tmp_path / "nextk.jsonl"
    assert distill(tiny_target_path, data, out, "--mode", "next-k", "-K", "3", "--limit", "2", "--chunk", "3") == 0
    assert distill(tiny_target_path, data, out, "--mode", "next-k", "-K", "3", "--limit", "4") == 0
    records = [json.loads(line) for line in lines(out)]
    convs = list(iter_conversations(data, "train"))[:4]
    assert [r["prompt_id"] for r in records] == [c.id for c in convs]
    for r, conv in zip(records, convs):
        enc = encode_conversation(tiny_target.tokenizer, conv.messages, 2048, eos_ids=tiny_target.eos_ids)
        assert r["kind"] == "next-k" and r["k"] == 3 and r["input_ids"] == enc.input_ids
        assert r["positions"] == chain_positions(enc.labels) and r["positions"]
        assert r["chains"] == greedy_chains(tiny_target, enc.input_ids, r["positions"], 3).tolist()


# ---- responses ----------------------------------------------------------------------------


def test_responses_are_written_progressively_and_resume_without_duplicates(tiny_target_path, tiny_target,
                                                                           tmp_path, capsys):
    data = tiny_sharegpt(tmp_path / "sg.json")
    out = tmp_path / "resp.jsonl"
    common = ["--temperatures", "0,1", "--max-new-tokens", "8", "--seed", "5", "--batch-size", "3"]
    # A first run "killed" after 3 prompts (6 records), leaving half a line behind.
    assert distill(tiny_target_path, data, out, *common, "--limit", "3") == 0
    first = lines(out)
    assert len(first) == 6
    with open(out, "a") as f:
        f.write(first[0][:25])
    assert distill(tiny_target_path, data, out, *common, "--limit", "5") == 0
    err = capsys.readouterr().err
    assert "6 already in the file" in err
    records = [json.loads(line) for line in lines(out)]
    # The rate counts the tokens this run generated (its 4 records), not the earlier run's.
    new = sum(len(r["response_ids"]) for r in records[6:])
    assert re.search(rf"\b{new} new tokens in \d+ s \(\d+ new tokens/s\)", err), err
    assert lines(out)[:6] == first and len(records) == 10
    convs = list(iter_conversations(data, "train"))[:5]
    assert [(r["prompt_id"], r["temperature"]) for r in records] == \
        [(c.id, t) for c in convs for t in (0.0, 1.0)]
    assert [r["seed"] for r in records] == list(range(5, 15))
    engine = SpeculativeEngine(tiny_target, NoDrafter())
    for r, conv in zip(records, [c for c in convs for _ in (0, 1)]):
        assert r["prompt"] == first_turn(conv)
        assert r["target"] == str(tiny_target_path) and r["max_new_tokens"] == 8
        assert r["response"] == tiny_target.tokenizer.decode(r["response_ids"], skip_special_tokens=True)
        prompt = encode_prompt(tiny_target.tokenizer, r["prompt"])
        assert r["prompt_tokens"] == len(prompt)
        params = SamplingParams(max_new_tokens=8, temperature=r["temperature"], seed=r["seed"])
        result = engine.generate([prompt], params)[0]
        assert r["response_ids"] == result.token_ids and r["finish_reason"] == result.finish_reason


def test_an_interrupted_window_keeps_its_finished_answers(tiny_target_path, tmp_path, monkeypatch, capsys):
    """Ctrl-C / SIGTERM mid-window: the answers finished so far are written (not decoded again),
    and the completed file is line for line the file of one uninterrupted run."""
    data = tiny_sharegpt(tmp_path / "sg.json")
    common = ["--temperatures", "0,1", "--max-new-tokens", "8", "--seed", "3", "--batch-size", "2", "--limit", "6"]
    assert distill(tiny_target_path, data, tmp_path / "whole.jsonl", *common) == 0
    whole = lines(tmp_path / "whole.jsonl")
    run_continuous = SpeculativeEngine.run_continuous

    def interrupted_after(n):
        def run(self, *args, **kwargs):
            finished = 0
            for event in run_continuous(self, *args, **kwargs):
                yield event
                finished += event.result is not None
                if finished == n:
                    raise KeyboardInterrupt
        return run

    out = tmp_path / "parts.jsonl"
    monkeypatch.setattr(SpeculativeEngine, "run_continuous", interrupted_after(5))
    assert distill(tiny_target_path, data, out, *common) == cli.EXIT_INTERRUPTED
    kept = lines(out)
    assert len(kept) == 5 and set(kept) <= set(whole)  # the finished ones, nothing else
    monkeypatch.setattr(SpeculativeEngine, "run_continuous", run_continuous)
    capsys.readouterr()
    assert distill(tiny_target_path, data, out, *common) == 0
    assert "5 already in the file" in capsys.readouterr().err
    assert lines(out) == whole


def test_responses_do_not_depend_on_batch_size(tiny_target_path, tmp_path):
    data = tiny_sharegpt(tmp_path / "sg.json")
    common = ["--temperatures", "0,0.8", "--max-new-tokens", "10", "--limit", "4"]
    assert distill(tiny_target_path, data, tmp_path / "a.jsonl", *common, "--batch-size", "1") == 0
    assert distill(tiny_target_path, data, tmp_path / "b.jsonl", *common, "--batch-size", "8") == 0
    assert lines(tmp_path / "a.jsonl") == lines(tmp_path / "b.jsonl")


def test_greedy_responses_are_the_same_with_any_drafter(tiny_target_path, tmp_path):
    # Sampled responses follow the same distribution with any drafter, but a drafter changes
    # how the random stream is consumed, so only greedy ones are comparable token for token.
    data = tiny_sharegpt(tmp_path / "sg.json")
    common = ["--max-new-tokens", "10", "--limit", "4", "--batch-size", "2"]
    assert distill(tiny_target_path, data, tmp_path / "a.jsonl", *common) == 0
    assert distill(tiny_target_path, data, tmp_path / "b.jsonl", *common, "--drafter", "lookup") == 0
    assert lines(tmp_path / "a.jsonl") == lines(tmp_path / "b.jsonl")


def test_resuming_with_other_settings_is_refused(tiny_target_path, tmp_path, capsys):
    data = tiny_sharegpt(tmp_path / "sg.json")
    out = tmp_path / "resp.jsonl"
    assert distill(tiny_target_path, data, out, "--max-new-tokens", "4", "--limit", "1") == 0
    capsys.readouterr()
    assert distill(tiny_target_path, data, out, "--max-new-tokens", "5", "--limit", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdraft: error:") and "max_new_tokens=4" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert distill(tiny_target_path, data, out, "--mode", "next-k", "--limit", "2") == 2
    assert "'response' records" in capsys.readouterr().err
    assert distill(tiny_target_path, data, tmp_path / "x.jsonl", "--temperatures", "0,-1") == 2


def test_length_order_covers_every_item_once_shortest_first():
    """distill's order within a window: every item once, shortest prompts first, ties in item order."""
    from specdraft.distill import Prompt, WorkItem, length_order

    lengths = [7, 3, 9, 3, 1, 12, 5]
    items = [WorkItem(prompt=Prompt(id=str(i), messages=[], ids=[0] * n), temperature=0.0, seed=i)
             for i, n in enumerate(lengths)]
    order = length_order(items)
    assert sorted(order) == list(range(len(items)))
    assert [lengths[i] for i in order] == sorted(lengths) and order[:3] == [4, 1, 3]  # ties keep item order
