"""The ``specdraft train ...`` subcommands.

``add_train`` takes the top-level subparsers, like the entries of ``cli.SUBCOMMANDS``.
``train`` is a group: its drafters are the entries of ``TRAIN_SUBCOMMANDS`` (``redrafter``,
``draft``; other trainers add theirs the same way).
Heavy imports (torch models, accelerate) happen only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Callable

from .options import add_target_args


def add_loop_args(p, epochs: int, lr: float | None, lr_help: str, trained: str, seed_help: str, outputs: str):
    """The training loop's options (shared by every trainer); returns the optimisation group."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=epochs, help="(default: %(default)s)")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps (the LR schedule "
                   "spans min(N, epochs))")
    g.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences per process per micro-batch "
                   "(default: %(default)s)")
    g.add_argument("--grad-accum", type=int, default=1, metavar="G", help="micro-batches per optimizer step "
                   "(default: %(default)s)")
    g.add_argument("--lr", type=float, default=lr, help=f"peak AdamW learning rate {lr_help}")
    g.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of the cosine schedule "
                   "(default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping (default: %(default)s)")
    g.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no",
                   help=f"autocast for {trained} (the target's dtype is --dtype) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help=f"{seed_help} (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="DIR", help=f"{outputs} go here")
    out.add_argument("--save-every", type=int, default=500, metavar="N", help="checkpoint every N steps "
                     "(default: %(default)s)")
    out.add_argument("--keep-checkpoints", type=int, default=2, metavar="N", help="(default: %(default)s)")
    out.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    out.add_argument("--stop-after-steps", type=int, metavar="N",
                     help="save a checkpoint and stop after step N, as if interrupted (for time-limited jobs)")
    return g


# ---- train redrafter --------------------------------------------------------------------


def add_schedule_args(g, every: int) -> None:
    """--eval-every and --eval-examples: when the held-out set is scored, and how much of it."""
    g.add_argument("--eval-every", type=int, default=every, metavar="N", help="score the held-out set every N "
                   "steps (at a logged step), before the first and after the last; 0: first and last only "
                   "(default: %(default)s)")
    g.add_argument("--eval-examples", type=int, default=64, metavar="N", help="held-out sequences scored "
                   "(default: %(default)s)")


def add_train_redrafter(subparsers) -> None:
    p = subparsers.add_parser(
        "redrafter", help="train a ReDrafter head (or Medusa heads) on a frozen target",
        description="Train a recurrent drafter head (--arch redrafter) or Medusa heads (--arch medusa) on the "
                    "target's last hidden states. Runs on one CPU or GPU as is; on many GPUs or nodes through "
                    "`accelerate launch -m specdraft train redrafter ...`. See docs/training.md.")
    add_target_args(p)
    p.set_defaults(device="auto")  # the accelerator decides (cuda:<rank> under a launcher); cpu forces CPU
    g = p.add_argument_group("data")
    g.add_argument("--data", default="sharegpt", metavar="sharegpt|FILE.json|FILE.jsonl",
                   help="ShareGPT conversations (the packaged set or a file in its format; train split, loss on "
                        "assistant tokens) or a `specdraft distill` JSONL file (default: %(default)s)")
    g.add_argument("--limit", type=int, metavar="N", help="use the first N conversations / records")
    g.add_argument("--seq-len", type=int, default=2048, metavar="T", help="truncate sequences to T tokens "
                   "(default: %(default)s)")
    g.add_argument("--heldout-fraction", type=float, default=None, metavar="F",
                   help="ShareGPT groups held out from training (default: 0.02)")
    g.add_argument("--hidden-cache", metavar="DIR", help="keep the target's hidden states in DIR (safetensors "
                   "shards) so later epochs and reruns do not run the target again")
    g = p.add_argument_group("head")
    g.add_argument("--arch", choices=("redrafter", "medusa"), default="redrafter", help="(default: %(default)s)")
    g.add_argument("--head", choices=("own", "shared"), default="own",
                   help="own output layer, or the target's frozen LM head (default: %(default)s)")
    g.add_argument("--num-blocks", type=int, metavar="N", help="residual blocks (default: 2 redrafter, 1 medusa)")
    g.add_argument("--future-tokens", "-K", type=int, default=5, metavar="K",
                   help="tokens predicted per position (Medusa: number of heads) (default: %(default)s)")
    g = add_loop_args(p, epochs=2, lr=1e-3, lr_help="(default: %(default)s)", trained="the head",
                      seed_help="head init and data order", outputs="checkpoints/, log.jsonl and final/")
    g.add_argument("--kl-weight", type=float, default=0.0, metavar="W",
                   help="add W x KL(target || head) at each labelled position (default: %(default)s)")
    g.add_argument("--log-every", type=int, default=10, metavar="N", help="(default: %(default)s)")
    g.add_argument("--topk", type=int, default=5, metavar="k", help="log top-k accuracy (default: %(default)s)")
    g.add_argument("--eval-data", metavar="FILE.jsonl|sharegpt|FILE.json",
                   help="held-out sequences scored before training, every --eval-every steps and at the end "
                        "(per-depth accuracy, greedy τ by replaying the engine; eval.jsonl): a distill file the "
                        "training never saw, or ShareGPT's held-out split")
    add_schedule_args(g, every=0)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_train_redrafter)


