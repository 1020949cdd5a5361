"""The cost model of adaptive drafting: seconds of one target forward against the padded
tree tokens of the whole batch, T = B x N (the packed tree is padded to its longest row,
and every padded slot is computed), plus an attention term growing with the cached width.

Measured once per target / dtype / device / threads with the ``bench --verify-cost`` code
(``timing.measure_verify_cost``) and cached on disk (``load_cost_model``);
``adaptive.StepCostRatio`` corrects it on line.

T tokens do not cost the same in every layout: one row of 16 chained tokens attends over a
16 x (P + 16) block, 4 rows of 4 over four 4 x (P + 4) blocks. On the 2-core EPYC (SmolLM2,
bfloat16, 128 cached) T = 16 cost 59.6 ms as 1 x 16, 50.6 as 4 x 4 and 48.8 as 16 x 1; T = 64
171.5 as 1 x 64 and 119.3 as 16 x 4. The one-row curve alone made batched trees look dear and
kept the policy at one drafted token at batch 4, where the fixed 1 x 3 shape ran 10% faster
than plain decoding. So the model also holds curves at a few batch sizes (``BATCH_ROWS``:
seconds against tokens per row) and interpolates between them in B. Worked example: 16 rows
drafting one token each verify 16 x 2; measured 74.8 ms against 48.8 ms for the plain step
of those rows (1.53x), so one drafted token per row pays only if more than 53% of them are
accepted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import SpecdraftError

log = logging.getLogger("specdraft.costmodel")

COST_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
COST_PREFIX = 128  # cached tokens of the main curve
COST_LONG_PREFIX = 640  # a second, shorter curve here gives the attention term
COST_LONG_TOKENS = (1, 8, 32)
BATCH_ROWS = (4, 16)  # batch sizes with their own curve (batch 1: the main curve)
BATCH_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per row measured at those batch sizes
BUSY_SHARE = 0.1  # others' share of the CPU above which a measured model is not cached (load_cost_model)
FORMAT = 7  # 2: with batch curves; 3: paired within rounds; 4: tree attention without repeated
# key/value heads (fastpath.masked_gqa_sdpa: trees got cheaper); 5: kept only if measured on a
# quiet machine (BUSY_SHARE): an older cached model may be a busy spell's, so it is measured again;
# 6: bf16 tree attention in one SDPA call unless Target.tree_attention is "bitwise" (trees got cheaper);
# 7: reduced-precision trees of several rows with packed query heads (fastpath.PACKED_TREE_DTYPES)


@dataclass
class CostModel:
    """Seconds of one verify forward (+ logits) against padded tree tokens.

    tokens:  increasing T values, tokens[0] == 1 (batch 1, a chain of T tokens)
    seconds: forward seconds at each T with ``prefix`` tokens cached
    per_kv:  extra seconds per (tree token x cached slot) beyond ``prefix`` (attention)
    batch:   {B: seconds at each of ``batch_tokens`` chain tokens per row, B rows} for B > 1
             (empty: every layout of T tokens costs the one-row curve's T)
    Invariant after construction: every curve is non-decreasing (a forward of more tokens
    never costs less): the readings' least-squares non-decreasing fit (``monotone_fit``), so
    one noisy reading, high or low, is averaged with its neighbours instead of carried on to
    every larger size as a running max would.
    """

    tokens: list[int]
    seconds: list[float]
    prefix: int = COST_PREFIX
    per_kv: float = 0.0
    key: str = ""
    batch_tokens: list[int] = field(default_factory=list)
    batch: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        if not valid_curve(self.tokens, self.seconds) or \
                any(B < 2 or not valid_curve(self.batch_tokens, ys) for B, ys in self.batch.items()):
            raise SpecdraftError("a cost model needs increasing token counts from 1 and positive seconds")
        self.seconds = monotone_fit([float(s) for s in self.seconds])
        self.batch = {int(B): monotone_fit([float(s) for s in ys]) for B, ys in sorted(self.batch.items())}
        self.per_kv = max(0.0, float(self.per_kv))

    def __call__(self, tokens: int, width: int | None = None, rows: int = 1) -> float:
        """Seconds of a forward over ``tokens`` padded tree tokens in ``rows`` rows (tokens /
        rows each) with ``width`` cached slots."""
        tokens = max(int(tokens), 1)
        rows = min(max(int(rows), 1), tokens)
        base = self._curve(tokens) if rows == 1 or not self.batch else self._batched(rows, tokens / rows)
        if width is None:
            return base
        return base + self.per_kv * tokens * max(0, width - self.prefix)

    def _curve(self, t: float) -> float:
        return interpolate(self.tokens, self.seconds, t)

    def _batched(self, rows: int, n: float) -> float:
        """rows x n tokens: the batch curves at n, linear in B between the measured batch
        sizes (batch 1: the main curve) and along the last two beyond them."""
        sizes = [1] + list(self.batch)
        at = [self._curve(n)] + [interpolate(self.batch_tokens, ys, n) for ys in self.batch.values()]
        if rows >= sizes[-1]:
            lo = len(sizes) - 2
        else:
            lo = next(i for i in range(len(sizes) - 1) if sizes[i + 1] > rows)
        slope = max((at[lo + 1] - at[lo]) / (sizes[lo + 1] - sizes[lo]), 0.0)
        return at[lo] + slope * (rows - sizes[lo])

    def to_dict(self) -> dict:
        return {"format": FORMAT, "tokens": self.tokens, "seconds": self.seconds, "prefix": self.prefix,
                "per_kv": self.per_kv, "key": self.key, "batch_tokens": self.batch_tokens,
                "batch": {str(B): ys for B, ys in self.batch.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(tokens=[int(t) for t in d["tokens"]], seconds=[float(s) for s in d["seconds"]],
                   prefix=int(d.get("prefix", COST_PREFIX)), per_kv=float(d.get("per_kv", 0.0)),
                   key=str(d.get("key", "")), batch_tokens=[int(t) for t in d.get("batch_tokens", [])],
                   batch={int(B): [float(s) for s in ys] for B, ys in d.get("batch", {}).items()})


def valid_curve(tokens: list[int], seconds: list[float]) -> bool:
    return bool(tokens) and len(tokens) == len(seconds) and tokens[0] == 1 and \
        all(b > a for a, b in zip(tokens, tokens[1:])) and min(seconds) > 0


def interpolate(xs: list[int], ys: list[float], t: float) -> float:
    """ys at t, linear between the points; beyond the last one the last slope goes on."""
    if t >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]
        return ys[-1] + slope * (t - xs[-1])
    i = next(i for i, x in enumerate(xs) if x >= t)
    if xs[i] == t or i == 0:
        return ys[i]
    frac = (t - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + frac * (ys[i] - ys[i - 1])


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
    """What the curve depends on: model, dtype, device, CPU threads, torch version, the
    linear layout ``fastpath`` chose for the dtype (the packed bf16 one is ~1.2x faster), and
    how many sibling linears it stacks (``siblings``: ~8% off a bf16 one-token forward), and
    whether the target runs compiled (``Target.compile``: up to ~2x faster forwards; "size-classes":
    since each class of rows has its own graph and GEMMs, ``graphs``; 8 tree tokens 2.6x -> 2.2x
    a one-token step; "aot": ``aot.compile_packaged``'s packages, other code again), and
    whether its tree attention is chunked (``Target.tree_attention``: 8 tree tokens ~1.2x dearer)."""
    from . import fastpath, siblings

    stacked = siblings.stacked_groups(target.model) if hasattr(target, "model") else 0
    chunked = getattr(target, "tree_attention", "fast") == "bitwise" and target.dtype in fastpath.QUERY_CHUNK
    return (f"{target.name}|{target.dtype}|{target.device}|threads={torch.get_num_threads()}|"
            f"torch={torch.__version__}|linear={fastpath.layout_name(target.dtype)}|cost={FORMAT}"
            + (f"|stacked={stacked}" if stacked else "")
            + (("|compiled=aot" if getattr(target, "packaged", None) is not None else "|compiled=size-classes")
               if getattr(target, "compiled", False) else "")
            + ("|tree=bitwise" if chunked else ""))


def cost_model_path(target) -> Path:
    """$SPECDRAFT_COST_CACHE/NAME-KEY.json, else the model cache's ``cost`` folder (the
    tests point the variable at a temporary folder: their tiny models' curves are not the
    user's)."""
    from .models import cache_dir

    key = cost_model_key(target)
    slug = "".join(c if c.isalnum() else "-" for c in str(target.name))[-40:]
    root = Path(os.environ["SPECDRAFT_COST_CACHE"]) if os.environ.get("SPECDRAFT_COST_CACHE") else cache_dir() / "cost"
    return root / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def measure_cost_model(target, tokens=COST_TOKENS, prefix: int = COST_PREFIX, trials: int = 5) -> CostModel:
    """Time the target (a few seconds) with ``bench --verify-cost``'s code: the curve at
    ``prefix`` cached tokens, and a few points at a longer prefix for the attention term."""
    from .timing import measure_verify_cost

    prefix = max(1, min(prefix, target.max_context // 4))  # small test models have short contexts
    room = target.max_context - prefix
    tokens = [t for t in tokens if t <= room] or [1]
    rows = measure_verify_cost(target, tokens, prefix, trials, warmup=1, progress=False)
    model = CostModel([r["tree_tokens"] for r in rows], [r["ms_paired"] / 1000 for r in rows], prefix,
                      **measure_batches(target, prefix, trials))
    long_prefix = min(COST_LONG_PREFIX, target.max_context - max(COST_LONG_TOKENS) - 1)
    if long_prefix > 2 * prefix:
        far = measure_verify_cost(target, list(COST_LONG_TOKENS), long_prefix, trials, warmup=1, progress=False)
        slopes = [(r["ms_paired"] / 1000 - model(r["tree_tokens"])) / (r["tree_tokens"] * (long_prefix - prefix))
                  for r in far]
        model.per_kv = max(0.0, sorted(slopes)[len(slopes) // 2])
    model.key = cost_model_key(target)
    return model


def measure_batches(target, prefix: int, trials: int, rows=BATCH_ROWS, tokens=BATCH_TOKENS) -> dict:
    """The batch curves: ``trials`` forwards of B rows x N chain tokens, taken in rounds over
    every (B, N) (``timing.time_in_rounds``); per B, N tokens' time relative to one token's
    in the same round (``timing.paired_medians``)."""
    from .timing import paired_medians, prefill, time_in_rounds

    tokens = [n for n in tokens if prefix + n <= target.max_context]
    caches = {B: prefill(target, prefix, prefix + max(tokens) + 8, rows=B) for B in rows}
    times = time_in_rounds(target, {(B, n): (caches[B], n) for B in rows for n in tokens}, prefix, trials, 1)
    curves = {}
    for B in rows:
        paired = paired_medians({n: times[(B, n)] for n in tokens}, tokens[0])
        curves[B] = [paired[n] for n in tokens]
    return {"batch_tokens": tokens, "batch": curves}


def load_cost_model(target, refresh: bool = False, measure=measure_cost_model) -> CostModel:
    """The cached cost model of ``target`` on this machine; measured (and cached) on first
    use or when ``refresh``. A damaged cache file is measured again. A model measured while
    other processes used more than ``BUSY_SHARE`` of the CPU serves this run but is not
    cached (logged at INFO): cached, a busy spell's curve would price every later run, and
    the next use measures it again."""
    from .timing import OtherLoad

    path = cost_model_path(target)
    if not refresh:
        try:
            model = CostModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if model.key == cost_model_key(target):
                return model
        except (OSError, ValueError, KeyError, TypeError, SpecdraftError):
            pass
    load = OtherLoad()
    model = measure(target)
    busy = load.share()
    if busy is not None and busy > BUSY_SHARE:  # logged, not printed: a CLI's stderr stays its own
        log.info("other processes used %.0f%% of the CPU while the cost model of %s was measured; "
                 "used for this run, not cached", 100 * busy, target.name)
        return model
    from .bench.store import write_json_atomic

    try:
        write_json_atomic(path, model.to_dict())
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return model
