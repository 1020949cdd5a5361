"""What a benchmark row measures: a decoding method that turns a batch of prompts into
tokens, timed the same way for our engine and for transformers' own generate().

``Method.generate`` returns a ``BatchOutcome``: the batch's wall seconds (CUDA
synchronised before and after), per request the tokens, target forwards (when known)
and accepted-length histogram, and the engine's stage seconds (engine methods only).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..timing import synchronize
from .metrics import batch_stages



@dataclass
class PromptOutcome:
    """One request of a measured batch."""

    token_ids: list[int]
    text: str
    seconds: float  # from the batch's start until this request finished
    finish_reason: str
    steps: int | None = None  # target forwards it took part in (prefill counted); None if unknown
    hist: dict[int, int] | None = None  # tokens gained per step -> steps (engine only)


@dataclass
class BatchOutcome:
    seconds: float
    prompts: list[PromptOutcome]
    stages: dict[str, float] | None = None


@dataclass
class Method(ABC):
    """A named way of decoding; subclasses implement ``generate``."""

    spec: str
    kind: str = "engine"  # "engine" (ours) or "peer" (transformers)
    info: dict = field(default_factory=dict)  # shape, draft size: recorded in each row

    def unsupported(self, batch_size: int) -> str | None:
        """Why this method cannot run at ``batch_size``, or None if it can."""
        return None

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> BatchOutcome:
        """Decode ``prompts`` (one batch), timed."""


class EngineMethod(Method):
    """``SpeculativeEngine`` with one of our drafters (``none`` = plain decoding)."""

    def __init__(self, spec: str, target, beam_width=None, beam_length=None, gamma=None, policy=None,
                 compiled: bool = False, int8: bool = True):
        """``policy``: adaptive drafting (specdraft.adaptive), None for the fixed shape;
        ``compiled``: the drafter's model code through torch.compile, warmed up here;
        ``int8``: the drafter's large linears in int8 where that applies (``Drafter.quantize``),
        as ``EngineSpec`` does by default."""
        from collections import Counter

        from ..models import parameter_count
        from ..drafters.registry import build_drafter
        from ..build import warm_up
        from ..engine import SpeculativeEngine

        drafter = build_drafter(spec, target, beam_width, beam_length, gamma)
        if int8:
            drafter.quantize()
        self.engine = SpeculativeEngine(target, drafter, policy=policy)
        if (compiled and drafter.compile()) or target.compiled:
            # Before any timed prompt: compiling is a start-up cost. A compiled target is warmed
            # with each method's own drafter (its trees, the layers a head reads), else those
            # shapes would run eager and slow.
            warm_up(self.engine)
        self.depths, self.off_steps = Counter(), 0  # over the calls since reset_drafting()
        n_draft = getattr(drafter, "num_parameters", None)
        info = {"beam_width": getattr(drafter, "W", None), "beam_length": getattr(drafter, "L", None),
                "gamma": getattr(drafter, "gamma", None), "draft_params": n_draft,
                "target_params": parameter_count(target.model), "adaptive": policy is not None,
                "int8": drafter.int8}
        if info["beam_length"] is None and info["gamma"]:
            info["beam_length"] = info["gamma"] + 1  # a draft model's chain: g0 + γ drafts
        if spec == "none":
            info.update(beam_width=1, beam_length=1)
        super().__init__(spec=spec, kind="engine", info=info)

    def generate(self, prompts, params) -> BatchOutcome:
        stepping = self.begin(prompts, params)
        while not stepping.done:
            stepping.advance()
        return stepping.outcome()

    def begin(self, prompts, params) -> "Stepping":
        """The batch prefilled (timed), to be decoded a step at a time (``Stepping``)."""
        return Stepping(self, prompts, params)

    def reset_drafting(self) -> None:
        self.depths.clear()
        self.off_steps = 0

    def drafting(self) -> dict:
        """Decode steps by drafted depth (0: none) and how many ran with drafting off."""
        return {"adaptive": self.engine.policy is not None, "off_steps": self.off_steps,
                "decode_steps": sum(self.depths.values()),
                "depths": {str(k): v for k, v in sorted(self.depths.items())}}


class Stepping:
    """One batch of an ``EngineMethod`` decoded a step at a time, each step timed on its own.

    ``--lockstep`` advances the batches of several methods in turn, one step each, so that
    a machine whose speed swings within seconds (a shared VM: a 2-3x swing in matmul speed
    within seconds was seen on the bench machine) slows every method alike; ``seconds`` and
    each request's seconds count this batch's own prefill and steps only, never another
    method's. Alone (``EngineMethod.generate``) it is the engine's plain loop (``run``)."""

    def __init__(self, method: EngineMethod, prompts, params):
        self.method, self.device = method, method.engine.target.device
        self.results: list = [None] * len(prompts)
        self.seconds = 0.0
        self.finished_at = [0.0] * len(prompts)  # own seconds when each request finished
        self.batch = None
        self._timed(lambda: self._begin(prompts, params))

    def _begin(self, prompts, params):
        self.batch, events = self.method.engine.start(prompts, params)
        self.batch.static = True  # nothing joins, as in SpeculativeEngine.run
        return events

    @property
    def done(self) -> bool:
        return not self.batch.rows

    def advance(self) -> None:
        """One decode step of every row still running."""
        self._timed(lambda: self.method.engine.step(self.batch))

    def _timed(self, work) -> None:
        synchronize(self.device)
        start = time.perf_counter()
        events = work()
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        for event in events:
            if event.result is not None:
                self.results[event.request_id] = event.result
                self.finished_at[event.request_id] = self.seconds

    def outcome(self) -> BatchOutcome:
        """The finished batch's outcome (every request done)."""
        for r in self.results:
            self.method.depths.update(r.drafted_hist)
            self.method.off_steps += r.off_steps
        outcomes = [PromptOutcome(token_ids=r.token_ids, text=r.text, seconds=own,
                                  finish_reason=r.finish_reason, steps=r.steps, hist=dict(r.accepted_hist))
                    for r, own in zip(self.results, self.finished_at)]
        return BatchOutcome(seconds=self.seconds, prompts=outcomes,
                            stages=batch_stages([r.stage_seconds for r in self.results], self.seconds))
