"""Score draft models on the target's own answers (a `specdraft distill` file): the held-out
figures `train draft` and `fit --drafter draft` log (α at T = 1, greedy agreement, CE, and
the engine-exact greedy τ of the walk at γ = 1..G), so drafts trained by different runs
compare on the same answers (e.g. MT-Bench's or HumanEval's, not only ShareGPT's held-out).

    .venv/bin/python scripts/score_draft.py --data runs/mtbench-answers.jsonl --gamma 5 \
        draft:default draft:runs/losses/tvd/final

Prints one JSON line per draft.
"""

import argparse
import json
from types import SimpleNamespace

from specdraft.drafters.draft_model import load_draft_folder
from specdraft.drafters.registry import checkpoint_path
from specdraft.models import load_target, parameter_count
from specdraft.train.common import make_accelerator
from specdraft.train.draft.data import eval_examples_from
from specdraft.train.draft.evaluate import Evaluator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft:PATH ('draft:default': the shipped one)")
    parser.add_argument("--data", required=True, help="a distill file of the target's answers")
    parser.add_argument("--limit", type=int, default=10**9, help="first N answers (default: all)")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--target", default="default")
    args = parser.parse_args()
    target = load_target(args.target, dtype="auto")
    options = SimpleNamespace(eval_examples=args.limit, seq_len=1024, heldout_fraction=None)
    examples = eval_examples_from(args.data, options, target)
    accelerator = make_accelerator(cpu=True)
    for spec in args.drafts:
        kind, _, path = spec.partition(":")
        draft, _, _, vocab = load_draft_folder(checkpoint_path(kind, path), target, target.dtype)
        evaluator = Evaluator(examples, target, batch_size=8, chunk=1024, gamma=args.gamma,
                              target_parameters=parameter_count(target.model), vocab=vocab)
        print(json.dumps({"draft": spec, "answers": len(examples), **evaluator(accelerator, draft)}), flush=True)


if __name__ == "__main__":
    main()
