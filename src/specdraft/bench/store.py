"""results.json: written atomically after every finished row, read back by --resume.

A reader never sees a half-written file: the JSON goes to a temporary file in the same
folder, is flushed to disk, and replaces the old one by rename (atomic on POSIX).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..errors import SpecdraftError

RESULTS = "results.json"


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` so that the file is always whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(value):
    """Numbers from torch/numpy and other odd values as plain JSON."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def row_key(row: dict) -> tuple:
    """What identifies a row within one run's settings."""
    return (row["drafter"], row["dataset"], float(row["temperature"]), int(row["batch_size"]))


def load_for_resume(out: Path, settings: dict) -> dict | None:
    """The previous results in ``out`` if they were measured with the same settings."""
    path = Path(out) / RESULTS
    if not path.is_file():
        return None
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecdraftError(f"{path} is corrupt ({e}); remove it or drop --resume") from None
    old = previous.get("settings", {})
    changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if changed:
        raise SpecdraftError(f"{path} was measured with other settings ({', '.join(changed)} differ); "
                             "use another --out or drop --resume")
    return previous
