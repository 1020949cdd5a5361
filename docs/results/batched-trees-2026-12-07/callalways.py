"""A/B of skipping the drafter call when no row may draft, in one interleaved bench: the second
engine built for the same method spec (e.g. `lookup@1x4/fixed` then `lookup@1x4/fixed/int8`)
calls its drafter on every step without a policy, as before 2026-12-07 (late).
Usage: python callalways.py bench --drafters ...  (the arguments of `specdraft`)."""
import sys

from specdraft import cli
from specdraft.bench import methods as M

seen = {}
orig = M.EngineMethod.__init__


def init(self, spec, *a, **k):
    orig(self, spec, *a, **k)
    seen[spec] = seen.get(spec, 0) + 1
    if seen[spec] == 2:
        engine = self.engine
        plan = engine._plan

        def old_plan(batch, ctx, stats, weights):
            return (None, ctx) if stats is None else plan(batch, ctx, stats, weights)
        engine._plan = old_plan
        print(f"[callalways] {spec}: the drafter called on every step", file=sys.stderr)


M.EngineMethod.__init__ = init
sys.exit(cli.main(sys.argv[1:]))
