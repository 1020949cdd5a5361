"""The ``specdraft fit`` subcommand: argparse -> ``train.fit_config.FitConfig`` -> ``run_fit``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..errors import SpecdraftError
from .options import add_target_args, resolve_dtype_arg

DRAFTERS = ("redrafter", "medusa", "draft")
DEFAULT_LR = {"redrafter": 1e-3, "medusa": 1e-3, "draft": 3e-4}  # draft: train draft's fine-tuning rate


def parse_duration(text: str) -> float:
    """"90m", "2h", "1h30m", "45s" or plain seconds -> seconds."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text or "")
    if not text or not text.strip() or parts is None or not any(parts.groups()):
        raise SpecdraftError(f"--budget must be a duration such as 90m, 2h or 1h30m, got {text!r}")
    h, m, s = (float(x) if x else 0.0 for x in parts.groups())
    seconds = 3600 * h + 60 * m + s
    if not 0 < seconds < 1e9:
        raise SpecdraftError(f"--budget must be positive, got {text!r}")
    return seconds


def parse_count(text: str) -> int:
    """"20M", "500k", "1e6" or a plain integer -> int."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMgG]?)\s*", text or "")
    if match is None:
        raise SpecdraftError(f"--tokens must be a count such as 500k, 20M or 1e6, got {text!r}")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    if not 1 <= value < 1e15:
        raise SpecdraftError(f"--tokens must be a count from 1 to 1e15, got {text!r}")
    return int(value)


def parse_layers(text: str | None) -> list[int]:
    """"3,15,27" -> [3, 15, 27]; None -> []."""
    if not text:
        return []
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        raise SpecdraftError(f"--feature-layers must be comma-separated layer indices, got {text!r}") from None
    if any(x < 0 for x in layers) or len(set(layers)) != len(layers):
        raise SpecdraftError(f"--feature-layers must be distinct indices >= 0, got {text!r}")
    return layers


def add_draft_model_options(p) -> None:
    """``fit --drafter draft``'s own options."""
    g = p.add_argument_group("draft model (--drafter draft)")
    g.add_argument("--loss", choices=("fkl", "rkl", "tvd", "tvdpp"), default="tvdpp",
                   help="distillation loss (docs/draft_model.md) (default: %(default)s)")
    g.add_argument("--copy-layers", metavar="I,J,...",
                   help="start from these target layers at full width, the target's embeddings borrowed "
                        "(default: the target's embeddings on the default small shape)")
    g.add_argument("--gamma", type=int, default=3, help="held-out τ at γ = 1..GAMMA (default: %(default)s)")
    g.add_argument("--batch-sequences", type=int, default=8, metavar="N",
                   help="sequences per optimizer step (default: %(default)s)")
    g.add_argument("--on-policy", action="store_true",
                   help="train on the conversations' first prompts continued by the draft itself (sampled each "
                        "step), scored by one target pass, instead of the conversations (DistillSpec)")
    g.add_argument("--on-policy-tokens", type=int, default=128, metavar="N",
                   help="tokens the draft writes per prompt with --on-policy (default: %(default)s)")


