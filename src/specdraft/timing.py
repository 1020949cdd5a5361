"""What one target forward costs against the number of tree tokens it verifies: the
measurement adaptive drafting's cost model (``costmodel.measure_cost_model``) and
``specdraft bench --verify-cost`` (``bench.verify_cost``) share.

With P cached tokens (a prompt of a few hundred tokens), the target runs N new tokens
(N = 1 ... 256) at positions P ... P + N - 1 under a chain mask, plus the logits head:
exactly the engine's "verify" stage for a tree of N tokens (an attention mask's
sparsity does not change SDPA's cost, so a chain stands for any tree). The cache is
not committed, so every trial overwrites the same slots. The ratio cost(N) / cost(1)
is how much drafting N - 1 tokens per step may cost before speculation stops paying.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .cache import CompactCache
from .errors import SpecdraftError
from .models import Target


def machine_busy_seconds(stat: str = "/proc/stat") -> tuple[float, int] | None:
    """(CPU seconds every process of the machine has been busy, summed over its CPUs; the
    number of CPUs) from ``stat``'s first lines, or None where it is missing (not Linux) or
    not in /proc/stat's format. Busy: user, nice, system, irq, softirq and steal (a
    hypervisor's other guests slow a measurement as much as a local job); idle and iowait
    are not."""
    try:
        with open(stat, encoding="ascii") as f:
            lines = f.read().splitlines()
        fields = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        idle = fields[3] + fields[4]
    except (OSError, ValueError, IndexError):  # unreadable or unexpected: say nothing rather than fail a run
        return None
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    busy = sum(fields) - idle
    return busy / os.sysconf("SC_CLK_TCK"), max(cpus, 1)


class OtherLoad:
    """The share of the machine's CPU time that processes other than this one used between
    construction and ``share()``: a timing taken beside another job measures the contention
    (two PyTorch processes on 2 cores slow each other 2-3x, and not uniformly across shapes:
    a cost curve measured so priced a 4-row, 2-token tree at 1.18x a plain step where a quiet
    measurement says 1.31x and the engine's steps 1.45x)."""

    def __init__(self, stat: str = "/proc/stat"):
        self.stat = stat
        self.start = (machine_busy_seconds(stat), time.process_time(), time.perf_counter())

    def share(self) -> float | None:
        """Others' CPU seconds / (wall seconds x CPUs) since construction; None where the
        machine's counters are unavailable or too little time passed to say (< 0.5 s)."""
        before, own_before, wall_before = self.start
        after = machine_busy_seconds(self.stat)
        wall = time.perf_counter() - wall_before
        if before is None or after is None or wall < 0.5:
            return None
        others = (after[0] - before[0]) - (time.process_time() - own_before)
        return min(max(others / (wall * after[1]), 0.0), 1.0)


def median_call_us(call, calls: int, warmup: int = 5) -> float:
    """Microseconds of ``call()``: the median of ``calls`` timed calls after ``warmup`` untimed
    ones (first calls pay for allocation and kernel selection). For CPU kernels (no sync)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_forward(target: Target, cache: CompactCache, n: int, prefix: int, trials: int, warmup: int) -> list[float]:
    """Seconds of `trials` forwards (+ logits) of n chain tokens per row after the cached
    prefix, for every row of ``cache`` at once (B rows: B x n tokens)."""
    device = target.device
    B = cache.lengths.shape[0]
    ids = torch.randint(target.vocab_size, (B, n), generator=torch.Generator().manual_seed(n)).to(device)
    positions = (prefix + torch.arange(n, device=device))[None].expand(B, n)
    chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(B, n, n)
    mask = cache.attention_mask(chain)
    times = []
    with torch.no_grad():
        for i in range(warmup + trials):
            synchronize(device)
            start = time.perf_counter()
            target.logits(target.forward(ids, positions, mask, cache))
            synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return times


def prefill(target: Target, prefix: int, capacity: int, rows: int = 1,
            ids: torch.Tensor | None = None) -> CompactCache:
    """A cache of ``rows`` rows, each holding ``prefix`` tokens, committed: ``ids`` (rows,
    prefix) if given, else random ones (seeded)."""
    device = target.device
    cache = CompactCache(target.num_layers, rows, capacity, device).allocate(*target.kv_shape, target.dtype)
    if ids is None:
        ids = torch.randint(target.vocab_size, (rows, prefix), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    pos = torch.arange(prefix, device=device)
    causal = (pos[:, None] >= pos[None, :])[None].expand(rows, prefix, prefix)
    with torch.no_grad():
        target.forward(ids, pos[None].expand(rows, prefix), cache.attention_mask(causal), cache)
    cache.commit(pos[None].expand(rows, prefix), torch.full((rows,), prefix, device=device))
    return cache


def time_in_rounds(target: Target, shapes: dict, prefix: int, trials: int, warmup: int,
                   progress: bool = False) -> dict:
    """key -> seconds of ``trials`` forwards, for shapes {key: (cache, n tokens per row)}.

    Trials go round every shape (not all trials of one shape in a row): a slow spell of the
    machine then spreads over all shapes instead of inflating one. Seen with trials in a row
    (3 each): N = 3 read 52.7 ms between 36.8 (N = 2) and ~40 (N = 4), and the adaptive
    policy, believing a third token cost 16 ms, cut the shipped head's beams to one token."""
    from tqdm.auto import tqdm

    for cache, n in shapes.values():
        time_forward(target, cache, n, prefix, 0, warmup)
    times = {key: [] for key in shapes}
    for _ in tqdm(range(trials), desc="verify cost", unit="round", disable=not progress):
        for key, (cache, n) in shapes.items():
            times[key] += time_forward(target, cache, n, prefix, 1, 0)
    return times


def paired_medians(times: dict, base) -> dict:
    """key -> seconds for ``time_in_rounds``' output: the median of ``base``'s trials times,
    per key, the median over rounds of its trial over ``base``'s trial of the same round.

    Why not each key's own median: this machine's speed swings 2-3x within seconds (a
    shared VM), spells long enough to cover several trials of one shape; a ratio within a
    round sees one speed, so the curve's shape (what the adaptive policy weighs: a 16 x 2
    tree against a 16 x 1 step) survives a swing that the level does not."""
    import statistics

    ref = statistics.median(times[base])
    return {key: ref * statistics.median(t / b for t, b in zip(ts, times[base])) for key, ts in times.items()}


def measure_verify_cost(target: Target, tokens: list[int], prefix: int = 256, trials: int = 10,
                        warmup: int = 2, progress: bool = True) -> list[dict]:
    """One row per N: median / min / max milliseconds and the ratio to N = 1."""
    if not tokens or min(tokens) < 1:
        raise SpecdraftError("--verify-tokens must be integers >= 1")
    if prefix < 1 or prefix + max(tokens) > target.max_context:
        raise SpecdraftError(f"--verify-prefix {prefix} + {max(tokens)} tree tokens must fit the target's "
                             f"context ({target.max_context})")
    cache = prefill(target, prefix, prefix + max(tokens) + 8)
    sizes = sorted(set(tokens))
    times = time_in_rounds(target, {n: (cache, n) for n in sizes}, prefix, trials, warmup, progress)
    paired = paired_medians(times, sizes[0])
    rows = []
    for n in sizes:
        rows.append({"tree_tokens": n, "ms_median": 1000 * statistics.median(times[n]), "ms_paired": 1000 * paired[n],
                     "ms_min": 1000 * min(times[n]), "ms_max": 1000 * max(times[n]), "trials": trials})
    base = rows[0]["ms_median"] if rows[0]["tree_tokens"] == 1 else None
    for r in rows:
        r["relative_to_one_token"] = r["ms_median"] / base if base else None
        r["ms_per_token"] = r["ms_median"] / r["tree_tokens"]
    return rows
