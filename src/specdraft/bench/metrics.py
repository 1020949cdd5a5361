"""The figures of a benchmark row, as pure functions of raw measurements.

Definitions (docs/bench.md gives the same in prose):

- tokens/s of one repeat = new tokens of all prompts / wall seconds of all batches.
  A row reports the median over repeats and the min and max.
- τ (block efficiency) = new tokens / target forward passes, summed over prompts; a
  request's forward passes are the engine's ``steps`` (prefill counted), so plain
  decoding has τ = 1 exactly.
- acceptance by depth k = fraction of decode steps (prefill excluded) that accepted at
  least k drafted tokens. From ``accepted_hist`` (tokens gained per step -> steps): a
  step that gained n tokens accepted n - 1 drafts (the last token is the target's own).
- MBSU (memory-bound speed-up) = τ / (1 + γ · N_draft / N_target).
- speed-up = this row's median tokens/s / the reference row's median tokens/s, both
  measured in the same run on the same prompts and settings.
"""

from __future__ import annotations

import resource
import statistics
from collections import Counter
from pathlib import Path

import torch

STAGE_KEYS = ("prefill", "draft", "verify", "accept", "update", "other")


def rate_summary(tokens: list[int], seconds: list[float]) -> dict:
    """tokens/s per repeat and their median, min and max."""
    rates = [t / s if s > 0 else 0.0 for t, s in zip(tokens, seconds)]
    return {"tokens_per_second": statistics.median(rates), "tokens_per_second_min": min(rates),
            "tokens_per_second_max": max(rates), "tokens_per_second_repeats": rates}


def block_efficiency(new_tokens: int, steps: int) -> float | None:
    """τ = new tokens / target forwards; None when the forwards were not counted."""
    return new_tokens / steps if steps else None


def merge_hists(hists: list[dict]) -> dict[int, int]:
    """Sum accepted-length histograms (keys may be str after a JSON round trip)."""
    total: Counter = Counter()
    for h in hists:
        for k, v in h.items():
            total[int(k)] += int(v)
    return dict(sorted(total.items()))


def acceptance_by_depth(hist: dict[int, int], requests: int) -> dict[int, float]:
    """{k: fraction of decode steps that accepted >= k drafted tokens}, k = 1..max.

    ``hist`` counts each request's prefill as one step that gained 1 token; those
    ``requests`` steps drafted nothing and are taken out first.
    """
    decode = dict(hist)
    decode[1] = decode.get(1, 0) - requests
    n_steps = sum(v for v in decode.values() if v > 0)
    deepest = max((k for k, v in decode.items() if v > 0), default=1) - 1
    if n_steps <= 0 or deepest < 1:
        return {}
    return {k: sum(v for n, v in decode.items() if n - 1 >= k and v > 0) / n_steps
            for k in range(1, deepest + 1)}


def mbsu(tau: float | None, gamma: int | None, n_draft: int | None, n_target: int) -> float | None:
    """Memory-bound speed-up τ / (1 + γ·N_draft/N_target); None without a draft model."""
    if tau is None or not gamma or not n_draft:
        return None
    return tau / (1 + gamma * n_draft / n_target)


def speedup(rate: float | None, reference: float | None) -> float | None:
    """rate / reference, None when either is missing or the reference is 0."""
    if rate is None or not reference:
        return None
    return rate / reference


def batch_stages(stage_seconds: list[dict], wall: float) -> dict[str, float]:
    """One batch's stage seconds from its requests' snapshots, plus the untimed rest.

    Every request of a batch reports the shared timer at the moment it finished, so the
    last one to finish (the largest total) holds the whole batch. "update" and the time
    outside all stages are both bookkeeping: "other" is wall - timed stages.
    """
    last = max(stage_seconds, key=lambda s: sum(s.values()))
    stages = {k: float(last.get(k, 0.0)) for k in STAGE_KEYS if k != "other"}
    stages["other"] = max(0.0, wall - sum(stages.values()))
    return stages


def add_stages(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {k: total.get(k, 0.0) + more.get(k, 0.0) for k in STAGE_KEYS}


def stage_fractions(stages: dict[str, float]) -> dict[str, float]:
    total = sum(stages.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in stages.items()}


class PeakMemory:
    """Peak memory of one measured row: CUDA max allocated on GPU, process RSS on CPU.

    The RSS peak is per process; Linux lets a process reset it (write 5 to
    /proc/self/clear_refs), which makes it per row. Where that is refused the reading
    is the process's lifetime peak, and ``reset_ok`` says so.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset_ok = True

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.reset_ok = False

    def read(self) -> dict:
        """{'peak_memory_mb', 'memory_kind', 'memory_peak_is_per_row'}."""
        if self.cuda:
            torch.cuda.synchronize()
            return {"peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
                    "memory_kind": "cuda_max_allocated", "memory_peak_is_per_row": True}
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {"peak_memory_mb": kib / 1024, "memory_kind": "process_rss_peak",
                "memory_peak_is_per_row": self.reset_ok}
