"""Is `fit --compile-target` worth it here: corpus extraction eager against compiled.

Loads the target twice (eager, and compiled as ``Target.compile`` does it), extracts the same
answers with both through ``train.corpus.greedy_and_hidden`` (the code `fit` runs), halves in
alternating order so a drifting VM affects both alike, and reports tokens/s, how often the
greedy labels agree, and the hidden states' relative difference. ``--reference float32``
instead compares eager at ``--dtype`` with eager float32 (what bfloat16 itself moves).

    .venv/bin/python scripts/extract_probe.py --answers runs/fit-big3/heldout.jsonl
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specdraft.data.chat import IGNORE
from specdraft.models import load_target
from specdraft.train.corpus import greedy_and_hidden
from specdraft.train.examples import load_examples


def extract(target, ids, answers, layers):
    """(per-sequence results, seconds) of one extraction pass."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = list(greedy_and_hidden(target, ids, answers, 8192, layers))
    return out, time.perf_counter() - start


def compare(a, b) -> str:
    """Greedy-label agreement (answer slots only) and the hidden states' relative difference."""
    agree = np.mean(np.concatenate([(x[0] == y[0])[x[0] >= 0] for x, y in zip(a, b)]))
    rel = torch.cat([(x[2].float() - y[2].float()).norm(dim=-1) / y[2].float().norm(dim=-1) for x, y in zip(a, b)])
    return f"greedy labels agree {agree:.4f}; hidden relative difference median {rel.median():.4f} max {rel.max():.4f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", required=True, help="a distill file (e.g. a fit's heldout.jsonl)")
    p.add_argument("--target", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reference", choices=("compiled", "float32"), default="compiled")
    p.add_argument("--feature-layers", default="2,14,26")
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    layers = tuple(int(x) for x in args.feature_layers.split(",") if x)
    eager = load_target(args.target, dtype=args.dtype)
    if args.reference == "float32":
        other = load_target(args.target, dtype="float32")
    else:
        other = load_target(args.target, dtype=args.dtype)
        other.compile()
    examples = load_examples(args.answers, eager.tokenizer, seq_len=args.seq_len, K=4, eos_ids=eager.eos_ids)
    ids = [list(examples[i].input_ids) for i in range(len(examples))]
    answers = [[y != IGNORE for y in examples[i].labels] for i in range(len(examples))]
    begin = time.perf_counter()
    extract(other, ids[:8], answers[:8], layers)  # compiles (or warms up) the shapes of the first batch
    print(f"first pass ({args.reference}): {time.perf_counter() - begin:.0f} s", flush=True)
    half = len(ids) // 2
    for part in (slice(0, half), slice(half, None)):
        (a, ta), (b, tb) = extract(eager, ids[part], answers[part], layers), extract(other, ids[part], answers[part], layers)
        n = sum(len(x) for x in ids[part])
        print(f"sequences {part.start}:{part.stop}: eager {n / ta:.0f} tokens/s, {args.reference} {n / tb:.0f}; "
              f"{compare(b, a)}", flush=True)


if __name__ == "__main__":
    main()
