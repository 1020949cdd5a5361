"""Plain-text corpora for pretraining draft models: files, folders and globs, a Hugging
Face ``datasets`` dataset (optional), tokenised into one stream and packed into
fixed-length sequences.

- ``expand_paths``: files, folders (recursively: the files whose suffix is in
  ``TEXT_SUFFIXES``) and globs (``**`` recursive), sorted, each file once.
- ``read_document``: a file's text: UTF-8 (undecodable bytes replaced), ``.gz`` files
  decompressed (man pages), HTML reduced to its visible text (Python's documentation);
  files with NUL bytes are binary and skipped.
- ``token_stream``: documents tokenised without special tokens, each followed by EOS (so
  the model learns where documents end), concatenated. Long documents are tokenised in
  blocks of whole lines, which keeps memory bounded.
- ``pack``: the stream cut into consecutive sequences of exactly ``seq_len`` tokens (the
  incomplete tail is dropped): the usual "packed" pretraining layout, no padding.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import SpecdraftError, first_line

TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".html", ".htm", ".py", ".c", ".h", ".json", ".tex", ".csv",
                 ".xml", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ".js", ".css", ".java", ".go",
                 ".rs", ".cpp", ".hpp", ".gz", ".1", ".2", ".3", ".4", ".5", ".6", ".7", ".8"}
BLOCK_CHARS = 1 << 16  # text tokenised per call for long documents
_SPACES = re.compile(r"\s+")


class _Visible(HTMLParser):
    """Collects an HTML page's visible text: no script/style, block tags as newlines."""

    SKIP = {"script", "style", "head", "title", "noscript"}
    BLOCKS = {"p", "div", "br", "li", "ul", "ol", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table",
              "section", "dt", "dd", "dl", "blockquote", "hr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_data(self, data):
        if self.skipping:
            return
        self.parts.append(data if self.pre else _SPACES.sub(" ", data))


def html_to_text(html: str) -> str:
    """The visible text of an HTML page, blank-line runs squeezed."""
    parser = _Visible()
    parser.feed(html)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).splitlines()]
    out, blank = [], 0
    for line in lines:
        blank = blank + 1 if not line.strip() else 0
        if blank <= 1:
            out.append(line)
    return "\n".join(out).strip() + "\n"


def expand_paths(specs: Iterable[str]) -> list[Path]:
    """Files named by ``specs`` (files, folders, globs), sorted per spec, each once."""
    seen: set[Path] = set()
    out: list[Path] = []
    for spec in specs:
        spec = os.path.expanduser(spec)
        if any(c in spec for c in "*?["):
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
        elif Path(spec).is_dir():
            found = sorted(p for p in Path(spec).rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        elif Path(spec).is_file():
            found = [Path(spec)]
        else:
            raise SpecdraftError(f"--text {spec}: no such file or folder")
        if not found:
            raise SpecdraftError(f"--text {spec}: no text files found")
        for p in found:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def read_document(path: Path) -> str | None:
    """A file's text (see the module docstring), or None for a binary file."""
    data = path.read_bytes()
    if path.suffix.lower() == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return None
        inner = Path(path.stem)
    else:
        inner = path
    if b"\0" in data[:8192]:
        return None
    text = data.decode("utf-8", errors="replace")
    if inner.suffix.lower() in (".html", ".htm"):
        text = html_to_text(text)
    return text


def iter_file_documents(paths: list[Path]) -> Iterator[tuple[str, str]]:
    """(name, text) of each readable, non-empty file."""
    for p in paths:
        text = read_document(p)
        if text and text.strip():
            yield str(p), text


def iter_dataset_documents(spec: str, split: str = "train", field: str = "text",
                           limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of the records of a Hugging Face ``datasets`` dataset,
    ``NAME[:CONFIG]`` (optional dependency: ``pip install datasets``)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise SpecdraftError("--dataset needs the `datasets` package (pip install datasets); "
                             "or pass text files with --text") from None

    name, _, config = spec.partition(":")
    try:
        ds = load_dataset(name, config or None, split=split, streaming=True)
    except Exception as e:  # network, missing dataset, bad config: one line
        raise SpecdraftError(f"could not load dataset {spec!r}: {first_line(e)}") from None
    for n, row in enumerate(ds):
        if limit is not None and n >= limit:
            return
        if field not in row:
            raise SpecdraftError(f"dataset {spec!r} has no field {field!r} (fields: {', '.join(row)})")
        text = row[field]
        if isinstance(text, str) and text.strip():
            yield f"{spec}#{n}", text


def _blocks(text: str, size: int = BLOCK_CHARS) -> Iterator[str]:
    """Consecutive pieces of ``text`` of about ``size`` characters, cut after a newline."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        yield text[start:end]
        start = end


def token_stream(tokenizer, documents: Iterable[tuple[str, str]], eos_id: int | None) -> tuple[list[int], int]:
    """All documents' tokens, each document followed by ``eos_id`` (if not None); and the
    number of documents."""
    ids: list[int] = []
    n = 0
    for _, text in documents:
        for block in _blocks(text):
            ids.extend(tokenizer(block, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            ids.append(int(eos_id))
        n += 1
    return ids, n


def pack(ids: list[int], seq_len: int) -> list[list[int]]:
    """Consecutive ``seq_len``-token sequences of ``ids`` (the incomplete tail dropped)."""
    if seq_len < 2:
        raise SpecdraftError(f"packed sequences need at least 2 tokens, got {seq_len}")
    return [ids[i: i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def stream_fingerprint(ids: list[int]) -> str:
    """A short hash of a token stream (resume checks, cache manifests)."""
    h = hashlib.sha256()
    for i in range(0, len(ids), 1 << 16):
        h.update(",".join(map(str, ids[i: i + (1 << 16)])).encode())
        h.update(b";")
    return h.hexdigest()[:16]
