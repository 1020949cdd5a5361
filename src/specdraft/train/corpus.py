"""A position corpus: what the frozen target computes over training text, computed once
(in bfloat16 where the hardware runs it) and read many times, memory-mapped.

Why: a drafter head only ever reads the target's last hidden state h_t and the target's
own next-token choices; recomputing them every epoch made training cost a target pass
per token. Extraction runs the target once per sequence and stores, for the trained
positions only, what the head needs.

For a sequence x_0..x_{T-1} with assistant-token flags a_u (``labels != -100``):

    greedy[u] = argmax p(. | x_<=u)   where a_{u+1} (the target's own choice for an answer
                                        slot); -1 elsewhere and at u = T-1
    trained t:  a_{t+2}                 (the head at h_t, fed x_{t+1}, predicts slot t+2)

At depth i (0-based) the head at t is fed x_{t+1+i} and its label is greedy[t+1+i] (the
ReDrafter paper's distillation: the target's own greedy token after the real prefix), or,
for held-out scoring on the target's own answers, x_{t+2+i}. A label is valid only while
every shallower one is (prefix-closed, as the engine's walk reads them).

Worked example (K = 2): x = [u0 u1 A0 A1 A2 <eos>], a = [0 0 1 1 1 1]
    greedy = [-1, g1, g2, g3, g4, -1]      (g_u predicts x_{u+1}; -1 where a_{u+1} = 0)
    trained t = 0, 1, 2, 3                   (a_{t+2} = 1)
    t = 1: fed x2, x3; labels greedy[2], greedy[3]  = the target's choices for slots 3, 4

Layout of a corpus folder:
    manifest.json            target signature, dtype, source description, seq_len, chunk
    chunk-{k:06d}/           sequences [k*chunk, (k+1)*chunk) of the source, written whole
        tokens.npy   int32 (S,)      the chunk's sequences, concatenated
        answer.npy   bool  (S,)      a_u
        greedy.npy   int32 (S,)      greedy[u] as above
        pos.npy      int64 (P,)      index (into tokens) of each trained position t
        hidden.npy   int16 (P, d)    h_t, bfloat16 bits (numpy has no bfloat16)
        features.npy int16 (P, n·d)  only with manifest "feature_layers" [a, b, ...]: the
                                     residual stream after those target layers at t
        meta.json    sequences, tokens, positions, seconds
A chunk is written to a temporary folder and renamed when complete, so an interrupted
extraction loses at most the chunk in flight and resumes at the first missing chunk.
Size: about 2·d bytes per trained position (SmolLM2: 1.15 kB).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data.chat import IGNORE
from ..errors import SpecdraftError
from ..vocab import DraftVocab
from .mmap_rows import open_random, read_rows

MANIFEST = "manifest.json"
FORMAT = 1


def chunk_name(k: int) -> str:
    return f"chunk-{k:06d}"


def bf16_to_int16(x: torch.Tensor) -> np.ndarray:
    """(…, d) bfloat16 -> int16 numpy with the same bits."""
    return x.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()


def int16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """The inverse of ``bf16_to_int16`` (copies out of a memory map)."""
    return torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16)


# ---- extraction -----------------------------------------------------------------------


@dataclass
class ExtractReport:
    chunks_done: int
    chunks_total: int
    sequences: int
    tokens: int
    positions: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def corpus_manifest(target, examples, seq_len: int, feature_layers: list[int] | None = None) -> dict:
    """What a corpus's states belong to: a corpus is only extended by the same settings.
    ``feature_layers``: also store the target's states after these layers."""
    from ..checkpoint import target_signature

    manifest = {"target": target_signature(target), "dtype": str(target.dtype).replace("torch.", ""),
                "data": examples.describe, "fingerprint": examples.fingerprint(), "seq_len": seq_len}
    if feature_layers:
        manifest["feature_layers"] = list(feature_layers)
    return manifest


def settings(manifest: dict) -> dict:
    """A manifest without where its data was read: the fingerprint names the examples, so a
    run folder that moved (or a new run reusing a corpus) still matches."""
    data = {k: v for k, v in manifest.get("data", {}).items() if k != "path"}
    return {**manifest, "data": data}


