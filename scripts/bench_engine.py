"""Autoregressive vs prompt lookup through the engine, and transformers' generate(), on
MT-Bench first turns with the default target. Prints a Markdown table.

Each prompt runs every method back to back (same process, same warm state), R times;
per-prompt medians over repeats, then totals over prompts: tokens/s = total new tokens /
total seconds; speed-up = that rate over the engine's own autoregressive rate.

    .venv/bin/python scripts/bench_engine.py --limit 80 --max-new-tokens 256 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft import SamplingParams, SpeculativeEngine, load_target
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.prompts import mtbench_first_turns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--lookup", default="1x8,2x6,4x6", help="beam width x length shapes for lookup")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    target = load_target("default")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    methods = {"engine none (AR)": SpeculativeEngine(target, NoDrafter())}
    for shape in args.lookup.split(","):
        w, l = (int(x) for x in shape.split("x"))
        methods[f"engine lookup W={w} L={l}"] = SpeculativeEngine(target, LookupDrafter(w, l))
    totals = {name: [0, 0.0, 0] for name in methods}  # tokens, seconds, steps
    totals["transformers generate()"] = [0, 0.0, 0]
    prompts = [target.encode_prompt(q["prompt"], chat=True) for q in mtbench_first_turns()[: args.limit]]
    for k, ids in enumerate(prompts):
        for name, engine in methods.items():
            runs = [engine.generate([ids], params)[0] for _ in range(args.repeats)]
            totals[name][0] += runs[0].new_tokens
            totals[name][1] += statistics.median(r.seconds for r in runs)
            totals[name][2] += runs[0].steps
        secs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_new_tokens,
                                        pad_token_id=target.config.eos_token_id)
            secs.append(time.perf_counter() - t)
        n = out.shape[1] - len(ids)
        totals["transformers generate()"][0] += n
        totals["transformers generate()"][1] += statistics.median(secs)
        totals["transformers generate()"][2] += n
        print(f"prompt {k + 1}/{len(prompts)} done", flush=True)
    base = totals["engine none (AR)"][0] / totals["engine none (AR)"][1]
    print(f"\n{len(prompts)} MT-Bench prompts, {args.max_new_tokens} new tokens, greedy, "
          f"{args.repeats} repeat(s), {torch.get_num_threads()} threads\n")
    print("| method | tokens/s | τ (tokens/target forward) | speed-up vs engine AR |")
    print("|---|---|---|---|")
    for name, (tok, sec, steps) in totals.items():
        rate = tok / sec
        print(f"| {name} | {rate:.1f} | {tok / steps:.2f} | {rate / base:.2f}× |")


if __name__ == "__main__":
    main()