def run_train_redrafter(args: argparse.Namespace) -> int:
    from ..train.configs import HeadTrainConfig
    from ..train.heads import run

    return run(HeadTrainConfig.from_options(args))


# ---- train draft ------------------------------------------------------------------------


def add_train_draft(subparsers) -> None:
    p = subparsers.add_parser(
        "draft", help="train an independent draft model (a small Llama with the target's vocabulary)",
        description="Direct alignment of a draft model: --stage pretrain (next-token loss on plain text or "
                    "ShareGPT), then --stage finetune (distillation from the frozen target on `specdraft distill` "
                    "responses, --loss fkl|rkl|tvd|tvdpp). Saves a Hugging Face folder usable as --drafter "
                    "draft:OUT/final. Runs on one CPU or GPU as is; on many GPUs or nodes through `accelerate "
                    "launch -m specdraft train draft ...`. See docs/draft_model.md.")
    add_target_args(p)
    p.set_defaults(device="auto")
    p.add_argument("--stage", choices=("pretrain", "finetune"), required=True,
                   help="pretrain: language modelling on text; finetune: distillation from the target")
    add_draft_data_args(p)
    add_draft_model_args(p)
    add_draft_loss_args(p)
    g = p.add_argument_group("evaluation")
    add_schedule_args(g, every=200)
    g.add_argument("--gamma", type=int, default=4, metavar="G", help="draft length for the estimated block "
                   "efficiency and memory-bound speed-up (default: %(default)s)")
    add_loop_args(p, epochs=1, lr=None, lr_help="(default: 1e-3 pretrain, 3e-4 finetune)", trained="the draft",
                  seed_help="initialisation, data order, sampled losses",
                  outputs="checkpoints/, log.jsonl, eval.jsonl and final/")
    # g is still the evaluation group (add_loop_args made its own): --help lists these two there.
    g.add_argument("--log-every", type=int, default=10, metavar="N", help="(default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_train_draft)


def add_draft_data_args(p) -> None:
    """``train draft``'s data group: each stage's sources, their sizes, the held-out split."""
    g = p.add_argument_group("data")
    g.add_argument("--text", nargs="+", action="extend", metavar="PATH", help="pretrain: text files, folders or "
                   "globs (HTML reduced to text, .gz decompressed)")
    g.add_argument("--data", metavar="sharegpt|FILE.json|FILE.jsonl",
                   help="finetune: a `specdraft distill` responses FILE.jsonl, or ShareGPT (default: sharegpt); "
                        "pretrain: ShareGPT conversations as text")
    g.add_argument("--dataset", metavar="NAME[:CONFIG]", help="pretrain: a Hugging Face dataset (needs the "
                   "optional `datasets` package)")
    g.add_argument("--dataset-split", default="train", metavar="SPLIT", help="(default: %(default)s)")
    g.add_argument("--dataset-field", default="text", metavar="FIELD", help="(default: %(default)s)")
    g.add_argument("--limit", type=int, metavar="N", help="the first N files / conversations / records / rows")
    g.add_argument("--max-tokens", type=int, metavar="N", help="pretrain: use the first N tokens of the corpus")
    g.add_argument("--seq-len", type=int, default=1024, metavar="T", help="pretrain: packed sequence length; "
                   "finetune: truncation (default: %(default)s)")
    g.add_argument("--heldout-fraction", type=float, default=None, metavar="F",
                   help="held out for evaluation: packed sequences, distill prompts, ShareGPT groups "
                        "(default: 0.02)")
    g.add_argument("--eval-data", metavar="FILE.jsonl|sharegpt|FILE.json",
                   help="evaluate on these instead (distill responses, or ShareGPT's held-out split)")
    g.add_argument("--hidden-cache", metavar="DIR", help="finetune: keep the target's hidden states in DIR so "
                   "later epochs and reruns do not run the target again (same format as train redrafter)")


def add_draft_model_args(p) -> None:
    """``train draft``'s draft model group: a folder to continue, or a new draft's shape and
    initialisation; its embeddings, vocabulary and saved dtype."""
    g = p.add_argument_group("draft model")
    g.add_argument("--draft", metavar="PATH", help="continue this draft folder (e.g. the pretrain stage's "
                   "OUT/final); otherwise a new draft is built")
    g.add_argument("--layers", type=int, metavar="N", help="decoder layers (default: 4, fewer if needed)")
    g.add_argument("--hidden", type=int, metavar="D", help="hidden size (default: the widest within "
                   "--max-fraction of the target, at most 1024)")
    g.add_argument("--heads", type=int, metavar="H", help="attention heads (default: hidden / the target's head dim)")
    g.add_argument("--kv-heads", type=int, metavar="H", help="key/value heads (default: the target's ratio)")
    g.add_argument("--intermediate", type=int, metavar="N", help="MLP size (default: the target's ratio)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="one matrix for input embeddings and output layer (default: as the target)")
    g.add_argument("--max-fraction", type=float, default=0.1, metavar="F",
                   help="the default size's budget: at most F x the target's parameters (default: %(default)s)")
    g.add_argument("--init-from-target", action="store_true", help="start from the target's embeddings (projected "
                   "onto their top principal directions when the draft is narrower)")
    g.add_argument("--copy-layers", metavar="I,J,...", help="start from these target layers (implies the target's "
                   "hidden and layer shape, and --init-from-target)")
    g.add_argument("--embeddings", choices=("own", "target"), default="own",
                   help="target: borrow the target's embedding matrices (frozen, not saved: the folder holds "
                        "only the draft's own layers and loads beside the target; needs --copy-layers or "
                        "--init-from-target at the target's hidden size) (default: %(default)s)")
    g.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="draft over the N tokens most frequent among the training answers (saved with the "
                        "draft; 0 = the whole vocabulary) (default: %(default)s)")
    g.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the final folder's weights (training and checkpoints stay float32; bfloat16 "
                        "halves the file, e.g. to ship it) (default: %(default)s)")