def open_corpus(folder: Path, manifest: dict) -> None:
    """Create ``folder`` with ``manifest``, or check that an existing one matches."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MANIFEST
    if path.exists():
        found, wanted = settings(json.loads(path.read_text())), settings(json.loads(json.dumps(manifest)))
        if found != wanted:
            diff = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
            raise SpecdraftError(f"corpus {folder} was extracted with other settings (differs in "
                                 f"{', '.join(diff)}); use another folder or delete it")
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, path)


def greedy_and_hidden(target, ids: list[list[int]], answer: list[list[bool]], max_batch_tokens: int,
                      feature_layers: tuple[int, ...] = ()):
    """One target pass over sequences (right-padded, grouped by length); yields per
    sequence (greedy (T,) int32 numpy, trained positions (P,) int64 numpy, hidden (P, d)
    bfloat16, features (P, n, d) after ``feature_layers`` or None) in input order. The LM
    head runs only where an answer slot follows."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: dict[int, tuple] = {}
    start = 0
    while start < len(order):
        # The longest sequence of a group comes last (sorted): grow while within budget.
        end = start + 1
        while end < len(order) and len(ids[order[end]]) * (end + 1 - start) <= max_batch_tokens:
            end += 1
        group = order[start:end]
        T = len(ids[group[-1]])
        batch = torch.zeros(len(group), T, dtype=torch.long)
        for r, i in enumerate(group):
            batch[r, : len(ids[i])] = torch.tensor(ids[i])
        # No attention mask: the padding is on the right, and under causal attention a real
        # token never sees a later one, so its state is the unpadded one; without a mask
        # the attention takes its fused causal kernel (a padding mask: 2-3x slower on CPU).
        hidden, feats = target.states(tuple(feature_layers or ()), input_ids=batch.to(target.device))
        for r, i in enumerate(group):
            a = torch.tensor(answer[i], dtype=torch.bool)
            n = len(ids[i])
            slot = torch.zeros(n, dtype=torch.bool)  # a_{u+1}
            slot[:-1] = a[1:]
            greedy = torch.full((n,), -1, dtype=torch.int32)
            if slot.any():
                greedy[slot] = target.logits(hidden[r, :n][slot.to(hidden.device)]).argmax(-1).int().cpu()
            trained = torch.zeros(n, dtype=torch.bool)  # a_{t+2}
            trained[:-2] = a[2:]
            pos = trained.nonzero().flatten()
            at = pos.to(hidden.device)
            results[i] = (greedy.numpy(), pos.numpy().astype(np.int64), hidden[r, at],
                          None if feats is None else feats[r, at])
        start = end
    for i in range(len(ids)):
        yield results.pop(i)


