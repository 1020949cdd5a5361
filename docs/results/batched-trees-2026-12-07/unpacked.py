"""A/B of packed query heads for batched trees in one interleaved bench: the second engine built
for the same method spec (e.g. `redrafter:default@1x2/fixed` listed twice) runs its steps with
fastpath.PACKED_TREE_DTYPES empty (every tree through the grouped SDPA kernel, as before
2026-12-07). With AB_NO_CAP=1 every engine drafts its fixed shape at any batch size (no
``max_tree_tokens`` cap, which stops fixed shapes from drafting past 8 rows on a CPU).
Usage: python unpacked.py bench --drafters ...  (the arguments of `specdraft`)."""
import os
import sys

from specdraft import cli, fastpath
from specdraft.bench import methods as M

seen = {}
orig = M.EngineMethod.__init__


def init(self, spec, *a, **k):
    orig(self, spec, *a, **k)
    if os.environ.get("AB_NO_CAP") == "1":
        self.engine.max_tree_tokens = None
    seen[spec] = seen.get(spec, 0) + 1
    if seen[spec] == 2:
        step = self.engine.step

        def unpacked_step(*args, **kw):
            saved = fastpath.PACKED_TREE_DTYPES
            fastpath.PACKED_TREE_DTYPES = ()
            try:
                return step(*args, **kw)
            finally:
                fastpath.PACKED_TREE_DTYPES = saved
        self.engine.step = unpacked_step
        print(f"[unpacked] {spec}: trees through the grouped kernel", file=sys.stderr)


M.EngineMethod.__init__ = init
sys.exit(cli.main(sys.argv[1:]))
