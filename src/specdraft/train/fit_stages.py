"""What every ``specdraft fit`` pipeline shares (heads in ``train.fit``, the draft model in
``train.fit_draft``): the wall-clock budget, the held-out answers stage (stage 1), SIGTERM
as an interrupt, and the one-line progress messages."""

from __future__ import annotations

import math
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path


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


def heldout_answers(config, target, path: Path) -> None:
    """Stage 1: the target's greedy answers to the first ``heldout_prompts`` held-out
    ShareGPT prompts (resumable distill file)."""
    from ..data.sharegpt import first_turn, load_conversations
    from ..distill import DistillReport, distill_responses, make_prompts
    from ..drafters.lookup import LookupDrafter
    from ..engine import SpeculativeEngine

    convs, _ = load_conversations(None if config.data == "sharegpt" else config.data, "heldout",
                                  config.heldout_prompts)
    prompts = make_prompts(target.tokenizer, [(c.id, first_turn(c)) for c in convs], 1024, DistillReport())
    engine = SpeculativeEngine(target, LookupDrafter())  # exact: the same answers as plain decoding
    distill_responses(engine, prompts, [0.0], path, max_new_tokens=config.heldout_max_new_tokens,
                      batch_size=8, progress=config.progress)


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
