"""The requests an engine has in flight: each one's row (``Row``: its tokens, sampling
state, statistics and stop conditions), the events and results it yields (``StepEvent``,
``GenerationResult``), and the batch of rows decoded together (``Batch``, with the
``StageTimer`` its stages share)."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .cache import CompactCache
from .drafters.base import DraftContext
from .recent import RecentStates
from .sampling import SamplingParams

STAGES = ("prefill", "draft", "verify", "accept", "update")


class StageTimer:
    """Wall-clock seconds per stage; synchronises CUDA so GPU time lands in its stage."""

    def __init__(self, device: torch.device):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.sync = device.type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.seconds[stage] += time.perf_counter() - start


@dataclass
class GenerationResult:
    """One request's output and statistics."""

    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    steps: int  # target forward passes this request took part in, prefill included
    seconds: float
    stage_seconds: dict[str, float]
    accepted_hist: dict[int, int]  # tokens gained per step -> number of steps
    drafted_hist: dict[int, int] = field(default_factory=dict)  # drafted depth offered per step -> steps
    tree_tokens: int = 0  # tokens the target verified in decode steps (tree sizes, g0 included)
    off_steps: int = 0  # decode steps adaptive drafting ran as plain decoding (no drafter call)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text, "token_ids": self.token_ids, "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason,
            "steps": self.steps, "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second, "seconds": self.seconds,
            "stage_seconds": self.stage_seconds,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "drafted_hist": {str(k): v for k, v in sorted(self.drafted_hist.items())},
            "tree_tokens": self.tree_tokens, "off_steps": self.off_steps,
        }


@dataclass
class StepEvent:
    """Tokens a request gained in one step; ``result`` is set when it finished."""

    request_id: int
    new_ids: list[int]
    result: GenerationResult | None = None


@dataclass
class Row:
    """One request in flight. ``generated`` holds every token the target has chosen for it;
    the last, g0, is not yet in the KV cache (the root of the next step's tree).
    ``finish_reason`` is set once a stop condition is met: the row then leaves the batch."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    steps: int = 0
    hist: Counter = field(default_factory=Counter)
    drafted: Counter = field(default_factory=Counter)
    tree_tokens: int = 0
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    adapt: object = None  # adaptive.RowStats when the engine has a policy

    def extend(self, new: list[int], eos_ids, max_context: int, decode) -> list[int]:
        """Append ``new`` up to the first stop condition (EOS, max_new_tokens, the target's
        context ``max_context``, a stop string in the text ``decode`` gives); return what
        was kept."""
        p = self.params
        before = len(self.generated)
        for tok in new:
            self.generated.append(tok)
            if tok in eos_ids and not p.ignore_eos:
                self.finish_reason = "stop"
                break
            if len(self.generated) >= p.max_new_tokens or len(self.prompt) + len(self.generated) >= max_context:
                self.finish_reason = "length"
                break
        if p.stop:
            end = self.stop_string_end(decode)
            if end is not None:
                self.generated = self.generated[: max(end, before)]
                self.finish_reason = "stop"
        return self.generated[before:]

    def stop_string_end(self, decode) -> int | None:
        """How many generated tokens to keep if the text now holds a stop string (the
        token that completes it included), else None."""
        if not any(s in decode(self.generated, skip_special_tokens=True) for s in self.params.stop):
            return None
        for k in range(1, len(self.generated) + 1):  # once per request: a linear scan is fine
            if any(s in decode(self.generated[:k], skip_special_tokens=True) for s in self.params.stop):
                return k
        return None

    def result(self, timer: StageTimer, decode) -> GenerationResult:
        """The request's output (its text cut before any stop string) and statistics."""
        text = decode(self.generated, skip_special_tokens=True)
        for s in self.params.stop:  # the stop string itself is not part of the text
            if s in text:
                text = text[: text.index(s)]
        return GenerationResult(
            token_ids=list(self.generated), text=text, prompt_tokens=len(self.prompt),
            finish_reason=self.finish_reason or "length", steps=self.steps,
            seconds=time.perf_counter() - self.started, stage_seconds=dict(timer.seconds),
            accepted_hist=dict(self.hist), drafted_hist=dict(self.drafted), tree_tokens=self.tree_tokens,
            off_steps=self.adapt.off_steps if self.adapt is not None else 0)


@dataclass
class Batch:
    """Requests in flight together: their rows, KV cache, last hidden states (B, d), the
    drafter's context for the next step, the stage timer they share, and, for drafters
    that look back, each row's latest states (``specdraft.recent``)."""

    rows: list[Row]
    cache: CompactCache | None
    hidden: torch.Tensor | None
    ctx: DraftContext | None
    timer: StageTimer
    recent: RecentStates | None = None
    features: torch.Tensor | None = None  # (B, n, d) for drafters with feature layers, beside hidden
    # Static: no request joins (``engine.run``); its caller waits for the last row, so the
    # adaptive policy weighs rows by their chance to finish last (``adaptive.finish_weights``).
    static: bool = False
    # The drafter was called on the previous step and no row joined since: the next call's
    # time is drafting's steady cost (``engine._adapt``). After plain steps a draft model
    # first feeds every token they made, and a joining row its prompt: such a call costs
    # more than drafting on consecutive steps does.
    steady: bool = False

    @property
    def request_ids(self) -> list[int]:
        return [r.request_id for r in self.rows]
