"""Tokens/s of drafters in one process (build, warm up, N MT-Bench first turns x 128 tokens at
temperature T, seed = prompt index): run in alternating processes under different environments
(docs/results.md, 2026-12-08), e.g.
    python process_ab.py 8 0 none,redrafter:default
    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 python process_ab.py 8 0 none,redrafter:default
    GOMP_SPINCOUNT=20000000 python process_ab.py 6 0 none,redrafter:default
"""
import time, sys, json, os, torch
from specdraft.build import EngineSpec, build_engine, warm_up
from specdraft.prompts import mtbench_first_turns
from specdraft.sampling import SamplingParams
n = int(sys.argv[1]); T = float(sys.argv[2]); drafters = sys.argv[3].split(",")
out = {}
prompts = None
for dname in drafters:
    eng = build_engine(EngineSpec(drafter=dname, adaptive="on" if dname != "none" else "off"))
    warm_up(eng)
    if prompts is None:
        prompts = [eng.target.encode_prompt(q["prompt"], chat=True) for q in mtbench_first_turns()[:n]]
    toks, secs = 0, 0.0
    for i, p in enumerate(prompts):
        s = time.perf_counter()
        r = eng.generate([p], SamplingParams(max_new_tokens=128, temperature=T, seed=i))[0]
        secs += time.perf_counter() - s; toks += len(r.token_ids)
    out[dname] = toks / secs
print(json.dumps({"env": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"), "T": T, **out}))
