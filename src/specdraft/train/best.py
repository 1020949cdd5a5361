"""OUT/best: the drafter at its best held-out evaluation, kept beside OUT/final.

The end of a schedule is not always its best point: a head trained for several epochs on a
small corpus peaks and then loses held-out τ (Gemma 3 270M, docs/fit.md: τ 1.42 after one
epoch, 1.36 after two). Every trainer scores the drafter on held-out data on its schedule
(``common.HeldOut``); ``KeepBest`` saves the drafter whenever one score, ``key`` (the
engine-exact τ at the trained shape), beats every earlier one of the run, so the run leaves
both the schedule's end (OUT/final) and its best point (OUT/best).

Invariants:
- OUT/best.json ({"step", "tokens", key}) describes OUT/best: the folder is written under
  a temporary name, the record removed, the folder renamed into place, the record written,
  so a run stopped at any moment never leaves a record of another drafter than OUT/best
  (at worst no record: the resumed run then saves again at its next evaluation).
- Ties keep the earlier drafter (a later one is better only if it scores higher).
- A resumed run starts from best.json's score; a run that starts from scratch ignores it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

BEST = "best"
RECORD = "best.json"


class KeepBest:
    """Called with each held-out score (a dict holding ``key``); saves through
    ``save(name)`` (the drafter into the folder ``out/name``, as trainers save "final")
    when the score is the run's best so far. ``enabled``: the main process only (every
    process scores, one writes)."""

    def __init__(self, out: Path, key: str, save, state, resumed: bool, enabled: bool):
        self.out, self.key, self.save, self.state, self.enabled = Path(out), key, save, state, enabled
        self.value = -math.inf
        record = self.out / RECORD
        if resumed and record.is_file():
            self.value = json.loads(record.read_text()).get(key, -math.inf)

    def __call__(self, found: dict) -> None:
        if not self.enabled or self.key not in found or not found[self.key] > self.value:
            return
        self.value = found[self.key]
        staged, folder = self.out / f"{BEST}.tmp", self.out / BEST
        shutil.rmtree(staged, ignore_errors=True)
        self.save(staged.name)
        (self.out / RECORD).unlink(missing_ok=True)  # no record while the folder is swapped
        shutil.rmtree(folder, ignore_errors=True)
        staged.rename(folder)
        entry = {"step": self.state.step, "tokens": self.state.tokens, self.key: self.value}
        (self.out / RECORD).write_text(json.dumps(entry) + "\n")

    def describe(self) -> str | None:
        """'best held-out KEY V at step S: OUT/best', or None before any score."""
        record = self.out / RECORD
        if not self.enabled or not record.is_file():
            return None
        entry = json.loads(record.read_text())
        return f"best held-out {self.key} {entry[self.key]:.4f} at step {entry['step']}: {self.out / BEST}"
