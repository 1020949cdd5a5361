"""In-run A/B arms for ``specdraft bench``: one method listed twice under two spellings of the
same spec (e.g. ``lookup@1x4/fixed`` and ``lookup@1x4/fixed/int8``, int8 being the default
anyway), its second engine changed by a patch, so that both arms run interleaved in one process
and one run's drift touches them alike (separate runs on these VMs drift by 10-30%).

Worked example (docs/results/batched-trees-2026-12-07/unpacked.py)::

    def grouped(engine):          # the second engine: every step with the old attention
        step = engine.step
        def old_step(*args, **kw):
            ...                   # set the old state, call step, restore
        engine.step = old_step

    patch_second_engine(grouped, "trees through the grouped kernel")
    sys.exit(specdraft.cli.main(sys.argv[1:]))   # the script runs the command line itself
"""

from __future__ import annotations

import sys
from typing import Callable


def patch_second_engine(patch: Callable, label: str) -> None:
    """From now on, the second ``EngineMethod`` built for a spec gets ``patch(engine)``."""
    from . import methods

    seen: dict[str, int] = {}
    original = methods.EngineMethod.__init__

    def init(self, spec, *args, **kwargs):
        original(self, spec, *args, **kwargs)
        seen[spec] = seen.get(spec, 0) + 1
        if seen[spec] == 2:
            patch(self.engine)
            print(f"[A/B] {spec}: {label}", file=sys.stderr)

    methods.EngineMethod.__init__ = init

