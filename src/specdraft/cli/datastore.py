"""The ``datastore`` subcommand: a retrieval drafter's datastore from the target's answers
(``specdraft distill`` files) or ShareGPT's assistant turns."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecdraftError
from .options import add_target_args


def add_datastore(subparsers) -> None:
    p = subparsers.add_parser(
        "datastore", help="build a datastore for retrieval drafting (retrieval:DIR) from the target's answers",
        description="Index the answers in `specdraft distill` response files (the target's own text: what "
                    "retrieval drafts best from) and/or ShareGPT's assistant turns by their n-grams, for "
                    "`--drafter retrieval:DIR` (best beside prompt lookup: lookup+retrieval:DIR). "
                    "See docs/retrieval.md.")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE.jsonl|sharegpt",
                   help="distill response files, and/or 'sharegpt' for its training split's assistant turns")
    p.add_argument("--out", required=True, metavar="DIR", help="where datastore.safetensors and config.json go")
    p.add_argument("--sharegpt-limit", type=int, default=None, metavar="N",
                   help="with --data sharegpt: its first N conversations (default: all)")
    p.add_argument("--max-ngram", type=int, default=3, metavar="N", help="longest n-gram searched (default: %(default)s)")
    p.add_argument("--min-ngram", type=int, default=1, metavar="N", help="shortest n-gram searched (default: %(default)s)")
    add_target_args(p)
    p.set_defaults(run=run_datastore)


def run_datastore(args: argparse.Namespace) -> int:
    from ..datastore import Datastore, answers_in_file, answers_in_sharegpt
    from ..models import load_target, quiet_loading

    if args.sharegpt_limit is not None and args.sharegpt_limit < 1:
        raise SpecdraftError(f"--sharegpt-limit must be >= 1, got {args.sharegpt_limit}")
    for source in args.data:
        if source != "sharegpt" and not Path(source).is_file():
            raise SpecdraftError(f"--data: no such file: {source}")
    with quiet_loading():
        target = load_target(args.target, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    answers: list[list[int]] = []
    for source in args.data:
        if source == "sharegpt":
            answers.extend(answers_in_sharegpt(target.tokenizer, args.sharegpt_limit))
        else:
            answers.extend(answers_in_file(source, target.tokenizer, target.name))
    if not answers:
        raise SpecdraftError(f"no answers in {', '.join(args.data)} (distill response records or ShareGPT)")
    store = Datastore.from_answers(answers, target.vocab_size, max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    store.save(args.out, {"target": target.name, "sources": list(args.data)})
    tokens = store.tokens.numel() - len(answers)
    print(f"wrote a datastore of {len(answers)} answers, {tokens} tokens to {args.out}", file=sys.stderr)
    return 0
