"""The ``export`` subcommand: a ReDrafter checkpoint in TensorRT-LLM's ReDrafter layout."""

from __future__ import annotations

import argparse
import sys


def add_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a ReDrafter head for a serving engine (TensorRT-LLM)",
        description="Write a ReDrafter checkpoint in the layout TensorRT-LLM's ReDrafter support reads "
                    "(lm_head.{i}.linear.*, rnn_u.*, rnn_w.weight; config hidden_size, exit_dim, "
                    "num_draft_layers, rnn, vocab_size). A 'shared' head is folded with the target's LM "
                    "head into an explicit output layer. See docs/redrafter.md.")
    p.add_argument("format", choices=("trtllm",), help="the serving engine's layout")
    p.add_argument("--drafter", required=True, metavar="PATH", help="a ReDrafter checkpoint folder")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write model.safetensors + config.json")
    p.add_argument("--target", default=None, metavar="default|PATH|HUB_ID",
                   help="the target (needed for a 'shared' head; default: the one the checkpoint records)")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from .cli import quiet_loading
    from .models import load_target
    from .redrafter.export import export_trtllm

    with quiet_loading():
        target = load_target(args.target) if args.target else None
    out = export_trtllm(args.drafter, args.out, target)
    print(f"wrote {out}/model.safetensors and {out}/config.json", file=sys.stderr)
    return 0
