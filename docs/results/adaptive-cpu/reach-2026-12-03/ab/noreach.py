"""A/B for the drafter-reach fix in one interleaved bench: the second engine built for the same
base spec (e.g. `auto` then `auto@int8`, int8 being the default anyway) gets max_depth() -> None,
i.e. the policy as before the fix (plans priced up to MAX_DEPTH)."""
import sys
from specdraft import cli
from specdraft.bench import methods as M
seen = {}
orig = M.EngineMethod.__init__
def init(self, spec, *a, **k):
    orig(self, spec, *a, **k)
    seen[spec] = seen.get(spec, 0) + 1
    if seen[spec] == 2:
        self.engine.drafter.max_depth = lambda: None
        print(f"[noreach] {spec}: max_depth -> None", file=sys.stderr)
M.EngineMethod.__init__ = init
sys.exit(cli.main(sys.argv[1:]))
