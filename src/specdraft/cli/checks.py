"""Argument checks that ``cli.run_command`` runs on every subcommand before it starts any work.

Each subcommand already checks its own numbers (``SamplingParams.validate``,
``check_shapes``, ...); what is checked here is what they share and used to fail late, with
a traceback: seeds out of range, input files that are folders, unreadable or not UTF-8,
output locations that are files or cannot be created, model and checkpoint folders whose
weights are not safetensors, drafter specs naming something that is not a checkpoint.

Invariants: a check reads at most file headers and text files' bytes (it never loads a
model, never creates or writes anything), and every failure is a ``SpecdraftError`` whose
message names the option. Checks look at attributes by name (``seed``, ``out``, ``data``,
...), so a subcommand gets them by using the shared option names; a name it uses for
something else can opt out by listing it in ``args.unchecked``.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import json
import os
from pathlib import Path

from ..errors import SpecdraftError

# numpy's legacy seeding (accelerate's set_seed) refuses more; torch accepts a wider range,
# and prompt i using seed S+i stays inside it.
SEED_MAX = 2**32 - 1

# What --out of each subcommand is; a subcommand not listed gets only the checks that hold
# for both (its closest existing ancestor must be a writable folder).
OUT_KINDS = {"distill": "file", "bench": "dir", "sweep": "dir", "train": "dir", "export": "dir", "fit": "dir",
             "datastore": "dir"}

# Drafter kinds whose ``kind:PATH`` names a checkpoint folder (others are the subcommand's to reject).
CHECKPOINT_KINDS = ("redrafter", "medusa", "draft", "retrieval", "hf-assisted")

# Options naming an input text file (when the value is not a named built-in set).
TEXT_FILES = {"prompts_file": "--prompts-file", "eval_data": "--eval-data", "data": "--data"}
BUILTIN_SETS = {"sharegpt", "mt-bench", "humaneval", "sharegpt-heldout"}


def check_args(args: argparse.Namespace) -> None:
    """Every shared check that applies to ``args`` (see the module docstring)."""
    skip = set(getattr(args, "unchecked", ()))
    present = lambda name: name not in skip and getattr(args, name, None) is not None  # noqa: E731
    if present("seed"):
        check_seed(args.seed)
    for name, flag in TEXT_FILES.items():
        if present(name):
            values = getattr(args, name)
            for value in values if isinstance(values, list) else [values]:  # datastore --data: several
                if str(value) not in BUILTIN_SETS:
                    check_text_file(str(value), flag)
    if present("dataset") and isinstance(args.dataset, list):  # bench / sweep prompt sets
        for spec in args.dataset:
            if spec not in BUILTIN_SETS:
                check_text_file(spec, "--dataset")
    if present("text"):  # train draft --text: files, folders or globs
        for spec in args.text:
            if not glob.has_magic(spec) and not Path(spec).expanduser().exists():
                raise SpecdraftError(f"--text: {spec} does not exist")
    if present("target") and args.target != "default":
        check_target_spec(args.target)
    if present("draft"):
        check_model_folder(args.draft, "--draft", required=True)
    if present("drafter") and args.command == "export":  # there a plain checkpoint folder
        check_model_folder(args.drafter, "--drafter", required=True)
    elif present("drafter"):
        check_drafter_spec(args.drafter, "--drafter")
    if present("drafters"):  # bench: every method's checkpoint, before the first is measured
        for spec in args.drafters:
            check_drafter_spec(spec, "--drafters")
    if present("hidden_cache"):
        check_output(str(args.hidden_cache), "dir", "--hidden-cache")
    if present("out"):
        check_output(str(args.out), OUT_KINDS.get(args.command), "--out")


def check_seed(seed: int, flag: str = "--seed") -> None:
    if not 0 <= seed <= SEED_MAX:
        raise SpecdraftError(f"{flag} must be in [0, {SEED_MAX}], got {seed}")


def check_text_file(path: str, flag: str) -> None:
    """``path`` is a readable file of UTF-8 text (gzip files: readable only)."""
    p = Path(path).expanduser()
    if not p.exists():
        return  # the subcommand's own message names what it expected (a set name or a file)
    if p.is_dir():
        raise SpecdraftError(f"{flag}: {path} is a directory, not a file")
    try:
        with open(p, "rb") as f:
            if p.suffix == ".gz":
                return
            decoder = codecs.getincrementaldecoder("utf-8")()
            offset = 0
            while chunk := f.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    raise SpecdraftError(f"{flag}: {path} is not UTF-8 text (byte {offset + e.start}: "
                                         f"{e.reason})") from None
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SpecdraftError(f"{flag}: {path} is not UTF-8 text (it ends inside a character)") from None
    except OSError as e:
        raise SpecdraftError(f"{flag}: cannot read {path}: {e.strerror}") from None


def check_target_spec(spec: str) -> None:
    """--target: a packaged model's name, a GGUF file (its magic checked), a model folder,
    or a hub id."""
    from ..models import PACKAGED

    p = Path(spec).expanduser()
    if spec in PACKAGED:
        return
    if p.is_file() and p.suffix == ".gguf":
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise SpecdraftError(f"--target: cannot read {spec}: {e.strerror}") from None
        if magic != b"GGUF":
            raise SpecdraftError(f"--target: {spec} is not a GGUF file")
        return
    check_model_folder(spec, "--target", required=False)


def check_model_folder(path: str, flag: str, required: bool) -> None:
    """A local model or checkpoint folder: a folder, with a JSON config.json if it has one,
    and every ``*.safetensors`` file whole (its header parses and its data fits the file).
    A path that does not exist is an error only when ``required`` (else it may be a hub id)."""
    p = Path(path).expanduser()
    if not p.exists():
        if required:
            raise SpecdraftError(f"{flag}: {path} does not exist")
        return
    if not p.is_dir():
        raise SpecdraftError(f"{flag}: {path} is a file, not a model folder")
    config = p / "config.json"
    try:
        if config.is_file():
            json.loads(config.read_text(encoding="utf-8"))
        weights = sorted(p.glob("*.safetensors"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SpecdraftError(f"{flag}: cannot read {config}: {e}") from None
    from safetensors import SafetensorError, safe_open

    for w in weights:
        try:
            with safe_open(str(w), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise SpecdraftError(f"{flag}: {w} is not a valid safetensors file "
                                 f"(truncated or damaged: {e})") from None


def check_drafter_spec(spec: str, flag: str) -> None:
    """Every checkpoint a drafter spec names (``kind:PATH``, parts of ``A+B``, bench's
    ``@shape`` suffixes) is a whole checkpoint folder; unknown kinds are left to the
    subcommand, which lists the valid ones."""
    from ..drafters.registry import checkpoint_path

    base = spec.rpartition("@")[0] if "@" in spec else spec
    for part in base.split("+"):
        kind, colon, path = part.partition(":")
        if colon and path and kind in CHECKPOINT_KINDS:
            check_model_folder(checkpoint_path(kind, path), f"{flag} {part}", required=True)


def check_output(path: str, kind: str | None, flag: str) -> None:
    """``path`` can be written: a file output is not a folder, a folder output is not a
    file, and the closest existing ancestor is a folder this process may write into (so
    the missing folders can be created)."""
    p = Path(path).expanduser()
    if p.exists():
        if kind == "file" and p.is_dir():
            raise SpecdraftError(f"{flag}: {path} is a directory; expected a file")
        if kind == "dir" and not p.is_dir():
            raise SpecdraftError(f"{flag}: {path} is a file; expected a directory")
        target = p if p.is_dir() else p.parent
        if not os.access(target, os.W_OK | os.X_OK):
            raise SpecdraftError(f"{flag}: {path} is not writable")
        return
    ancestor = p.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecdraftError(f"{flag}: cannot create {path}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SpecdraftError(f"{flag}: cannot create {path}: {ancestor} is not writable")
