"""A/B of packed query heads for batched trees in one interleaved bench: the second engine built
for the same method spec (e.g. `redrafter:default@1x2/fixed` then `.../fixed/int8`) runs its
steps with fastpath.PACKED_TREE_DTYPES empty (every tree through the grouped SDPA kernel, as
before 2026-12-07). With AB_NO_CAP=1 the second engine drafts its fixed shape at any batch size
(no ``max_tree_tokens`` cap, which stops fixed shapes from drafting past 8 rows on a CPU); the
first one too, through ``nocap`` below.
Usage: python unpacked.py bench --drafters ...  (the arguments of `specdraft`)."""
import os

from specdraft import fastpath
from specdraft.bench import methods
import sys

from specdraft.bench.ab import patch_second_engine
from specdraft.cli import main

NO_CAP = os.environ.get("AB_NO_CAP") == "1"
built = methods.EngineMethod.__init__


def nocap(self, *args, **kwargs):
    built(self, *args, **kwargs)
    if NO_CAP:
        self.engine.max_tree_tokens = None


def grouped(engine):
    step = engine.step

    def unpacked_step(*args, **kw):
        saved = fastpath.PACKED_TREE_DTYPES
        fastpath.PACKED_TREE_DTYPES = ()
        try:
            return step(*args, **kw)
        finally:
            fastpath.PACKED_TREE_DTYPES = saved
    engine.step = unpacked_step


methods.EngineMethod.__init__ = nocap
patch_second_engine(grouped, "trees through the grouped kernel")
sys.exit(main(sys.argv[1:]))
