"""A trace of the adaptive policy's decisions, for finding out why it drafted (or did not).

Set ``SPECDRAFT_PLAN_TRACE=FILE`` (any process that runs the engine: ``generate``, ``bench``,
``serve``) and every planned step appends one JSON line to FILE:

    {"pid": 4711, "drafter": "LookupDrafter", "t": 12.503, "rows": 16, "depth": 1, "probe": false, "look": false,
     "a1": [0.41, ...], "k1": [2.0, ...], "offer": [0.93, ...], "pool": 0.47, "s": [0.141, 0.211, 0.262],
     "ratio": {"plain": 1.02, "tree": 1.11}, "credit": 0.004, "share": 0.03}

pid: the process (several servers may share one FILE); drafter: the engine's drafter class
(a lockstep bench runs several engines in one process); t: seconds since this engine's
first traced step; a1, k1, offer: each row's depth-1 rate, the strength of its prior in
trials (``RateSpread``) and its offer rate (``RowStats``); pool:
the pooled depth-1 rate a new request starts from; s: the modelled seconds of a step
verifying 1, 2, 3 tokens per row (``AdaptivePolicy.seconds``); ratio: the step-cost ratios
at this batch size; credit / share: the probe credit and its share; extra: the depth drafted
beyond the plan (``AdaptivePolicy.slack``); draft: the drafter call's seconds by depth (``DraftTimer``).
Off (the default), it costs one attribute read per step.
"""

from __future__ import annotations

import json
import os
import time


class PlanTrace:
    """Appends the policy's per-step decision to the file named by SPECDRAFT_PLAN_TRACE."""

    def __init__(self, path: str | None = None, drafter: str = ""):
        self.path = path if path is not None else os.environ.get("SPECDRAFT_PLAN_TRACE") or None
        self.start, self.drafter = None, drafter

    def __call__(self, policy, stats, depth: int, width: int) -> None:
        if self.path is None:
            return
        now = time.perf_counter()
        self.start = now if self.start is None else self.start
        rows = len(stats)
        seconds = policy.seconds(rows, width)
        record = {
            "pid": os.getpid(), "drafter": self.drafter, "t": round(now - self.start, 3), "rows": rows, "depth": depth,
            "probe": policy.probing, "look": policy.looking,
            "a1": [round(s.rates(1)[0], 3) for s in stats], "k1": [round(s.strength, 1) for s in stats],
            "offer": [round(s.offer_rate, 3) for s in stats],
            "pool": round(policy.pooled(stats[0].base), 3) if stats else None,
            "s": [round(seconds(n), 4) for n in range(3)],
            "ratio": {"plain": round(policy.step_ratio(False, rows), 3), "tree": round(policy.step_ratio(True, rows), 3)},
            "credit": round(policy.probe_credit, 4), "share": round(policy.explore_share(rows), 4),
            "catch_up": {"gap": policy.draft_time.gap, "per_step": round(policy.draft_time.per_step, 5)},
            "extra": policy.extra, "draft": {d: round(v, 5) for d, v in sorted(policy.draft_time.seconds.items())},
        }
        with open(self.path, "a") as f:  # one line per step: a crash loses nothing before it
            f.write(json.dumps(record) + "\n")