def write_chunk(folder: Path, k: int, examples, target, max_batch_tokens: int,
                feature_layers: tuple[int, ...] = ()) -> dict:
    """Extract the given examples into chunk ``k`` (atomically); returns its meta."""
    begin = time.perf_counter()
    ids = [list(e.input_ids) for e in examples]
    answer = [[y != IGNORE for y in e.labels] for e in examples]
    tokens, answers, greedies, positions, hiddens, features = [], [], [], [], [], []
    offset = 0
    with torch.inference_mode():
        for seq, ans, (greedy, pos, hidden, feats) in zip(ids, answer, greedy_and_hidden(
                target, ids, answer, max_batch_tokens, feature_layers)):
            tokens.append(np.asarray(seq, dtype=np.int32))
            answers.append(np.asarray(ans, dtype=bool))
            greedies.append(greedy)
            positions.append(pos + offset)
            hiddens.append(bf16_to_int16(hidden))
            if feats is not None:
                features.append(bf16_to_int16(feats.flatten(1)))
            offset += len(seq)
    d = int(target.hidden_size)
    arrays = {"tokens": np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
              "answer": np.concatenate(answers) if answers else np.zeros(0, bool),
              "greedy": np.concatenate(greedies) if greedies else np.zeros(0, np.int32),
              "pos": np.concatenate(positions) if positions else np.zeros(0, np.int64),
              "hidden": np.concatenate(hiddens) if hiddens else np.zeros((0, d), np.int16)}
    if feature_layers:
        arrays["features"] = np.concatenate(features) if features else np.zeros((0, len(feature_layers) * d), np.int16)
    meta = {"sequences": len(ids), "tokens": int(offset), "positions": int(arrays["pos"].shape[0]),
            "seconds": round(time.perf_counter() - begin, 3)}
    final = folder / chunk_name(k)
    tmp = folder / (chunk_name(k) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, array in arrays.items():
        np.save(tmp / f"{name}.npy", array, allow_pickle=False)
    (tmp / "meta.json").write_text(json.dumps(meta))
    os.replace(tmp, final)
    return meta


def extract(target, examples, folder: str | Path, manifest: dict, chunk: int = 128, max_batch_tokens: int = 8192,
            max_tokens: int | None = None, deadline: float | None = None, progress: bool = True) -> ExtractReport:
    """Extract ``examples`` (an ``ExampleSet`` of teacher-forcing examples) into ``folder``,
    chunk by chunk, skipping chunks already there. Stops after the chunk that brings the
    corpus to ``max_tokens`` tokens, or before starting a chunk past ``deadline``
    (``time.monotonic()`` value). Safe to interrupt: rerun to continue."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    open_corpus(folder, {**manifest, "chunk": chunk, "format": FORMAT})
    total = (len(examples) + chunk - 1) // chunk
    done = Corpus.chunk_metas(folder)
    have = Corpus.folder_tokens(folder)
    report = ExtractReport(len(done), total, 0, 0, 0, 0.0)
    bar = tqdm(total=total, initial=len(done), unit="chunk", desc="extract", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for k in range(total):
            if k in done:
                continue
            if (max_tokens is not None and have >= max_tokens) or (deadline is not None and time.monotonic() > deadline):
                break
            part = [examples[i] for i in range(k * chunk, min((k + 1) * chunk, len(examples)))]
            meta = write_chunk(folder, k, part, target, max_batch_tokens, tuple(manifest.get("feature_layers", ())))
            have += meta["tokens"]
            report.chunks_done += 1
            report.sequences += meta["sequences"]
            report.tokens += meta["tokens"]
            report.positions += meta["positions"]
            report.seconds += meta["seconds"]
            bar.update(1)
            bar.set_postfix(tok_s=round(report.tokens_per_s), refresh=False)
    finally:
        bar.close()
    return report


# ---- reading --------------------------------------------------------------------------


class Corpus:
    """The completed chunks of a corpus folder, memory-mapped, as one flat list of trained
    positions (chunk order, then position order)."""

    def __init__(self, folder: str | Path, chunks: list[int] | None = None):
        self.folder = Path(folder)
        if not (self.folder / MANIFEST).is_file():
            raise SpecdraftError(f"{self.folder} is not a specdraft corpus (no {MANIFEST})")
        self.manifest = json.loads((self.folder / MANIFEST).read_text())
        self.feature_layers = list(self.manifest.get("feature_layers", []))  # states stored beside h_t
        metas = self.chunk_metas(self.folder)
        self.chunks = sorted(metas) if chunks is None else list(chunks)
        missing = [k for k in self.chunks if k not in metas]
        if missing:
            raise SpecdraftError(f"corpus {self.folder} lacks chunk(s) {missing[:5]}")
        self.arrays = [self._open(k) for k in self.chunks]
        counts = np.array([a["pos"].shape[0] for a in self.arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])  # flat index of each chunk's first position
        self.tokens = int(sum(metas[k]["tokens"] for k in self.chunks))
        self.parts = [(0, len(self))]  # flat (start, end) of each folder: one, or more when joined
        self.also: list[dict] = []  # fingerprints of the corpora joined after this one

    def joined(self, other: "Corpus") -> "Corpus":
        """This corpus followed by ``other`` as one flat list (a mixture: ShareGPT and the
        target's own answers). Both must hold the same states of the same target."""
        mine, theirs = (settings(c.manifest) for c in (self, other))
        if any(mine.get(k) != theirs.get(k) for k in ("target", "dtype", "feature_layers")):
            raise SpecdraftError(f"corpora {self.folder} and {other.folder} hold states of different targets, "
                                 "dtypes or feature layers")
        both = copy.copy(self)
        both.arrays = self.arrays + other.arrays
        both.starts = np.concatenate([self.starts, len(self) + other.starts[1:]])
        both.tokens = self.tokens + other.tokens
        both.parts = self.parts + [(len(self) + a, len(self) + b) for a, b in other.parts]
        both.also = self.also + [other.fingerprint()]
        return both

    @staticmethod
    def folder_tokens(folder: Path) -> int:
        """Tokens in the complete chunks of the corpus folder ``folder``."""
        return sum(m["tokens"] for m in Corpus.chunk_metas(folder).values())

    @staticmethod
    def chunk_metas(folder: Path) -> dict[int, dict]:
        out = {}
        for meta in Path(folder).glob("chunk-*/meta.json"):
            name = meta.parent.name
            if name.endswith(".tmp"):
                continue
            out[int(name.split("-")[1])] = json.loads(meta.read_text())
        return out

    def _open(self, k: int) -> dict:
        base = self.folder / chunk_name(k)
        names = ("tokens", "answer", "greedy", "pos")
        arrays = {name: np.load(base / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in names}
        for name in ("hidden",) + (("features",) if self.feature_layers else ()):  # the large ones: see mmap_rows
            arrays[name] = open_random(base / f"{name}.npy")
        return arrays

    def __len__(self) -> int:
        return int(self.starts[-1])

    def fingerprint(self) -> dict:
        mine = {"folder": str(self.folder.resolve()), "chunks": self.chunks, "positions": int(self.parts[0][1])}
        return {**mine, "also": self.also} if self.also else mine

    def gather(self, flat: np.ndarray, K: int, label: str = "greedy", window: int = 0,
               soft: bool = False) -> "PositionBatch":
        """The positions ``flat`` (N,) of the flat list, with K depths of inputs and labels.

        label "greedy": the target's choices (training); "agreeing": the same, depth i only
        where the text's x_{t+1+j} was the target's choice greedy[t+j] for every 0 < j <= i
        (the inputs the engine feeds a head whose shallower drafts were right); "text": the
        sequence's own next tokens (scoring on the target's own answers: the engine's walk). window C > 0 also
        gathers each position's context window (``PositionBatch.window``): the stored
        positions t-C+1 .. t of the same answer (consecutive token indices). soft: also
        the states h_{t+1+i} whose logits chose each depth's label (``PositionBatch.soft``)."""
        flat = np.asarray(flat, dtype=np.int64)
        chunk_of = np.searchsorted(self.starts, flat, side="right") - 1
        inputs = np.zeros((len(flat), K), dtype=np.int64)
        labels = np.full((len(flat), K), IGNORE, dtype=np.int64)
        t_of = self._t_of(flat, chunk_of)
        for c in np.unique(chunk_of):
            rows = np.nonzero(chunk_of == c)[0]
            a = self.arrays[c]
            t = t_of[rows]
            S = a["tokens"].shape[0]
            ok = np.ones(len(rows), dtype=bool)
            for i in range(K):
                u = np.minimum(t + 1 + i, S - 1)
                inputs[rows, i] = a["tokens"][u]
                if label in ("greedy", "agreeing"):
                    y = a["greedy"][u].astype(np.int64)
                    ok &= (t + 1 + i < S) & (y >= 0)
                    if label == "agreeing" and i:  # the engine feeds depth i the depth i-1 draft, right only if
                        ok &= a["tokens"][u] == a["greedy"][u - 1]  # it was the target's choice greedy[t+i]
                else:
                    v = np.minimum(t + 2 + i, S - 1)
                    y = a["tokens"][v].astype(np.int64)
                    ok &= (t + 2 + i < S) & a["answer"][v] & (a["greedy"][u] >= 0)
                labels[rows, i] = np.where(ok, y, IGNORE)
        windows = None
        if window and len(flat):
            windows = self._windows(flat, chunk_of, t_of, window)  # (needs consecutive runs: blocks)
        hidden = self._hidden(flat, chunk_of)
        features = self._hidden(flat, chunk_of, "features").view(len(flat), len(self.feature_layers), -1) \
            if self.feature_layers else None
        return PositionBatch(hidden=hidden, inputs=torch.from_numpy(inputs), labels=torch.from_numpy(labels),
                             chunk=torch.from_numpy(chunk_of), t=torch.from_numpy(t_of), window=windows,
                             features=features, soft=self._label_states(chunk_of, t_of, K) if soft else None)

    def _label_states(self, chunk_of: np.ndarray, t_of: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(states (N, K, d) bf16, present (N, K) bool): h_{t+1+i}, the target's state whose
        logits chose the depth-i label greedy[t+1+i], where the corpus stores it. It does
        where t+1+i is itself a trained position (a_{t+3+i}); the last label of an answer
        has none (zeros there, present False)."""
        d = self.arrays[0]["hidden"].shape[1] if self.arrays else 0
        found = np.full((len(t_of), K), -1, dtype=np.int64)  # flat index of h_{t+1+i}
        for c in np.unique(chunk_of):
            rows = np.nonzero(chunk_of == c)[0]
            pos = self.arrays[c]["pos"]
            want = t_of[rows, None] + 1 + np.arange(K)  # (n, K) token indices
            at = np.minimum(np.searchsorted(pos, want), len(pos) - 1)
            found[rows] = np.where(pos[at] == want, self.starts[c] + at, -1)
        present = found >= 0
        states = torch.zeros(len(t_of), K, d, dtype=torch.bfloat16)
        if present.any():  # h_{t+1+i} is in t's chunk (a chunk holds whole sequences)
            states[torch.from_numpy(present)] = self._hidden(found[present],
                                                             np.broadcast_to(chunk_of[:, None], found.shape)[present])
        return states, torch.from_numpy(present)

    def _t_of(self, flat: np.ndarray, chunk_of: np.ndarray) -> np.ndarray:
        """Token index (within its chunk) of each flat position."""
        t_of = np.zeros(len(flat), dtype=np.int64)
        for c in np.unique(chunk_of):
            rows = np.nonzero(chunk_of == c)[0]
            t_of[rows] = self.arrays[c]["pos"][flat[rows] - self.starts[c]]
        return t_of

    def _hidden(self, flat: np.ndarray, chunk_of: np.ndarray, name: str = "hidden") -> torch.Tensor:
        """(N, width) bfloat16 rows of the array ``name`` ("hidden": h_t) at the flat positions."""
        hidden = np.empty((len(flat), self.arrays[0][name].shape[1]) if self.arrays else (0, 0), dtype=np.int16)
        for c in np.unique(chunk_of):
            rows = np.nonzero(chunk_of == c)[0]
            local = flat[rows] - self.starts[c]
            order = np.argsort(local)  # sorted reads are kinder to the page cache
            hidden[rows[order]] = read_rows(self.arrays[c][name], local[order])
        return int16_to_bf16(hidden)

    def _windows(self, flat: np.ndarray, chunk_of: np.ndarray, t_of: np.ndarray, C: int, Q: int = 16):
        """The context windows of ``flat``, grouped for ``ReDrafterHead.contextualize``:
        (support hidden (G, S, d) bf16, support next tokens (G, S) long, query (G, Q) long,
        valid (G, Q, S) bool, slot (N,) long) with S = Q + C - 1.

        Runs of consecutive positions (training blocks, held-out batches) are cut into
        groups of at most Q; group g's span is the S flat positions ending at its Q-th
        query slot, and row n sits at slot[n] = g·Q + q. A span position is in a query's
        window when it is at most C - 1 positions back and stored at the matching token
        index of the same chunk (the same answer)."""
        N, S = len(flat), Q + C - 1
        run_start = np.ones(N, dtype=bool)
        run_start[1:] = flat[1:] != flat[:-1] + 1
        first_of_run = np.maximum.accumulate(np.where(run_start, np.arange(N), 0))
        new_group = run_start | ((np.arange(N) - first_of_run) % Q == 0)
        group = np.cumsum(new_group) - 1
        q = np.arange(N) - np.maximum.accumulate(np.where(new_group, np.arange(N), 0))
        G = int(group[-1]) + 1
        first = flat[new_group]  # (G,) each group's first position
        span = first[:, None] - (C - 1) + np.arange(S)  # (G, S)
        queries = first[:, None] + np.arange(Q)  # (G, Q); slots past a group's end are padding
        inside = (span >= 0) & (span < len(self))
        safe = np.where(inside, span, 0)
        s_chunk = np.searchsorted(self.starts, safe.ravel(), side="right") - 1
        s_t = self._t_of(safe.ravel(), s_chunk).reshape(G, S)
        s_chunk = s_chunk.reshape(G, S)
        q_chunk = np.full((G, Q), -1, dtype=np.int64)
        q_t = np.zeros((G, Q), dtype=np.int64)
        q_chunk[group, q], q_t[group, q] = chunk_of, t_of
        back = queries[:, :, None] - span[:, None, :]  # (G, Q, S) positions back
        valid = inside[:, None, :] & (back >= 0) & (back < C) & (s_chunk[:, None, :] == q_chunk[:, :, None]) \
            & (s_t[:, None, :] == q_t[:, :, None] - back)
        valid |= back == 0  # a query always sees itself (padding queries too: no empty softmax row)
        nxt = np.zeros((G, S), dtype=np.int64)
        for c in np.unique(s_chunk):
            at = s_chunk == c
            nxt[at] = self.arrays[c]["tokens"][np.minimum(s_t[at] + 1, self.arrays[c]["tokens"].shape[0] - 1)]
        hidden = self._hidden(safe.ravel(), s_chunk.ravel()).view(G, S, -1)
        query = np.broadcast_to(C - 1 + np.arange(Q), (G, Q)).copy()
        return (hidden, torch.from_numpy(nxt), torch.from_numpy(query), torch.from_numpy(valid),
                torch.from_numpy(group * Q + q))

    def label_counts(self, vocab_size: int, limit_positions: int | None = None) -> torch.Tensor:
        """(V,) int64 counts of the target's greedy choices at answer slots (the draft
        vocabulary's source: the target's own outputs)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        seen = 0
        for a in self.arrays:
            g = np.asarray(a["greedy"])
            g = g[g >= 0]
            counts += np.bincount(g, minlength=vocab_size)[:vocab_size]
            seen += len(g)
            if limit_positions is not None and seen >= limit_positions:
                break
        return torch.from_numpy(counts)


@dataclass
class PositionBatch:
    """hidden (N, d) bfloat16 h_t; inputs (N, K) long, the tokens fed at depths 0..K-1;
    labels (N, K) long (-100: no label, prefix-closed); chunk, t (N,) where each came from;
    window: None, or the context windows (``Corpus._windows``), the arguments of
    ``ReDrafterHead.contextualize`` after h_t; features: None, or (N, n, d) the target's
    states after the corpus's feature layers."""

    hidden: torch.Tensor
    inputs: torch.Tensor
    labels: torch.Tensor
    chunk: torch.Tensor
    t: torch.Tensor
    window: tuple | None = None
    features: torch.Tensor | None = None  # (N, n, d) bf16: the states after the corpus's feature layers
    soft: tuple | None = None  # (states (N, K, d) bf16, present (N, K) bool): ``Corpus._label_states``


def to_device(window: tuple | None, device) -> tuple | None:
    """A ``PositionBatch.window`` moved to ``device`` (None stays None)."""
    return None if window is None else tuple(x.to(device) for x in window)


def to_output_space(vocab: DraftVocab | None, labels: torch.Tensor) -> torch.Tensor:
    """Labels (any shape: target ids, or IGNORE) -> the same shape in the ids of a head's
    output layer (draft ids with a draft vocabulary); IGNORE where not drafted."""
    if vocab is None:
        return labels
    mapped = vocab.to_draft(labels)
    return torch.where(mapped >= 0, mapped, torch.full_like(mapped, IGNORE))
