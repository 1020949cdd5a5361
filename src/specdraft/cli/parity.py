"""The ``parity`` subcommand (registered in ``cli.SUBCOMMANDS``): the engine's greedy output
against transformers' ``generate()`` at the same dtype, near-ties told from errors.

    specdraft parity --drafter lookup --dataset mt-bench --dtype bfloat16 --batch-size 4 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import SpecdraftError
from .options import add_drafter_args, add_target_args, announce_choices, load_engine

EXIT_MISMATCH = 1  # some prompt diverged beyond a near-tie (2 stays the usage-error code)


def add_parity(subparsers) -> None:
    """The ``parity`` subcommand's options."""
    p = subparsers.add_parser(
        "parity", help="check the engine's greedy output against transformers' generate() at the same dtype",
        description="Decode prompts greedily with the engine and with transformers' generate() (same model, same "
                    "dtype) and compare them token by token. At each first divergence both candidate tokens' "
                    "logits are recomputed in float32 on the shared prefix: a near-tie when they differ by less "
                    "than ε = eps(dtype)·sqrt(layers)·max|logit| (rounding can flip it), else an error. Prints "
                    "one line per prompt and 'parity: I identical, T near-ties, E errors'; exit code 1 if any "
                    "error. Run it on your own model before trusting a drafter.")
    src = p.add_argument_group("prompts").add_mutually_exclusive_group()
    src.add_argument("--dataset", default=None, metavar="mt-bench|humaneval|sharegpt-heldout",
                     help="a named prompt set (default: mt-bench unless --prompts-file)")
    src.add_argument("--prompts-file", metavar="FILE.jsonl", help='one {"prompt": "...", "id": ...} per line')
    p.add_argument("--limit", type=int, metavar="N", help="first N prompts (default: all)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the target's chat template (default: on)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts the engine decodes together; generate() runs one at a time (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="(default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt on stdout (the summary line goes to stderr)")
    add_target_args(p)
    add_drafter_args(p)
    p.set_defaults(run=run_parity_command)


def check_parity_args(args: argparse.Namespace) -> None:
    """Numbers first: they fail fast, before any model loads."""
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise SpecdraftError(f"{flag} must be >= 1, got {value}")
    if args.limit is not None and args.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {args.limit}")


def run_parity_command(args: argparse.Namespace) -> int:
    from ..bench.datasets import encode_first_turns, load_prompts
    from ..drafters.registry import check_shapes
    from ..models import load_target, quiet_loading
    from ..parity import run_parity, summary

    check_parity_args(args)
    check_shapes(args.beam_width, args.beam_length, args.gamma)
    items = load_prompts(args.prompts_file or args.dataset or "mt-bench", args.limit, args.chat)
    engine = load_engine(args)
    prompts = encode_first_turns(engine.target, items, args.chat)
    announce_choices(args)
    model32 = engine.target.model
    if args.dtype != "float32":  # the near-tie test needs the model in float32
        with quiet_loading():
            model32 = load_target(args.target, args.device, "float32", args.trust_remote_code).model

    def show(record) -> None:
        line = json.dumps(record.to_dict()) if args.json else f"{record.id}: {record.outcome}"
        print(line, flush=True)

    records = run_parity(engine, model32, prompts, [it.id for it in items], args.max_new_tokens,
                         args.batch_size, on_record=show)
    print(summary(records), file=sys.stderr if args.json else sys.stdout, flush=True)
    return EXIT_MISMATCH if any(not r.outcome.ok for r in records) else 0
