"""Time `specdraft fit`'s head training steps on real corpus batches, without the fit around them.

Builds the objective exactly as `fit` does (``train.fit.build_objective``: the head, its
draft vocabulary from OUT/vocab.json, bfloat16 autocast through accelerate, AdamW), draws
random batches of BLOCK-position examples from OUT/corpus, and times the batch gathering and
the forward + backward + optimizer step separately. Prints the median over the steps after
the first three (the first calls build the matrix kernels, and compile the loss).

A/B of a code change: run it from two checkouts in alternating rounds (this VM drifts by
20-30% between minutes), e.g. with the old one in a git worktree:

    .venv/bin/python scripts/time_head_steps.py --out runs/fit-big3 --steps 24
    PYTHONPATH=/tmp/old/src .venv/bin/python /tmp/old/scripts/time_head_steps.py --out runs/fit-big3 --steps 24
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from accelerate import Accelerator

    from specdraft.models import load_target
    from specdraft.train.corpus import Corpus
    from specdraft.train.fit import BLOCK, CorpusTask, build_objective, draft_vocabulary
    from specdraft.train.fit_config import FitConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a fit's folder: its corpus, heldout-corpus and vocab.json")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch-positions", type=int, default=1024)
    p.add_argument("--head", default="shared")
    p.add_argument("--feature-layers", default="2,14,26")
    p.add_argument("-K", type=int, default=4)
    p.add_argument("--no-compile-loss", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    config = FitConfig(out=out, head=args.head, K=args.K, compile_loss=not args.no_compile_loss,
                       feature_layers=[int(x) for x in args.feature_layers.split(",") if x])
    target = load_target("default", "cpu", "bfloat16")
    corpus, held = Corpus(out / "corpus"), Corpus(out / "heldout-corpus")
    vocab = draft_vocabulary(config, corpus, held, int(target.vocab_size))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = build_objective(config, target, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    task = CorpusTask(corpus, vocab, args.K, target.device)
    rng = np.random.default_rng(0)
    gather, step = [], []
    for _ in range(args.steps):
        blocks = rng.choice(len(corpus) // BLOCK, args.batch_positions // BLOCK, replace=False).tolist()
        started = time.perf_counter()
        mb = task.micro_batch(blocks)
        gathered = time.perf_counter()
        loss, _ = task.loss(model, mb, task.counts(mb).clamp(min=1))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        gather.append(gathered - started)
        step.append(time.perf_counter() - gathered)
    g, s = statistics.median(gather[3:]), statistics.median(step[3:])
    print(f"median over {len(step) - 3} steps: gather {1e3 * g:.0f} ms, forward+backward+step {1e3 * s:.0f} ms "
          f"-> {args.batch_positions / (g + s):.0f} positions/s")


if __name__ == "__main__":
    main()
