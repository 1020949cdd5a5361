"""What the adaptive policy's bookkeeping costs when it keeps drafting off, in one process.

Three engines over the same target model files, run in turn on one batch of MT-Bench first
turns (greedy, 96 tokens, every row admitted at once), ``--repeats`` times:

    none         plain decoding, no policy
    DRAFTER      ``--drafter`` (default lookup + the shipped head, what ``specdraft serve``
                 runs by default), adaptive
    DRAFTER-plan0  the same with ``plan`` forced to 0: every step plain, the policy still
                 observing every step (the bookkeeping alone)

Prints tokens/s per run and the median full-batch step time per engine. Engines in turn, so
a drifting machine slows each alike; compare medians, not single runs.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/policy_overhead.py --rows 16 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdraft.build import EngineSpec, build_engine
from specdraft.prompts import mtbench_first_turns
from specdraft.sampling import SamplingParams


def run(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(tokens/s of the whole batch, median seconds of the steps with every row still running)."""
    rows = len(prompts)
    batch, _ = engine.start(prompts, [params] * rows, list(range(rows)))
    tokens, full, start = 0, [], time.perf_counter()
    while batch.rows:
        running, began = len(batch.rows), time.perf_counter()
        tokens += sum(len(e.new_ids) for e in engine.step(batch))
        if running == rows:
            full.append(time.perf_counter() - began)
    return tokens / (time.perf_counter() - start), statistics.median(full) if full else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafter", default="lookup+redrafter:default")
    args = ap.parse_args()
    engines = {"none": build_engine(EngineSpec(drafter="none", adaptive="off")),
               args.drafter: build_engine(EngineSpec(drafter=args.drafter, adaptive="on")),
               f"{args.drafter}-plan0": build_engine(EngineSpec(drafter=args.drafter, adaptive="on"))}
    engines[f"{args.drafter}-plan0"].policy.plan = lambda *a, **k: 0  # every step plain, bookkeeping kept
    target = engines["none"].target
    prompts = [target.encode_prompt(q["prompt"], chat=True) for q in mtbench_first_turns()[:args.rows]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            tps, step = run(engine, prompts, params)
            results[name].append((tps, step))
            print(f"repeat {repeat + 1} {name}: {tps:.1f} tokens/s, median full-batch step {step * 1000:.1f} ms", flush=True)
    for name, rs in results.items():
        print(f"{name}: median {statistics.median(r[0] for r in rs):.1f} tokens/s, "
              f"step {statistics.median(r[1] for r in rs) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
