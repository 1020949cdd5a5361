"""What every ``specdraft fit`` pipeline shares (heads in ``train.fit``, the draft model in
``train.fit_draft``): the wall-clock budget, the target's answers (held out: stage 1; on
training prompts: stage 1b), a mixture's example spans, SIGTERM as an interrupt, and the
one-line progress messages."""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np


class Budget:
    """Wall-clock budget of one run (None: unbounded)."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds

    def deadline(self, share: float = 1.0) -> float | None:
        return None if self.seconds is None else self.start + share * self.seconds

    def left(self) -> float:
        return math.inf if self.seconds is None else self.start + self.seconds - time.monotonic()


def say(message: str) -> None:
    print(f"specdraft: {message}", file=sys.stderr, flush=True)


# Rows in flight (continuous batching, distill.py) for the target's answers, decoded plainly
# (``NoDrafter``: at these batch sizes a verify forward costs about its tokens, so drafts no
# longer pay; batch 32 with prompt lookup 210 / 174 new tokens/s against 211 / 211 plain).
# SmolLM2 bf16 on this Xeon, 144 ShareGPT prompts, 256 tokens: 96 rows 273 new tokens/s,
# 48 rows 247, static batches of 48 224.
ANSWER_BATCH = 96


def heldout_answers(config, target, path: Path) -> None:
    """Stage 1: the target's greedy answers to the first ``heldout_prompts`` held-out
    ShareGPT prompts (resumable distill file)."""
    target_answers(config, target, path, "heldout", config.heldout_prompts, [0.0], ANSWER_BATCH)


def own_answers(config, target, path: Path) -> None:
    """Stage 1b (``own_answers`` > 0): the target's answers to ``own_answers`` prompts of
    the training split from its ``own_offset``-th on, one per temperature of
    ``own_temperatures`` (greedy: 0) — the text it will draft at inference, beside
    ShareGPT's (resumable distill file)."""
    target_answers(config, target, path, "train", config.own_answers, config.own_temperatures, ANSWER_BATCH,
                   offset=config.own_offset)
    answers_datastore(target, path, path.parent / "datastore")


def answers_datastore(target, answers: Path, folder: Path) -> None:
    """The finished answers as a retrieval datastore in ``folder`` (``retrieval:OUT/datastore``,
    docs/retrieval.md): rebuilt when the answers file holds more answers than it (seconds)."""
    import json

    from ..datastore import CONFIG, Datastore, answers_in_file

    ids = list(answers_in_file(answers, target.tokenizer, target.name))
    config = folder / CONFIG
    if not ids or (config.is_file() and json.loads(config.read_text()).get("answers") == len(ids)):
        return
    Datastore.from_answers(ids, target.vocab_size).save(folder, {"target": target.name, "sources": [str(answers)]})
    say(f"{folder}: a retrieval datastore of {len(ids)} answers (--drafter ...+retrieval:{folder})")


def target_answers(config, target, path: Path, split: str, limit: int, temperatures: list[float],
                   batch_size: int, offset: int = 0) -> None:
    """The target's answers (``heldout_max_new_tokens`` at most) to ``limit`` first-turn
    prompts of a ShareGPT ``split``, from its ``offset``-th on, appended to ``path``
    (``specdraft distill``'s format; resumes where it stopped)."""
    from ..data.sharegpt import first_turn, load_conversations
    from ..distill import DistillReport, distill_responses, make_prompts
    from ..drafters import NoDrafter
    from ..engine import SpeculativeEngine

    convs, _ = load_conversations(None if config.data == "sharegpt" else config.data, split, offset + limit)
    convs = convs[offset:]
    prompts = make_prompts(target.tokenizer, [(c.id, first_turn(c)) for c in convs], 1024, DistillReport())
    engine = SpeculativeEngine(target, NoDrafter())
    report = distill_responses(engine, prompts, temperatures, path, max_new_tokens=config.heldout_max_new_tokens,
                               batch_size=batch_size, progress=config.progress)
    if report.written:
        say(f"{path.name}: {report.summary()}")


def say_extracted(folder: str, report) -> None:
    """One log line for an extraction that did some work (an ``extract`` report)."""
    if report.tokens:
        say(f"{folder}: extracted {report.tokens} tokens ({report.positions} trained positions) in "
            f"{report.seconds:.0f} s: {report.tokens_per_s:.0f} tokens/s")


def with_own_answers(config, target, corpus):
    """With ``own_answers``: the target's answers to training prompts (OUT/answers.jsonl,
    stage 1b) extracted into OUT/answers-corpus and joined after ``corpus`` (a ``Corpus``);
    else ``corpus`` as it is."""
    from .corpus import Corpus, corpus_manifest, extract
    from .examples import load_examples

    if not config.own_answers:
        return corpus
    out = Path(config.out)
    answers = load_examples(str(out / "answers.jsonl"), target.tokenizer, seq_len=config.seq_len, K=config.K,
                            eos_ids=target.eos_ids)
    report = extract(target, answers, out / "answers-corpus",
                     corpus_manifest(target, answers, config.seq_len, config.feature_layers), progress=config.progress)
    say_extracted("answers-corpus", report)
    joined = corpus.joined(Corpus(out / "answers-corpus"))
    say(f"training data: {corpus.tokens} tokens of {config.data}, {joined.tokens - corpus.tokens} of the target's "
        f"own answers ({len(answers)} answers)")
    return joined


def example_spans(parts: list[tuple[int, int]], block: int, share: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The training examples over a corpus made of ``parts`` [(start, end), ...] of its flat
    positions: (starts, ends) int64 arrays, one example per block of ``block`` consecutive
    positions, cut at its part's end. ``share`` (with two parts): the second part's blocks
    are repeated (whole copies, then its first blocks) or cut so that it makes that share of
    the examples per epoch; None: each block once.

    Example: parts [(0, 40), (40, 50)], block 16, share 0.5 -> starts [0, 16, 32, 40, 40, 40]
    (the 10-position second part once as one block, repeated to 3 of 6 examples)."""
    spans = [np.arange(start, end, block, dtype=np.int64) for start, end in parts]
    ends = [np.full(len(s), end, dtype=np.int64) for s, (_, end) in zip(spans, parts)]
    if share is not None and len(parts) == 2 and len(spans[1]):
        want = round(share / (1 - share) * len(spans[0]))  # 0 < share < 1 (FitConfig.check)
        take = np.resize(np.arange(len(spans[1])), max(want, 1))  # repeats, then cuts, in block order
        spans[1], ends[1] = spans[1][take], ends[1][take]
    return np.concatenate(spans), np.concatenate(ends)


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM ends training like Ctrl-C: the loop saves a checkpoint first."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
