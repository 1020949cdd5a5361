"""Score drafter heads on a `specdraft fit` held-out corpus: per-depth top-1 and the
engine-exact greedy τ of one beam (W = 1) at every length, as fit's curve does, so heads
trained by different runs compare on the same held-out answers.

    .venv/bin/python scripts/score_head.py --heldout runs/fit-own8k/heldout-corpus \
        redrafter:default redrafter:runs/fit-own8k/final

Prints one JSON line per head.
"""

import argparse
import json

import torch

from specdraft.drafters.registry import checkpoint_path
from specdraft.models import load_target
from specdraft.heads import MedusaHeads, ReDrafterHead
from specdraft.train.corpus import Corpus
from specdraft.train.fit import CorpusEvaluator
from specdraft.train.heads import HeadObjective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="redrafter:PATH or medusa:PATH ('default': the shipped one)")
    parser.add_argument("--heldout", required=True, help="a fit's OUT/heldout-corpus")
    parser.add_argument("--target", default="default")
    parser.add_argument("-K", type=int, default=4)
    args = parser.parse_args()
    target = load_target(args.target, dtype="auto")
    held = Corpus(args.heldout)
    for spec in args.heads:
        kind, _, path = spec.partition(":")
        cls = MedusaHeads if kind == "medusa" else ReDrafterHead
        head = cls.load(checkpoint_path(kind, path), target).float()
        found = CorpusEvaluator(held, head.draft_vocab, args.K, target.device)(HeadObjective(head, args.K))
        print(json.dumps({"head": spec, **found}), flush=True)


if __name__ == "__main__":
    main()