def add_fit(subparsers) -> None:
    p = subparsers.add_parser(
        "fit", help="train a ready drafter for a target in one resumable command",
        description="Run the whole pipeline for a drafter: the target's answers to held-out prompts, one "
                    "target pass over the training conversations (hidden states and the target's own "
                    "greedy choices, on disk), a draft vocabulary, training with held-out τ, and the "
                    "final drafter in OUT/final (a draft model, --drafter draft, distils on the "
                    "conversations directly, caching the target's hidden states as it goes). Interrupted "
                    "(Ctrl-C, SIGTERM, --budget) it saves; run the same command again to continue where "
                    "it stopped.")
    p.add_argument("--drafter", choices=DRAFTERS, default="redrafter", help="(default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="everything the run writes, and where it resumes")
    p.add_argument("--data", default="sharegpt", metavar="sharegpt|FILE.json|FILE.jsonl",
                   help="training conversations (default: the packaged ShareGPT, every turn)")
    p.add_argument("--budget", type=str, metavar="DURATION", help="wall-clock limit of this run, e.g. 2h or 90m")
    p.add_argument("--tokens", type=str, metavar="N", help="extract training conversations until the corpus holds N tokens (e.g. 20M), in whole "
                        "chunks of 128 conversations, so it may pass N by up to one chunk (~100k tokens)")
    p.add_argument("--data-offset", type=int, default=0, metavar="N",
                   help="skip the first N training conversations, e.g. those a head given to --init-from "
                        "was trained on (default: %(default)s)")
    p.add_argument("--extract-share", type=float, default=0.5, metavar="F",
                   help="with --budget: at most this share of it extracting (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, metavar="T", help="(default: %(default)s)")
    p.add_argument("--heldout-prompts", type=int, default=64, metavar="N",
                   help="held-out ShareGPT prompts the target answers, for τ (default: %(default)s)")
    add_own_answer_options(p)
    p.add_argument("--heldout-data", metavar="FILE.jsonl",
                   help="score on this distill file of the target's answers instead")
    add_head_options(p)
    add_draft_model_options(p)
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=2, help="(default: %(default)s)")
    g.add_argument("--max-steps", type=int, metavar="N", help="at most N optimizer steps (the LR schedule spans "
                   "min(N, epochs))")
    g.add_argument("--batch-positions", type=int, default=1024, metavar="N", help="(default: %(default)s)")
    g.add_argument("--lr", type=float, help="(default: 1e-3 for heads, 3e-4 for a draft model)")
    g.add_argument("--warmup", type=float, default=0.05, help="(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    g.add_argument("--eval-every", type=int, default=200, metavar="STEPS", help="(default: %(default)s)")
    g.add_argument("--save-every", type=float, default=300.0, metavar="SECONDS", help="(default: %(default)s)")
    p.add_argument("--compile-target", action="store_true",
                   help="extract the training corpus through torch.compile of the target's decoder stack (a few "
                        "minutes of compiling; on a 2-core Xeon 1.35x the tokens/s in bfloat16, and the greedy labels "
                        "agree with eager's at 99%% of positions: compiled kernels round differently); the held-out "
                        "corpus stays eager")
    p.add_argument("--no-compile-loss", action="store_true",
                   help="compute a head's cross-entropy eagerly instead of through torch.compile (the same math; "
                        "compiled it is ~2x faster on a CPU, after ~10 s of compiling)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--stop-after-steps", type=int, metavar="N", help=argparse.SUPPRESS)  # tests: a crash
    add_target_args(p)
    p.set_defaults(run=run)


def add_head_options(p) -> None:
    """The head's shape and labels (ReDrafter and Medusa heads)."""
    g = p.add_argument_group("head")
    g.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                   help="output over the N tokens the target writes most (0: whole vocabulary) (default: %(default)s)")
    g.add_argument("--head", choices=("own", "shared"), default="own", help="(default: %(default)s)")
    g.add_argument("--future-tokens", "-K", type=int, default=4, metavar="K", help="(default: %(default)s)")
    g.add_argument("--labels", choices=("target", "agreeing", "text"), default="target",
                   help="train on the target's own greedy choices (distillation, the paper's recipe), on those "
                        "only where the text took the target's choice at every shallower depth (agreeing: "
                        "the inputs the engine feeds), or on the conversations' own next tokens (the paper's "
                        "no-distillation ablation) (default: %(default)s)")
    g.add_argument("--num-blocks", type=int, metavar="N",
                   help="residual blocks (default: 2 for redrafter, as the paper; 1 per Medusa head)")
    g.add_argument("--context", type=int, default=0, metavar="C",
                   help="redrafter, beyond the paper: context attention over the last C target states of the "
                        "answer, EAGLE-like (0: the paper's head) (default: %(default)s)")
    g.add_argument("--feature-layers", metavar="I,J,...",
                   help="redrafter, beyond the paper: fuse the target's states after these layers (0-based) with "
                        "its last one, as EAGLE-3 (default: none, the paper's head)")
    g.add_argument("--hidden-in-recurrence", action="store_true",
                   help="redrafter, beyond the paper: its recurrence reads h at every step, not only its "
                        "output layer (s_t = SiLU(W·E[x_t] + U·s_{t-1} + V·h + b))")
    g.add_argument("--kl-weight", type=float, default=0.0, metavar="λ",
                   help="beyond the paper: add λ·KL(p‖q), p the target's whole next-token distribution (over the "
                        "draft vocabulary), to the cross-entropy on its greedy choice (default: %(default)s)")
    g.add_argument("--init-from", metavar="PATH", help="start from this checkpoint's weights ('default': the drafter of "
                   "this kind shipped for the default target); a head's draft vocabulary rows are taken from a "
                   "full-vocabulary head; with more --num-blocks, the extra blocks start as the identity")


def add_own_answer_options(p) -> None:
    p.add_argument("--own-answers", type=int, default=0, metavar="N",
                   help="heads: the target also answers the first N training prompts (OUT/answers.jsonl), and "
                        "the head trains on those answers beside the data: the text it drafts at inference "
                        "(default: %(default)s)")
    p.add_argument("--own-offset", type=int, default=0, metavar="N",
                   help="with --own-answers: answer the training prompts from the Nth on, so that a later "
                        "round (e.g. with --init-from) answers prompts no earlier round did (default: %(default)s)")
    p.add_argument("--own-temperatures", default="0", metavar="T1,T2,...",
                   help="one own answer per prompt per temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--own-share", type=float, metavar="F",
                   help="the own answers' share of the training examples per epoch, repeating or cutting "
                        "them (default: as many as there are)")


def config_from(args: argparse.Namespace):
    from ..distill import parse_temperatures
    from ..train.fit_config import FitConfig

    config = FitConfig(out=Path(args.out), drafter=args.drafter, target=args.target, dtype=args.dtype, device=args.device,
                       trust_remote_code=args.trust_remote_code, data=args.data, data_offset=args.data_offset, seq_len=args.seq_len,
                       tokens=parse_count(args.tokens) if args.tokens else None,
                       budget_seconds=parse_duration(args.budget) if args.budget else None,
                       extract_share=args.extract_share, heldout_prompts=args.heldout_prompts,
                       draft_vocab=args.draft_vocab, head=args.head, labels=args.labels, K=args.future_tokens, context=args.context, feature_layers=parse_layers(args.feature_layers),
                       hidden_in_recurrence=args.hidden_in_recurrence, kl_weight=args.kl_weight, num_blocks=args.num_blocks if args.num_blocks is not None else (2 if args.drafter == "redrafter" else 1),
                       epochs=args.epochs, max_steps=args.max_steps, batch_positions=args.batch_positions,
                       lr=args.lr if args.lr is not None else DEFAULT_LR[args.drafter], warmup=args.warmup,
                       loss=args.loss, copy_layers=args.copy_layers, gamma=args.gamma,
                       batch_sequences=args.batch_sequences, on_policy=args.on_policy,
                       on_policy_tokens=args.on_policy_tokens,
                       seed=args.seed, eval_every=args.eval_every, save_every_seconds=args.save_every,
                       progress=not args.no_progress, compile_target=args.compile_target,
                       compile_loss=not args.no_compile_loss, init_from=args.init_from,
                       heldout_data=args.heldout_data, stop_after_steps=args.stop_after_steps,
                       own_answers=args.own_answers, own_temperatures=parse_temperatures(args.own_temperatures, "--own-temperatures"),
                       own_share=args.own_share, own_offset=args.own_offset)
    config.check()
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise SpecdraftError(f"--out {args.out} exists and is not a directory")
    for name in ("heldout_data", "init_from"):
        value = getattr(args, name)
        if value and not (name == "init_from" and value == "default") and not Path(value).exists():
            raise SpecdraftError(f"--{name.replace('_', '-')} {value}: not found")
    return config


def run(args: argparse.Namespace) -> int:
    from ..models import quiet_loading
    from ..train.fit import run_fit

    config = config_from(args)  # every value checked before the model loads
    resolve_dtype_arg(args)
    config.dtype = args.dtype
    with quiet_loading():
        return run_fit(config)
