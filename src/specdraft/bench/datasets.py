"""The prompt sets a benchmark runs on, by name, and how they become token ids.

Names: ``mt-bench`` (80 first turns, or both turns with ``turns=2``), ``humaneval``
(164 function stubs), ``sharegpt-heldout`` (first user turns of the held-out split of
``specdraft.data.sharegpt``) or a path to a JSONL file of {"prompt": ..., "id": ...} objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import prompts as prompt_sets
from ..errors import SpecdraftError

NAMED = ("mt-bench", "humaneval", "sharegpt-heldout")


@dataclass
class BenchPrompt:
    """One prompt of a set: its id, text, and (MT-Bench turn 2) the follow-up question."""

    id: object
    text: str
    follow_up: str | None = None
    ids: list[int] = field(default_factory=list)  # the token ids measured (set by encode)


def dataset_label(spec: str) -> str:
    """A short name for reports: the set's name, or the JSONL file's stem."""
    return spec if spec in NAMED else Path(spec).stem


def load_items(spec: str, chat: bool, turns: int = 1, limit: int | None = None) -> list[dict]:
    """[{'id', 'prompt'[, 'turns']}] of a named set or a JSONL file (``limit`` is a hint:
    only sets that are slow to read stop early)."""
    if turns not in (1, 2):
        raise SpecdraftError(f"--mt-bench-turns must be 1 or 2, got {turns}")
    if spec == "mt-bench":
        return prompt_sets.mtbench_two_turns() if turns == 2 else prompt_sets.mtbench_first_turns()
    if spec == "humaneval":
        return prompt_sets.humaneval_prompts(instruction=chat)
    if spec == "sharegpt-heldout":
        return prompt_sets.sharegpt_heldout_prompts(limit)  # streams a 125 MB file: stop early
    if spec.endswith(".jsonl") or Path(spec).exists():
        return prompt_sets.read_prompts_file(spec)
    raise SpecdraftError(f"unknown dataset {spec!r}; choose one of {', '.join(NAMED)} or a FILE.jsonl")


def load_prompts(spec: str, limit: int | None, chat: bool, turns: int = 1) -> list[BenchPrompt]:
    """The first ``limit`` prompts of a set (all when None)."""
    items = load_items(spec, chat, turns, limit)
    if limit is not None:
        items = items[:limit]
    follow = turns == 2 and spec == "mt-bench"
    return [BenchPrompt(id=it["id"], text=it["prompt"], follow_up=it["turns"][1] if follow else None)
            for it in items]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the chat template, ready for the assistant."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdraftError("this target has no chat template; MT-Bench turn 2 needs one")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_first_turns(target, items: list[BenchPrompt], chat: bool) -> list[list[int]]:
    """Token ids of each prompt's first (or only) turn, all checked before measuring."""
    return [target.encode_decodable(item.id, item.text, chat) for item in items]


def second_turn_ids(target, item: BenchPrompt, first_answer: str) -> list[int]:
    """The conversation [question 1, the model's answer, question 2] as token ids."""
    return chat_ids(target.tokenizer, [{"role": "user", "content": item.text},
                                       {"role": "assistant", "content": first_answer},
                                       {"role": "user", "content": item.follow_up}])
