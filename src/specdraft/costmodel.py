"""The cost model of adaptive drafting: seconds of one target forward against the padded
tree tokens of the whole batch, T = B x N (the packed tree is padded to its longest row,
and every padded slot is computed), plus an attention term growing with the cached width.

Measured once per target / dtype / device / threads with the ``bench --verify-cost`` code
(``timing.measure_verify_cost``) and cached on disk (``load_cost_model``);
``adaptive.StepCostRatio`` corrects it on line. Worked example: 16 rows drafting one token
each verify T = 32 tokens, where a plain step of those rows verifies 16; on the 2-core EPYC
(SmolLM2, bfloat16) cost(32) measured 1.56x cost(16), so one drafted token per row pays only
if more than 56% of them are accepted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecdraftError

COST_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
COST_PREFIX = 128  # cached tokens of the main curve
COST_LONG_PREFIX = 640  # a second, shorter curve here gives the attention term
COST_LONG_TOKENS = (1, 8, 32)


@dataclass
class CostModel:
    """Seconds of one verify forward (+ logits) against padded tree tokens.

    tokens:  increasing T values, tokens[0] == 1 (batch 1, a chain of T tokens)
    seconds: forward seconds at each T with ``prefix`` tokens cached
    per_kv:  extra seconds per (tree token x cached slot) beyond ``prefix`` (attention)
    Invariant after construction: seconds is non-decreasing (a forward of more tokens never
    costs less): the readings' least-squares non-decreasing fit (``monotone_fit``), so one
    noisy reading, high or low, is averaged with its neighbours instead of carried on to
    every larger size as a running max would.
    """

    tokens: list[int]
    seconds: list[float]
    prefix: int = COST_PREFIX
    per_kv: float = 0.0
    key: str = ""

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.seconds) or self.tokens[0] != 1 or \
                any(b <= a for a, b in zip(self.tokens, self.tokens[1:])) or min(self.seconds) <= 0:
            raise SpecdraftError("a cost model needs increasing token counts from 1 and positive seconds")
        self.seconds = monotone_fit([float(s) for s in self.seconds])
        self.per_kv = max(0.0, float(self.per_kv))

    def __call__(self, tokens: int, width: int | None = None) -> float:
        """Seconds of a forward over ``tokens`` padded tree tokens with ``width`` cached slots."""
        base = self._curve(max(int(tokens), 1))
        if width is None:
            return base
        return base + self.per_kv * tokens * max(0, width - self.prefix)

    def _curve(self, t: int) -> float:
        xs, ys = self.tokens, self.seconds
        if t >= xs[-1]:  # beyond the measured range: the last slope goes on
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]
            return ys[-1] + slope * (t - xs[-1])
        i = next(i for i, x in enumerate(xs) if x >= t)
        if xs[i] == t:
            return ys[i]
        frac = (t - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + frac * (ys[i] - ys[i - 1])

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "prefix": self.prefix,
                "per_kv": self.per_kv, "key": self.key}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(tokens=[int(t) for t in d["tokens"]], seconds=[float(s) for s in d["seconds"]],
                   prefix=int(d.get("prefix", COST_PREFIX)), per_kv=float(d.get("per_kv", 0.0)),
                   key=str(d.get("key", "")))


def monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in squared error (pool adjacent
    violators: a value below its predecessor merges with it into their mean, repeatedly).
    Example: [1.0, 0.9, 1.2, 2.0] -> [0.95, 0.95, 1.2, 2.0]."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def cost_model_key(target) -> str:
    """What the curve depends on: model, dtype, device, CPU threads, torch version, and the
    linear layout ``fastpath`` chose for the dtype (the packed bf16 one is ~1.2x faster)."""
    from . import fastpath

    layout = fastpath.CHOSEN.get(target.dtype, fastpath.LAYOUTS.get(target.dtype))
    return (f"{target.name}|{target.dtype}|{target.device}|threads={torch.get_num_threads()}|"
            f"torch={torch.__version__}|linear={layout or 'stock'}")


def cost_model_path(target) -> Path:
    from .models import cache_dir

    key = cost_model_key(target)
    slug = "".join(c if c.isalnum() else "-" for c in str(target.name))[-40:]
    return cache_dir() / "cost" / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def measure_cost_model(target, tokens=COST_TOKENS, prefix: int = COST_PREFIX, trials: int = 5) -> CostModel:
    """Time the target (a few seconds) with ``bench --verify-cost``'s code: the curve at
    ``prefix`` cached tokens, and a few points at a longer prefix for the attention term."""
    from .timing import measure_verify_cost

    prefix = max(1, min(prefix, target.max_context // 4))  # small test models have short contexts
    room = target.max_context - prefix
    tokens = [t for t in tokens if t <= room] or [1]
    rows = measure_verify_cost(target, tokens, prefix, trials, warmup=1, progress=False)
    model = CostModel([r["tree_tokens"] for r in rows], [r["ms_median"] / 1000 for r in rows], prefix)
    long_prefix = min(COST_LONG_PREFIX, target.max_context - max(COST_LONG_TOKENS) - 1)
    if long_prefix > 2 * prefix:
        far = measure_verify_cost(target, list(COST_LONG_TOKENS), long_prefix, trials, warmup=1, progress=False)
        slopes = [(r["ms_median"] / 1000 - model(r["tree_tokens"])) / (r["tree_tokens"] * (long_prefix - prefix))
                  for r in far]
        model.per_kv = max(0.0, sorted(slopes)[len(slopes) // 2])
    model.key = cost_model_key(target)
    return model


def load_cost_model(target, refresh: bool = False, measure=measure_cost_model) -> CostModel:
    """The cached cost model of ``target`` on this machine; measured (and cached) on first
    use or when ``refresh``. A damaged cache file is measured again."""
    path = cost_model_path(target)
    if not refresh:
        try:
            model = CostModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if model.key == cost_model_key(target):
                return model
        except (OSError, ValueError, KeyError, TypeError, SpecdraftError):
            pass
    model = measure(target)
    from .bench.store import write_json_atomic

    try:
        write_json_atomic(path, model.to_dict())
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return model
