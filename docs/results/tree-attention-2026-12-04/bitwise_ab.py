"""A/B of tree attention in one interleaved bench: the second engine built for the same base
spec (e.g. `auto` then `auto@int8`, int8 being the default anyway) runs its steps with
target.tree_attention = "bitwise" (the default before 2026-12-04) and an adaptive policy over
the cost model measured in that mode; the first runs the default ("fast")."""
import sys
from specdraft import cli
from specdraft.bench import methods as M
seen = {}
orig = M.EngineMethod.__init__
def init(self, spec, *a, **k):
    orig(self, spec, *a, **k)
    seen[spec] = seen.get(spec, 0) + 1
    if seen[spec] != 2:
        return
    from specdraft.adaptive import AdaptivePolicy
    from specdraft.costmodel import load_cost_model
    eng = self.engine
    target = eng.target
    def bitwise(fn):
        def run(*args, **kw):
            saved, target.tree_attention = target.tree_attention, "bitwise"
            try:
                return fn(*args, **kw)
            finally:
                target.tree_attention = saved
        return run
    if eng.policy is not None:
        eng.policy = bitwise(lambda: AdaptivePolicy(load_cost_model(target)))()
    eng.step = bitwise(eng.step)
    print(f"[bitwise] {spec}: steps with tree_attention=bitwise", file=sys.stderr)
M.EngineMethod.__init__ = init
sys.exit(cli.main(sys.argv[1:]))
