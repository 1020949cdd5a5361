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
                 compiled: bool = False):
        """``policy``: adaptive drafting (specdraft.adaptive), None for the fixed shape;
        ``compiled``: the drafter's model code through torch.compile, warmed up here."""
        from collections import Counter

        from ..models import parameter_count
        from ..drafters.registry import build_drafter
        from ..build import warm_up
        from ..engine import SpeculativeEngine

        drafter = build_drafter(spec, target, beam_width, beam_length, gamma)
        self.engine = SpeculativeEngine(target, drafter, policy=policy)
        if compiled and drafter.compile():
            warm_up(self.engine)  # before any timed prompt: compiling is a start-up cost
        self.depths, self.off_steps = Counter(), 0  # over the calls since reset_drafting()
        n_draft = getattr(drafter, "num_parameters", None)
        info = {"beam_width": getattr(drafter, "W", None), "beam_length": getattr(drafter, "L", None),
                "gamma": getattr(drafter, "gamma", None), "draft_params": n_draft,
                "target_params": parameter_count(target.model), "adaptive": policy is not None}
        if info["beam_length"] is None and info["gamma"]:
            info["beam_length"] = info["gamma"] + 1  # a draft model's chain: g0 + γ drafts
        if spec == "none":
            info.update(beam_width=1, beam_length=1)
        super().__init__(spec=spec, kind="engine", info=info)

    def generate(self, prompts, params) -> BatchOutcome:
        device = self.engine.target.device
        synchronize(device)
        start = time.perf_counter()
        results = self.engine.generate(prompts, params)
        synchronize(device)
        wall = time.perf_counter() - start
        for r in results:
            self.depths.update(r.drafted_hist)
            self.off_steps += r.off_steps
        outcomes = [PromptOutcome(token_ids=r.token_ids, text=r.text, seconds=r.seconds,
                                  finish_reason=r.finish_reason, steps=r.steps, hist=dict(r.accepted_hist))
                    for r in results]
        return BatchOutcome(seconds=wall, prompts=outcomes,
                            stages=batch_stages([r.stage_seconds for r in results], wall))

    def reset_drafting(self) -> None:
        self.depths.clear()
        self.off_steps = 0

    def drafting(self) -> dict:
        """Decode steps by drafted depth (0: none) and how many ran with drafting off."""
        return {"adaptive": self.engine.policy is not None, "off_steps": self.off_steps,
                "decode_steps": sum(self.depths.values()),
                "depths": {str(k): v for k, v in sorted(self.depths.items())}}
