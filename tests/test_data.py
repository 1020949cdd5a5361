"""Training data: the streaming ShareGPT decoder, normalisation and split, chat rendering
with assistant-only masks (real SmolLM2 tokenizer; the tiny tokenizer's plain fallback),
and resumable JSONL files."""

from __future__ import annotations

import io
import itertools
import json

import pytest

from specdraft.data import (IGNORE, JsonlAppender, encode_conversation, encode_prompt, first_turn,
                            iter_conversations, iter_json_array, iter_records, normalise, read_records,
                            render, sharegpt_path, split_of)
from specdraft.data.sharegpt import StreamStats
from specdraft.errors import SpecdraftError
from conftest import make_tiny_tokenizer


def record(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


# ---- streaming decode ---------------------------------------------------------------------

RECORDS = [record("a_0", ("human", "hi [1, 2] {x}"), ("gpt", "hello, \"world\" ]")),
           record("b", ("user", "q"), ("chatgpt", "a" * 50)),
           {"id": "n", "values": [1.5, -2e3, True, None]}]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_stream_decodes_every_whole_record_and_reports_the_cut_tail(chunk):
    whole = json.dumps(RECORDS, indent=2)
    cut = whole[: whole.rindex('"values"') + 12]  # the last record is cut mid-array
    stats = StreamStats()
    got = list(iter_json_array(io.StringIO(cut), stats, chunk_chars=chunk))
    assert got == RECORDS[:2]
    assert stats.records == 2 and not stats.closed
    assert stats.truncated_chars == len(cut) - cut.rindex("{")


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_stream_reads_a_complete_array_and_numbers_across_chunks(chunk):
    text = "  [ 123456 , {\"a\": [1,2]},\n 7.25e1 ,\"s\" ]  "
    stats = StreamStats()
    assert list(iter_json_array(io.StringIO(text), stats, chunk_chars=chunk)) == [123456, {"a": [1, 2]}, 72.5, "s"]
    assert stats.closed and stats.truncated_chars == 0


def test_stream_rejects_a_non_array():
    with pytest.raises(SpecdraftError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


# ---- normalisation and split --------------------------------------------------------------


def test_normalise_maps_roles_merges_and_trims():
    conv, why = normalise(record(
        "x_2", ("gpt", "continuation of an earlier part"), ("human", "Q1"), ("user", "more"), ("bard", ""),
        ("gpt", "A1"), ("chatgpt", "A1b"), ("human", "Q2"), ("bing", "A2"), ("human", "dangling")))
    assert why == ""
    assert conv.id == "x_2" and conv.group == "x"
    assert conv.messages == [{"role": "user", "content": "Q1\n\nmore"}, {"role": "assistant", "content": "A1\n\nA1b"},
                             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
    conv, _ = normalise(record(7, ("system", "be brief"), ("human", "Q"), ("gpt", "A")))
    assert conv.id == "7" and [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert first_turn(conv) == conv.messages[:2]


@pytest.mark.parametrize("rec, reason", [
    (record("e"), "empty"),
    (record("g", ("gpt", "only an answer")), "no user/assistant exchange"),
    (record("h", ("human", "only a question"), ("gpt", "  ")), "no user/assistant exchange"),
    (record("u", ("human", "q"), ("wizard", "a")), "unknown role"),
    (record("s", ("human", "q"), ("system", "late"), ("gpt", "a")), "misplaced system message"),
    ({"id": "m", "conversations": [{"from": "human", "value": 3}]}, "malformed"),
    ({"conversations": []}, "malformed"),
    ("not a dict", "malformed"),
])
def test_normalise_skips_empty_and_malformed(rec, reason):
    assert normalise(rec) == (None, reason)


def test_split_is_deterministic_by_group_and_disjoint(tmp_path):
    groups = [f"g{i}" for i in range(400)]
    held = {g for g in groups if split_of(g, 0.25) == "heldout"}
    assert 60 < len(held) < 140  # about a quarter
    assert held == {g for g in groups if split_of(g, 0.25) == "heldout"}
    records = [record(f"{g}_{part}", ("human", "q"), ("gpt", "a")) for g in groups[:100] for part in range(2)]
    records.append(records[0])  # a duplicate id keeps its first record
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    stats = StreamStats()
    train = [c.id for c in iter_conversations(path, "train", 0.25, stats)]
    heldout = [c.id for c in iter_conversations(path, "heldout", 0.25)]
    assert stats.skipped["duplicate id"] == 1
    assert not set(train) & set(heldout) and len(train) + len(heldout) == 200
    assert {i.rsplit("_", 1)[0] for i in heldout} == held & set(groups[:100])  # parts stay together


def test_real_sharegpt_package_first_records():
    path = sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.stat().st_size > 100_000_000
    with open(path, encoding="utf-8") as f:
        first = list(itertools.islice(iter_json_array(f, chunk_chars=1 << 16), 50))
    assert len(first) == 50 and first[0]["id"] == "QWJhYvA_0"
    convs = [c for c, _ in map(normalise, first) if c is not None]
    assert len(convs) >= 40
    for c in convs:
        roles = [m["role"] for m in c.messages if m["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))


def test_real_sharegpt_whole_file_is_read_up_to_its_cut():
    stats = StreamStats()
    kept = sum(1 for _ in iter_conversations(split="all", stats=stats))
    assert stats.records == 17671 and stats.truncated_chars > 0 and not stats.closed
    assert kept == stats.kept == 17390 and sum(stats.skipped.values()) == stats.records - kept
    assert "incomplete last record" in stats.summary()


# ---- chat rendering and masks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from specdraft.models import default_target_path

    return AutoTokenizer.from_pretrained(str(default_target_path()))


CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course!\n\nAsk more."}]


def assistant_runs(tokenizer, enc) -> list[str]:
    """The decoded runs of consecutive labelled tokens."""
    runs, current = [], []
    for tok, lab in zip(enc.input_ids, enc.labels):
        if lab != IGNORE:
            assert lab == tok
            current.append(tok)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("system", [False, True])
def test_smollm2_assistant_masks(smol_tokenizer, system):
    messages = ([{"role": "system", "content": "Be terse."}] if system else []) + CHAT
    enc = encode_conversation(smol_tokenizer, messages)
    ids = smol_tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert enc.input_ids == list(ids)
    assert assistant_runs(smol_tokenizer, enc) == ["It is 4.<|im_end|>", "6, of course!\n\nAsk more.<|im_end|>"]
    # The generation prompt is exactly the text before the first answer.
    prompt = encode_prompt(smol_tokenizer, messages[:-3])
    assert enc.input_ids[: len(prompt)] == prompt and enc.labels[len(prompt)] != IGNORE
    assert all(x == IGNORE for x in enc.labels[: len(prompt)])


def test_smollm2_truncation(smol_tokenizer):
    full = encode_conversation(smol_tokenizer, CHAT)
    first_answer = full.labels.index(next(x for x in full.labels if x != IGNORE))
    cut = encode_conversation(smol_tokenizer, CHAT, max_length=first_answer + 2)
    assert cut.input_ids == full.input_ids[: first_answer + 2] and cut.num_assistant_tokens == 2
    assert encode_conversation(smol_tokenizer, CHAT, max_length=first_answer) is None
    assert encode_conversation(smol_tokenizer, CHAT, max_length=first_answer, require_assistant=False).labels == \
        [IGNORE] * first_answer


def test_plain_template_fallback_on_a_tokenizer_without_one():
    tok = make_tiny_tokenizer(16)
    assert not getattr(tok, "chat_template", None)
    messages = [{"role": "user", "content": "t4 t5"}, {"role": "assistant", "content": "t6 t7"},
                {"role": "user", "content": "t8"}, {"role": "assistant", "content": "t9"}]
    assert render(tok, messages[:1], add_generation_prompt=True) == "user: t4 t5\nassistant:"
    enc = encode_conversation(tok, messages)
    # user: -> unk t1; the assistant's EOS (t0) is trained, the newline after it is not a token.
    assert enc.input_ids == [1, 4, 5, 1, 6, 7, 0, 1, 8, 1, 9, 0]
    assert enc.labels == [IGNORE] * 4 + [6, 7, 0] + [IGNORE] * 3 + [9, 0]
    assert encode_prompt(tok, messages[:1]) == [1, 4, 5, 1]


def test_a_template_that_rewrites_history_is_refused():
    tok = make_tiny_tokenizer(16)
    # Shows only the last message: earlier turns vanish as the conversation grows.
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %} t3{% endif %}"
    with pytest.raises(SpecdraftError, match="incrementally"):
        encode_conversation(tok, [{"role": "user", "content": "t4"}, {"role": "assistant", "content": "t5"},
                                  {"role": "user", "content": "t6"}, {"role": "assistant", "content": "t7"}])


# ---- JSONL ----------------------------------------------------------------------------------


def test_jsonl_appender_discards_a_cut_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    with JsonlAppender(path) as w:
        w.write({"i": 0, "text": "é"})
        w.write({"i": 1})
    with open(path, "a") as f:
        f.write('{"i": 2, "tex')  # a crash mid-line
    assert [r["i"] for r in iter_records(path)] == [0, 1]
    with JsonlAppender(path) as w:
        assert w.dropped_bytes == len('{"i": 2, "tex')
        w.write({"i": 2})
    assert [r["i"] for r in read_records(path)] == [0, 1, 2]
    assert path.read_text().count("\n") == 3


def test_jsonl_corruption_inside_the_file_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"i": 0}\n{"i": \n{"i": 2}\n')
    with pytest.raises(SpecdraftError, match=":2: corrupt line"):
        read_records(path)
    path.write_text('[1]\n')
    with pytest.raises(SpecdraftError, match="JSON object"):
        read_records(path)
    with pytest.raises(SpecdraftError, match="not found"):
        read_records(tmp_path / "missing.jsonl")
