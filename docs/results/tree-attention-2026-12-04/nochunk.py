"""A/B of bf16 query chunking in one interleaved bench: the second engine built for the same
base spec (e.g. `auto` then `auto@int8`, int8 being the default anyway) runs its steps with
fastpath.QUERY_CHUNK empty (tree queries in one SDPA call, not groups of 3 rows)."""
import sys
from specdraft import cli, fastpath
from specdraft.bench import methods as M
seen = {}
orig = M.EngineMethod.__init__
def init(self, spec, *a, **k):
    orig(self, spec, *a, **k)
    seen[spec] = seen.get(spec, 0) + 1
    if seen[spec] == 2:
        eng = self.engine
        step = eng.step
        def unchunked_step(*args, **kw):
            saved = dict(fastpath.QUERY_CHUNK)
            fastpath.QUERY_CHUNK.clear()
            try:
                return step(*args, **kw)
            finally:
                fastpath.QUERY_CHUNK.update(saved)
        eng.step = unchunked_step
        print(f"[nochunk] {spec}: steps without query chunking", file=sys.stderr)
M.EngineMethod.__init__ = init
sys.exit(cli.main(sys.argv[1:]))
