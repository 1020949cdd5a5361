"""The ``export`` subcommand: a ReDrafter checkpoint in TensorRT-LLM's ReDrafter layout, or a
draft model as a standalone Hugging Face folder."""

from __future__ import annotations

import argparse
import sys


def add_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export a drafter for a serving engine (TensorRT-LLM) or as a standalone HF model",
        description="trtllm: write a ReDrafter checkpoint in the layout TensorRT-LLM's ReDrafter support reads "
                    "(lm_head.{i}.linear.*, rnn_u.*, rnn_w.weight; config hidden_size, exit_dim, "
                    "num_draft_layers, rnn, vocab_size). A 'shared' head is folded with the target's LM "
                    "head into an explicit output layer. See docs/redrafter.md. hf: write a draft model "
                    "that borrows the target's embeddings as a standalone Hugging Face folder (the "
                    "embeddings written back, full vocabulary, float32): an assistant_model for any "
                    "transformers or vLLM setup. See docs/draft_model.md.")
    p.add_argument("format", choices=("trtllm", "hf"), help="the layout")
    p.add_argument("--drafter", required=True, metavar="PATH",
                   help="trtllm: a ReDrafter checkpoint folder; hf: a draft model folder (or draft:default)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write model.safetensors + config.json")
    p.add_argument("--target", default=None, metavar="default|PATH|HUB_ID",
                   help="the target (trtllm: needed for a 'shared' head, default: the one the checkpoint "
                        "records; hf: the draft's target, default: the embedded default)")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from ..models import load_target, quiet_loading
    from ..heads.export import export_trtllm

    if args.format == "hf":
        from ..drafters.registry import checkpoint_path
        from ..train.draft import standalone_draft

        with quiet_loading():
            target = load_target(args.target or "default", dtype="float32")
        out = standalone_draft(checkpoint_path("draft", args.drafter.removeprefix("draft:")), args.out, target)
        print(f"wrote a standalone draft model to {out}", file=sys.stderr)
        return 0
    with quiet_loading():
        target = load_target(args.target) if args.target else None
    out = export_trtllm(args.drafter, args.out, target)
    print(f"wrote {out}/model.safetensors and {out}/config.json", file=sys.stderr)
    return 0
