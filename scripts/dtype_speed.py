"""Plain decoding in bfloat16 against float32 at one batch size, in one process (issue 14).

Loads the target twice (float32 and bfloat16) and runs `--drafter none` engines on the same
batches of MT-Bench first turns, the two dtypes taking turns (every second round in reverse
order), so a VM whose speed drifts between runs affects both alike. ``ignore_eos`` makes
every row write exactly ``--max-new-tokens`` tokens in both dtypes: their texts differ (a
different dtype is a different computation), and tokens/s must not depend on where each
text happens to stop. Prints each round as it ends, then tokens/s per round and the median
per-round bf16 / f32 ratio.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/dtype_speed.py --batch-size 16 --rounds 3

``--compile-bf16`` runs the bfloat16 engine with ``--compile-target`` (compiled before the
rounds, minutes); float32 stays eager, the engine's exact float32 path.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdraft.build import EngineSpec, build_engine
from specdraft.prompts import mtbench_first_turns
from specdraft.sampling import SamplingParams

DTYPES = ("float32", "bfloat16")


def tokens_per_second(engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """New tokens of the whole batch over the wall time of one ``generate`` call."""
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="batches per dtype (each a new set of prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--compile-bf16", action="store_true", help="bfloat16 through --compile-target")
    args = ap.parse_args()
    engines = {dt: build_engine(EngineSpec(drafter="none", adaptive="off", dtype=dt,
                                           compile_target=args.compile_bf16 and dt == "bfloat16"))
               for dt in DTYPES}
    target = engines["float32"].target
    questions = mtbench_first_turns()[: args.batch_size * args.rounds]
    prompts = [target.encode_prompt(q["prompt"], chat=True) for q in questions]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for engine in engines.values():  # first calls pay one-time costs (kernel choice, allocation)
        engine.generate(prompts[: args.batch_size], SamplingParams(max_new_tokens=8))
    rates: dict[str, list[float]] = {dt: [] for dt in DTYPES}
    for r in range(args.rounds):
        batch = prompts[r * args.batch_size: (r + 1) * args.batch_size]
        for dt in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            rates[dt].append(tokens_per_second(engines[dt], batch, params))
        # One line per round as it ends: a long run shows where it stands and keeps what it measured.
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{dt} {rates[dt][-1]:.1f}" for dt in DTYPES)
              + f" tokens/s, bf16 / f32 {rates['bfloat16'][-1] / rates['float32'][-1]:.3f}", flush=True)
    for dt, values in rates.items():
        print(f"batch {args.batch_size} {dt}: tokens/s per round {[round(v, 1) for v in values]}")
    ratios = [b / f for b, f in zip(rates["bfloat16"], rates["float32"])]
    print(f"batch {args.batch_size} bf16 / f32: per round {[round(x, 3) for x in ratios]}, "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
