"""Retrieval drafting: the datastore's n-gram index, the drafter's frequency trie, the
datastore's files and the ``specdraft datastore`` command. Exactness (greedy and the sampled
law) is in test_sampling_exact.py, with the other drafters."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.datastore import SEPARATOR, Datastore
from specdraft.drafters.base import DraftContext
from specdraft.drafters.registry import build_drafter
from specdraft.drafters.retrieval import RetrievalDrafter
from specdraft.errors import SpecdraftError

S = SEPARATOR


def conts(store, history, depth):
    n, c = store.continuations(torch.tensor(history), depth)
    return n, sorted(c.tolist())


def test_the_docstring_example():
    store = Datastore.from_answers([[5, 7, 9], [5, 7, 2]], vocab_size=16, max_ngram=2)
    assert store.tokens.tolist() == [5, 7, 9, S, 5, 7, 2, S]
    assert conts(store, [1, 5, 7], 2) == (2, [[2, S], [9, S]])


def test_the_longest_matching_ngram_wins_and_separators_are_not_crossed():
    store = Datastore.from_answers([[1, 2, 3, 4], [9, 2, 3, 8, 8]], vocab_size=16, max_ngram=3)
    assert conts(store, [1, 2, 3], 2) == (3, [[4, S]])  # only the first answer has 1 2 3
    assert conts(store, [7, 2, 3], 2) == (2, [[4, S], [8, 8]])
    # 4 ends the first answer and 9 starts the second: "4 9" is not an n-gram of the store.
    assert conts(store, [4, 9], 1) == (1, [[2]])
    assert conts(store, [5, 6], 1) == (0, [])


def test_a_key_must_fit_63_bits():
    Datastore.from_answers([[1]], vocab_size=1 << 21, max_ngram=3)  # 3 x 21 bits
    with pytest.raises(SpecdraftError, match="at most 2"):
        Datastore.from_answers([[1]], vocab_size=1 << 22, max_ngram=3)
    with pytest.raises(SpecdraftError, match="outside"):
        Datastore.from_answers([[16]], vocab_size=16)
    with pytest.raises(SpecdraftError, match="outside"):
        Datastore.from_answers([[3, -1, 4]], vocab_size=16)  # not a separator in disguise


def test_the_drafter_reads_the_trie_greedily_by_count():
    """The drafter's docstring example: continuations a b c, a b d, a e f, g h i of 1."""
    a, b, c, d, e, f, g, h, i = range(2, 11)
    store = Datastore.from_answers([[1, a, b, c], [1, a, b, d], [1, a, e, f], [1, g, h, i]], vocab_size=16)
    drafter = RetrievalDrafter(store, beam_width=2, beam_length=4)
    (first, conf1), (second, conf2) = drafter.chains(torch.tensor([0, 1]))
    assert first == [a, b, c] and conf1 == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert second == [g, h, i] and conf2 == pytest.approx([1 / 4, 1, 1])
    ctx = DraftContext(tokens=[torch.tensor([0, 1]), torch.tensor([15])], g0=torch.tensor([1, 15]),
                       hidden=torch.zeros(2, 4), budget=torch.tensor([8, 8]), greedy=torch.tensor([True, True]))
    proposal = drafter.propose(ctx)
    assert proposal.beams[0].tolist() == [[1, a, b, c], [1, g, h, i]]
    assert proposal.valid[1].tolist() == [[True, False, False, False]] * 2  # 15 is nowhere: g0 alone


def test_a_short_continuation_stops_its_beam():
    store = Datastore.from_answers([[1, 2]], vocab_size=16)
    tokens, conf = RetrievalDrafter(store, beam_length=4).chains(torch.tensor([1]))[0]
    assert tokens == [2] and conf == [1.0]


def test_files_round_trip_and_the_drafter_checks_the_vocabulary(tmp_path, tiny_target):
    answers = [[3, 4, 5, 6], [3, 4, 7]]
    Datastore.from_answers(answers, tiny_target.vocab_size).save(tmp_path / "ds", {"target": "tiny"})
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["tokens"] == 7 and config["answers"] == 2 and config["target"] == "tiny"
    drafter = build_drafter(f"retrieval:{tmp_path / 'ds'}", tiny_target, beam_length=3)
    assert isinstance(drafter, RetrievalDrafter) and drafter.L == 3
    assert conts(drafter.store, [3, 4], 2) == (2, [[5, 6], [7, S]])
    Datastore.from_answers(answers, tiny_target.vocab_size + 1).save(tmp_path / "other")
    with pytest.raises(SpecdraftError, match="vocabulary"):
        build_drafter(f"retrieval:{tmp_path / 'other'}", tiny_target)
    with pytest.raises(SpecdraftError, match="no datastore"):
        build_drafter(f"retrieval:{tmp_path / 'missing'}", tiny_target)


def test_in_a_combination_it_keeps_its_own_shape(tmp_path, tiny_target):
    Datastore.from_answers([[3, 4, 5]], tiny_target.vocab_size).save(tmp_path / "ds")
    drafter = build_drafter(f"lookup+retrieval:{tmp_path / 'ds'}", tiny_target, beam_width=3, beam_length=6)
    assert [(p.W, p.L) for p in drafter.parts][1] == (1, 4)


