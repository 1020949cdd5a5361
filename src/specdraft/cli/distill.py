"""The ``distill`` subcommand: the target's own outputs written as training data
(JSONL, resumable)."""

from __future__ import annotations

import argparse
import sys

from ..errors import SpecdraftError
from .options import add_drafter_args, add_target_args, load_engine, resolve_dtype_arg


def add_distill(subparsers) -> None:
    p = subparsers.add_parser(
        "distill", help="write the target's own outputs as training data (JSONL, resumable)",
        description="responses: the target's answers to ShareGPT first-turn prompts (or a prompts file), one "
                    "sample per prompt per temperature. next-k: the target's greedy next-K tokens at every "
                    "assistant position of ShareGPT conversations. Rerunning the same command resumes.")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="records are appended here")
    p.add_argument("--mode", choices=("responses", "next-k"), default="responses", help="(default: %(default)s)")
    p.add_argument("--data", default="sharegpt", metavar="sharegpt|FILE.json|PROMPTS.jsonl",
                   help="ShareGPT (packaged or a file in its format), or for responses a JSONL of "
                        '{"prompt", "id"} lines (default: %(default)s)')
    p.add_argument("--split", choices=("train", "heldout"), default="train",
                   help="ShareGPT split (default: %(default)s)")
    p.add_argument("--limit", type=int, metavar="N", help="the first N prompts / conversations")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("responses")
    g.add_argument("--temperatures", default="0", metavar="T1,T2,...",
                   help="one sample per prompt per temperature; 0 is greedy (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="(default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="sample i (prompt-major, then temperature) uses seed S+i (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=96, metavar="B",
                   help="rows in flight (continuous batching); plain decoding by default (--drafter none) (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N",
                   help="skip longer prompts (default: %(default)s)")
    g = p.add_argument_group("next-k")
    g.add_argument("--future-tokens", "-K", type=int, default=5, metavar="K", help="(default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=2048, metavar="T", help="(default: %(default)s)")
    g.add_argument("--chunk", type=int, default=512, metavar="C",
                   help="positions rolled out together (memory ~ C x (T + K·C)) (default: %(default)s)")
    add_target_args(p)
    add_drafter_args(p)
    p.set_defaults(drafter="none", run=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    from .. import distill
    from ..train.fit_stages import sigterm_as_interrupt

    if args.limit is not None and args.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {args.limit}")
    if args.max_prompt_tokens < 1:
        raise SpecdraftError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    temps = distill.parse_temperatures(args.temperatures)
    check_distill_args(args, temps)
    if args.mode == "next-k":
        from ..data.sharegpt import load_conversations
        from ..models import load_target, quiet_loading

        convs, stats = load_conversations(_sharegpt_path(args.data), args.split, args.limit)
        print(f"specdraft: ShareGPT: {stats.summary()}", file=sys.stderr)
        resolve_dtype_arg(args)
        with quiet_loading():
            target = load_target(args.target, args.device, args.dtype, args.trust_remote_code)
        report = distill.distill_next_k(target, convs, args.out, K=args.future_tokens, seq_len=args.seq_len,
                                        chunk=args.chunk, progress=not args.no_progress)
    else:
        engine = load_engine(args)
        engine.target.check_new_tokens(args.max_new_tokens)
        report = distill.DistillReport()
        prompts = distill.make_prompts(engine.target.tokenizer, _prompt_items(args), args.max_prompt_tokens, report)
        with sigterm_as_interrupt():  # like Ctrl-C: the finished answers of the window are written first
            done = distill.distill_responses(engine, prompts, temps, args.out, max_new_tokens=args.max_new_tokens,
                                             batch_size=args.batch_size, seed=args.seed, top_p=args.top_p,
                                             top_k=args.top_k, progress=not args.no_progress)
        done.skipped.update(report.skipped)
        report = done
    print(f"specdraft: {args.out}: {report.summary()}", file=sys.stderr)
    return 0


def check_distill_args(args, temps: list[float]) -> None:
    """Fail on bad numbers before the (slow) model load."""
    from ..drafters.registry import check_shapes
    from ..models import parse_device
    from ..sampling import SamplingParams

    for t in temps:
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=t, top_p=args.top_p,
                       top_k=args.top_k).validate()
    for name in ("batch_size", "future_tokens", "chunk"):
        if getattr(args, name) < 1:
            raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_shapes(args.beam_width, args.beam_length, args.gamma)
    parse_device(args.device)


def _sharegpt_path(spec: str):
    if spec == "sharegpt":
        return None
    if spec.endswith(".json"):
        return spec
    raise SpecdraftError(f"--data must be 'sharegpt' or a ShareGPT-format FILE.json here, got {spec!r}")


def _prompt_items(args) -> list[tuple[str, list[dict]]]:
    """(id, messages) of the prompts to answer."""
    if args.data.endswith(".jsonl"):
        from ..prompts import read_prompts_file

        items = read_prompts_file(args.data)[: args.limit]
        return [(str(it["id"]), [{"role": "user", "content": it["prompt"]}]) for it in items]
    from ..data.sharegpt import first_turn, load_conversations

    convs, stats = load_conversations(_sharegpt_path(args.data), args.split, args.limit)
    print(f"specdraft: ShareGPT: {stats.summary()}", file=sys.stderr)
    return [(c.id, first_turn(c)) for c in convs]
