"""A/B of skipping the drafter call when no row may draft, in one interleaved bench: the second
engine built for the same method spec (e.g. `lookup@1x4/fixed` then `lookup@1x4/fixed/int8`)
calls its drafter on every step without a policy, as before 2026-12-07 (late).
Usage: python callalways.py bench --drafters ...  (the arguments of `specdraft`)."""
import sys

from specdraft.bench.ab import patch_second_engine
from specdraft.cli import main


def call_always(engine):
    plan = engine._plan

    def old_plan(batch, ctx, stats, weights):
        return (None, ctx) if stats is None else plan(batch, ctx, stats, weights)
    engine._plan = old_plan


patch_second_engine(call_always, "the drafter called on every step")
sys.exit(main(sys.argv[1:]))