def add_draft_loss_args(p) -> None:
    """``train draft``'s loss group (the finetune stage's distillation loss)."""
    g = p.add_argument_group("loss (finetune)")
    g.add_argument("--loss", choices=("fkl", "rkl", "tvd", "tvdpp"), default="tvdpp", help="(default: %(default)s)")
    g.add_argument("--tvdpp-variant", choices=("exact", "sampled", "uniform"), default="exact",
                   help="how TVD++ normalises its reward (docs/draft_model.md) (default: %(default)s)")
    g.add_argument("--tvdpp-samples", type=int, default=4, metavar="K", help="sampled variant: tokens drawn "
                   "from the draft per position (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=1.0, metavar="T", help="both models' softmax "
                   "temperature in the loss (default: %(default)s)")
    g.add_argument("--on-policy", action="store_true", help="train on the data's prompts continued by the draft "
                   "itself (sampled each step), scored by the target, instead of the target's responses")
    g.add_argument("--on-policy-tokens", type=int, default=128, metavar="N", help="tokens the draft generates "
                   "per prompt with --on-policy (default: %(default)s)")
    g.add_argument("--loss-chunk", type=int, default=1024, metavar="N", help="positions whose full-vocabulary "
                   "distributions are in memory at once (default: %(default)s)")


def run_train_draft(args: argparse.Namespace) -> int:
    from ..train.configs import DraftTrainConfig
    from ..train.draft import run

    return run(DraftTrainConfig.from_options(args))


# name -> function adding ``specdraft train NAME``'s parser to the train subparsers.
TRAIN_SUBCOMMANDS: dict[str, Callable] = {
    "redrafter": add_train_redrafter,
    "draft": add_train_draft,
}


def add_train(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a drafter", description="Train a drafter for a target.")
    sub = p.add_subparsers(dest="drafter_kind", required=True, metavar="DRAFTER")
    for add in TRAIN_SUBCOMMANDS.values():
        add(sub)