def test_a_datastore_of_distilled_answers(tmp_path, tiny_target_path, tiny_target, capsys):
    """distill -> datastore: the answers' ids as the target generated them."""
    from test_distill import distill, tiny_sharegpt

    from specdraft import cli
    from specdraft.data.jsonl import read_records

    data, answers = tiny_sharegpt(tmp_path / "sg.json"), tmp_path / "answers.jsonl"
    assert distill(tiny_target_path, data, answers, "--max-new-tokens", "24", "--limit", "4") == 0
    assert cli.main(["datastore", "--target", str(tiny_target_path), "--data", str(answers),
                     "--out", str(tmp_path / "ds")]) == 0
    assert "wrote a datastore of 4 answers" in capsys.readouterr().err
    ids = [r["response_ids"] for r in read_records(answers)]
    drafter = build_drafter(f"retrieval:{tmp_path / 'ds'}", tiny_target)
    assert drafter.store.tokens.tolist() == [t for answer in ids for t in answer + [S]]


def test_drafting_from_the_targets_own_answers_keeps_its_output(tiny_target):
    """Drafts from a datastore of the target's greedy answers to the same prompts: greedy
    output stays the target's, and most steps draft right."""
    from specdraft.drafters import NoDrafter
    from specdraft.engine import SpeculativeEngine
    from specdraft.sampling import SamplingParams

    prompts = [[1, 5, 7], [1, 9, 3, 3], [1, 12], [1, 4, 4, 8, 2]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = SpeculativeEngine(tiny_target, NoDrafter()).generate(prompts, params)
    store = Datastore.from_answers([r.token_ids for r in plain], tiny_target.vocab_size)
    engine = SpeculativeEngine(tiny_target, RetrievalDrafter(store, beam_width=2, beam_length=5), max_tree_tokens=None)
    drafted = engine.generate(prompts, params)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert sum(r.steps for r in drafted) < 0.6 * sum(r.steps for r in plain)


@pytest.mark.parametrize("argv, words", [
    (["--data", "missing.jsonl"], ["no such file"]),
    (["--data", "sharegpt", "--sharegpt-limit", "0"], ["--sharegpt-limit"]),
    (["--data", "OTHER"], ["not of the target"]),
    (["--data", "EMPTY"], ["no answers"]),
])
def test_bad_input_is_one_line(tmp_path, tiny_target_path, capsys, argv, words):
    other, empty = tmp_path / "other.jsonl", tmp_path / "empty.jsonl"
    other.write_text(json.dumps({"kind": "response", "target": "someone-else", "response_ids": [1]}) + "\n")
    empty.write_text("")
    argv = [{"OTHER": str(other), "EMPTY": str(empty)}.get(a, a) for a in argv]
    from specdraft import cli

    rc = cli.main(["datastore", "--target", str(tiny_target_path), "--out", str(tmp_path / "ds"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("specdraft: error:") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "ds").exists()


def test_a_missing_datastore_is_one_line_before_the_target_loads(tmp_path, capsys):
    from specdraft import cli

    rc = cli.main(["generate", "--drafter", f"lookup+retrieval:{tmp_path / 'nowhere'}", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "retrieval:" in err and "does not exist" in err and "Traceback" not in err, err


def test_a_shape_recorded_in_the_config_is_the_default(tmp_path, tiny_target):
    Datastore.from_answers([[3, 4, 5]], tiny_target.vocab_size).save(tmp_path / "ds", {"beam_width": 2,
                                                                                       "beam_length": 5})
    assert (lambda d: (d.W, d.L))(build_drafter(f"retrieval:{tmp_path / 'ds'}", tiny_target)) == (2, 5)
    assert (lambda d: (d.W, d.L))(build_drafter(f"retrieval:{tmp_path / 'ds'}", tiny_target, beam_length=3)) == (2, 3)


def test_the_replayed_walk_is_the_engines_greedy_walk(tiny_target):
    """scripts/score_lookup.py replays greedy decoding on recorded answers without the
    target: for token-only drafters its steps are the engine's, step by step (float32)."""
    import importlib.util
    from collections import Counter
    from pathlib import Path

    from specdraft.drafters import NoDrafter
    from specdraft.drafters.combined import CombinedDrafter
    from specdraft.drafters.lookup import LookupDrafter
    from specdraft.engine import SpeculativeEngine
    from specdraft.sampling import SamplingParams

    path = Path(__file__).parents[1] / "scripts" / "score_lookup.py"
    spec = importlib.util.spec_from_file_location("score_lookup", path)
    score_lookup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score_lookup)
    prompts = [[1, 5, 7], [1, 9, 3, 3], [1, 12], [1, 4, 4, 8, 2], [1, 6, 6, 6]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = SpeculativeEngine(tiny_target, NoDrafter()).generate(prompts, params)
    # The store knows two answers, one of them cut short: some steps match fully, some in part, some not.
    store = Datastore.from_answers([plain[0].token_ids, plain[1].token_ids[:10]], tiny_target.vocab_size)
    drafter = CombinedDrafter([LookupDrafter(beam_width=1, beam_length=4), RetrievalDrafter(store, 2, 5)])
    drafted = SpeculativeEngine(tiny_target, drafter, max_tree_tokens=None).generate(prompts, params)
    walks = [score_lookup.walk(drafter, prompt, result.token_ids) for prompt, result in zip(prompts, drafted)]
    for walked, result in zip(walks, drafted):
        steps = [n for n, _, _ in walked]
        # The engine counts its prefill too: a step that gained one token (the answer's first).
        assert Counter(steps) + Counter({1: 1}) == Counter(result.accepted_hist)
        assert len(steps) == result.steps - 1
        assert sum(tree for _, tree, _ in walked) == result.tree_tokens
    assert max(n for walked in walks for n, _, _ in walked) > 1
