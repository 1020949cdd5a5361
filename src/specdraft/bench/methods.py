"""What a benchmark row measures: a decoding method that turns a batch of prompts into
tokens, timed the same way for our engine and for transformers' own generate().

``Method.generate`` returns a ``BatchOutcome``: the batch's wall seconds (CUDA
synchronised before and after), per request the tokens, target forwards (when known)
and accepted-length histogram, and the engine's stage seconds (engine methods only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import re
import time
from dataclasses import dataclass, field

import torch

from ..errors import SpecdraftError
from ..sampling import SamplingParams
from .metrics import batch_stages

PEER_KINDS = ("hf-ar", "hf-assisted", "hf-lookup")
WITH_PATH = ("redrafter", "medusa", "draft", "hf-assisted")
WITHOUT_PATH = ("none", "lookup", "hf-ar", "hf-lookup")


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


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


class EngineMethod(Method):
    """``SpeculativeEngine`` with one of our drafters (``none`` = plain decoding)."""

    def __init__(self, spec: str, target, beam_width=None, beam_length=None, gamma=None, policy=None):
        """``policy``: adaptive drafting (specdraft.adaptive), None for the fixed shape."""
        from collections import Counter

        from ..models import parameter_count
        from ..drafters.registry import build_drafter
        from ..engine import SpeculativeEngine

        drafter = build_drafter(spec, target, beam_width, beam_length, gamma)
        self.engine = SpeculativeEngine(target, drafter, policy=policy)
        self.depths, self.off_steps = Counter(), 0  # over the calls since reset_drafting()
        n_draft = getattr(drafter, "num_parameters", None)
        info = {"beam_width": getattr(drafter, "W", None), "beam_length": getattr(drafter, "L", None),
                "gamma": getattr(drafter, "gamma", None), "draft_params": n_draft,
                "target_params": parameter_count(target.model)}
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


def split_shape(spec: str) -> tuple[str, dict]:
    """'lookup@4x6' -> ('lookup', {beam_width: 4, beam_length: 6}); 'draft:P@g5' ->
    ('draft:P', {gamma: 5}); no suffix -> (spec, {}). The suffix lets one run compare
    shapes of the same drafter (each shape is its own row)."""
    base, at, shape = spec.rpartition("@")
    if not at:
        return spec, {}
    m = re.fullmatch(r"(\d+)x(\d+)|g(\d+)", shape)
    if not m:
        raise SpecdraftError(f"bad shape suffix in {spec!r}: use @WxL (beam width x length) or @gG (gamma)")
    if m.group(3):
        return base, {"gamma": int(m.group(3))}
    return base, {"beam_width": int(m.group(1)), "beam_length": int(m.group(2))}


def check_spec(spec: str) -> None:
    """Fail on an unknown method name or a missing checkpoint folder before anything is
    measured, rather than after an hour of other rows."""
    from pathlib import Path

    from ..drafters.registry import checkpoint_path, combined_parts

    base, _ = split_shape(spec)
    if "+" in base:  # a combined drafter: every part must be one of ours
        for part in combined_parts(base):
            if part.partition(":")[0] in PEER_KINDS:
                raise SpecdraftError(f"{spec}: only our drafters combine, not {part!r}")
            check_spec(part)
        return
    kind, colon, path = base.partition(":")
    if kind in WITHOUT_PATH and not colon:
        return
    path = checkpoint_path(kind, path)
    if kind in WITH_PATH and path:
        if not Path(path).expanduser().exists():
            raise SpecdraftError(f"{spec}: checkpoint folder not found: {path}")
        return
    raise SpecdraftError(f"unknown method {spec!r}; choose from none, lookup, redrafter:PATH, medusa:PATH, "
                         "draft:PATH, hf-ar, hf-assisted:PATH, hf-lookup")


def build_method(spec: str, target, beam_width=None, beam_length=None, gamma=None, policy=None) -> Method:
    """Our drafter through the engine, or a transformers peer (``hf-*``). A shape suffix
    (``@WxL``, ``@gG``) overrides the run-wide shape options for this method."""
    base, shape = split_shape(spec)
    beam_width = shape.get("beam_width", beam_width)
    beam_length = shape.get("beam_length", beam_length)
    gamma = shape.get("gamma", gamma)
    if base.partition(":")[0] in PEER_KINDS:
        from .peers import build_peer

        method = build_peer(base, target, beam_length=beam_length, gamma=gamma)
    else:
        method = EngineMethod(base, target, beam_width, beam_length, gamma, policy)
    method.spec = spec
    return method
