"""A/B of ``sampling.sample``'s direct running sum for narrow rows in one interleaved bench: the
second engine built for the same method spec (e.g. `redrafter:default` then
`redrafter:default@int8`, the same head in bfloat16) runs its steps with
``SAMPLE_DIRECT_MAX = 0``: every draw through the two-level inverse CDF, as before 2026-12-08.
Usage: python twolevel.py bench --drafters ...  (the arguments of `specdraft`)."""
import sys

from specdraft import sampling
from specdraft.bench.ab import patch_second_engine
from specdraft.cli import main


def two_level(engine):
    step = engine.step

    def old_step(*args, **kw):
        saved = sampling.SAMPLE_DIRECT_MAX
        sampling.SAMPLE_DIRECT_MAX = 0
        try:
            return step(*args, **kw)
        finally:
            sampling.SAMPLE_DIRECT_MAX = saved
    engine.step = old_step


patch_second_engine(two_level, "every draw through the two-level inverse CDF")
sys.exit(main(sys.argv[1:]))
