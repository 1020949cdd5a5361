"""Greedy parity on all 80 MT-Bench first turns: specdraft vs transformers' generate().

For every question: transformers' greedy continuation, then specdraft's with each drafter;
a difference passes only if it starts at a numerical tie (top-2 logits within 1e-4).
Writes one JSON line per (question, drafter) to --out as it goes (resumable with --resume).

    .venv/bin/python scripts/check_parity.py --max-new-tokens 256 --drafters none,lookup --out runs/parity.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdraft import SamplingParams, SpeculativeEngine, load_target
from specdraft.drafters.registry import build_drafter
from specdraft.parity import compare_greedy, hf_greedy
from specdraft.prompts import mtbench_first_turns


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafters", default="none,lookup")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=1, help="rows per engine batch (parity vs batch-1 HF)")
    ap.add_argument("--out", default="runs/parity.jsonl")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    target = load_target(args.target)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.resume and out.exists():
        done = {(r["id"], r["drafter"]) for r in map(json.loads, out.read_text().splitlines()) if r}
    engines = {d: SpeculativeEngine(target, build_drafter(d, target)) for d in args.drafters.split(",")}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    questions = mtbench_first_turns()[: args.limit]
    counts = {"identical": 0, "tie": 0, "diverged": 0}
    with open(out, "a") as f:
        for start in range(0, len(questions), args.batch_size):
            group = questions[start: start + args.batch_size]
            prompts = [target.encode_prompt(q["prompt"], chat=True) for q in group]
            refs = [hf_greedy(target.model, p, args.max_new_tokens) for p in prompts]
            for name, engine in engines.items():
                if all((q["id"], name) in done for q in group):
                    continue
                results = engine.generate(prompts, params)
                for q, p, ref, res in zip(group, prompts, refs, results):
                    outcome = compare_greedy(target.model, p, res.token_ids, ref)
                    counts[outcome.status] += 1
                    rec = {"id": q["id"], "drafter": name, "status": outcome.status, "index": outcome.index,
                           "gap": outcome.gap, "new_tokens": res.new_tokens, "tokens_per_step": res.tokens_per_step}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"q{q['id']} {name}: {outcome}", flush=True)
    print(f"identical {counts['identical']}, tolerated ties {counts['tie']}, diverged {counts['diverged']}")
    return 1 if counts["diverged"] else 0


if __name__ == "__main__":
    sys.exit(main())
