"""JSONL dataset files written progressively and safe to resume.

Each record is one line, written with a single ``write`` and flushed at once, so a crash
can leave at most one incomplete line: the last, without its newline. ``read_records``
ignores such a line; ``JsonlAppender`` cuts it off before appending, so a resumed run
continues on a clean line boundary. An invalid line anywhere *else* is real corruption and
is reported with its line number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from ..errors import SpecdraftError


def _complete_length(path: Path) -> int:
    """Bytes of ``path`` up to and including its last newline."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            f.seek(start)
            block = f.read(end - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                return start + nl + 1
            end = start
    return 0


def iter_records(path: str | Path) -> Iterator[dict]:
    """The JSON objects of a JSONL file in order; an incomplete last line (a crash while
    writing) is skipped, blank lines too."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"data file not found: {path}")
    complete = _complete_length(path)
    with open(path, "rb") as f:
        data = f.read(complete)
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecdraftError(f"{path}:{n}: corrupt line ({getattr(e, 'msg', e)})") from None
        if not isinstance(obj, dict):
            raise SpecdraftError(f"{path}:{n}: each line must be a JSON object")
        yield obj


def read_records(path: str | Path) -> list[dict]:
    return list(iter_records(path))


def sort_records(path: str | Path, key) -> bool:
    """Put the records of a complete JSONL file in the stable order of ``key(record)``,
    byte for byte the same lines, unless they are in that order already; True if the
    file was rewritten. Atomic: the sorted copy is written beside it and renamed over it,
    so an interruption leaves one whole file or the other."""
    path = Path(path)
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    keys = [key(json.loads(line)) for line in lines]
    if all(a <= b for a, b in zip(keys, keys[1:])):
        return False
    order = sorted(range(len(lines)), key=keys.__getitem__)
    tmp = path.with_name(path.name + ".sorting")
    with open(tmp, "wb") as f:
        f.write(b"".join(lines[i] + b"\n" for i in order))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


class JsonlAppender:
    """Append records to a JSONL file, one flushed line each. Opening it drops an
    incomplete last line left by a crash (``dropped_bytes`` says how much)."""

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped_bytes = 0
        if self.path.exists():
            complete = _complete_length(self.path)
            self.dropped_bytes = self.path.stat().st_size - complete
            if self.dropped_bytes:
                os.truncate(self.path, complete)
        self.fsync = fsync
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
