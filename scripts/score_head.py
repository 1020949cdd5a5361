"""Score drafter heads on a `specdraft fit` held-out corpus: per-depth top-1 and the
engine-exact greedy τ of one beam (W = 1) at every length, as fit's curve does, so heads
trained by different runs compare on the same held-out answers.

    .venv/bin/python scripts/score_head.py --heldout runs/fit-own8k/heldout-corpus \
        redrafter:default redrafter:runs/fit-own8k/final

A head that reads feature layers (``--feature-layers``) needs them in the corpus: with
``--heldout-data FILE.jsonl --corpus-dir DIR`` each head is scored on a held-out corpus
extracted from that file with its own feature layers (kept in DIR for the next call).

With ``--sampled T`` it also scores chains drawn from each head at temperature T
(``fit_eval.sampled_acceptance``: per-depth sum_x min(p, q) and a one-chain τ estimate);
score them on the target's answers sampled at T (``specdraft distill --temperatures T``);
``--chains C`` adds the acceptance of one of 2..C draws without replacement at each depth.

Prints one JSON line per head.
"""

import argparse
import json

import torch

from specdraft.drafters.registry import checkpoint_path
from specdraft.models import load_target
from specdraft.heads import MedusaHeads, ReDrafterHead
from specdraft.train.corpus import Corpus
from specdraft.train.fit_eval import CorpusEvaluator, sampled_acceptance
from specdraft.train.heads import HeadObjective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+", help="redrafter:PATH or medusa:PATH ('default': the shipped one)")
    parser.add_argument("--heldout", help="a fit's OUT/heldout-corpus")
    parser.add_argument("--heldout-data", help="or: a distill file of the target's answers, extracted per head")
    parser.add_argument("--corpus-dir", default="runs/score-corpora", help="where --heldout-data's corpora go")
    parser.add_argument("--target", default="default")
    parser.add_argument("-K", type=int, default=4)
    parser.add_argument("--sampled", type=float, metavar="T", help="also score chains drawn at temperature T")
    parser.add_argument("--chains", type=int, default=1, metavar="C",
                        help="with --sampled: also the acceptance of one of 2..C independent draws per depth")
    args = parser.parse_args()
    target = load_target(args.target, dtype="auto")
    for spec in args.heads:
        kind, _, path = spec.partition(":")
        cls = MedusaHeads if kind == "medusa" else ReDrafterHead
        head = cls.load(checkpoint_path(kind, path), target).float()
        layers = list(getattr(head.config, "feature_layers", []))
        held = Corpus(args.heldout) if args.heldout else heldout_corpus(target, args, layers)
        evaluator = CorpusEvaluator(held, head.draft_vocab, args.K, target.device,
                                    window=getattr(head.config, "context", 0))
        objective = HeadObjective(head, args.K)
        found = evaluator(objective)
        if args.sampled:
            found.update(sampled_acceptance(held, objective, target, head.draft_vocab, args.K, args.sampled,
                                            window=getattr(head.config, "context", 0), chains=args.chains))
        print(json.dumps({"head": spec, **found}), flush=True)


def heldout_corpus(target, args, layers: list[int]) -> Corpus:
    """``--heldout-data`` extracted with the feature layers ``layers`` (once per set of layers)."""
    from pathlib import Path

    from specdraft.train.corpus import corpus_manifest, extract
    from specdraft.train.examples import load_examples

    examples = load_examples(args.heldout_data, target.tokenizer, seq_len=1024, K=args.K, eos_ids=target.eos_ids)
    name = Path(args.heldout_data).stem + "-layers-" + ("-".join(map(str, layers)) or "none")
    folder = Path(args.corpus_dir) / name
    extract(target, examples, folder, corpus_manifest(target, examples, 1024, layers), chunk=16, progress=False)
    return Corpus(folder)


if __name__ == "__main__":
    main()
