"""The ``generate`` subcommand: one prompt streamed to stdout, or a JSONL file of prompts
decoded in batches, with stats on stderr."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import SpecdraftError
from ..sampling import SamplingParams
from .options import (DEFAULT_MAX_NEW_TOKENS, add_drafter_args, add_sampling_args, add_target_args, announce_choices,
                      check_model_args, load_engine, sampling_params)


def add_generate(subparsers) -> None:
    """The ``generate`` subcommand's options."""
    p = subparsers.add_parser(
        "generate", help="decode prompts with speculative decoding",
        description="Decode one prompt (streamed) or a JSONL file of prompts (in batches) with "
                    "speculative decoding. Lossless: greedy output is token for token the target's own, "
                    "sampled output follows exactly the target's distribution.")
    src = p.add_argument_group("prompts").add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one prompt")
    src.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help='one JSON object per line: {"prompt": "...", "id": ...} (id optional)')
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the target's chat template (default: on)")
    p.add_argument("--batch-size", type=int, default=1, metavar="B",
                   help="prompts decoded together (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (id, text, token_ids, stats), nothing else on stdout")
    add_target_args(p)
    add_drafter_args(p)
    add_sampling_args(p)
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Stream one prompt, or decode several in groups of --batch-size, in input order."""
    check_model_args(args)
    if args.batch_size < 1:
        raise SpecdraftError(f"batch size must be >= 1, got {args.batch_size}")
    items = read_prompts(args)
    engine = load_engine(args)
    fit_to_context(args, engine.target)
    prompts = encode_prompts(engine.target, items, args.chat)
    announce_choices(args)
    ids = [item["id"] for item in items]
    params = [sampling_params(args, i) for i in range(len(items))]
    if len(items) == 1 and not args.json:
        result = stream_to_stdout(engine, prompts[0], params[0])
        print(format_stats(result), file=sys.stderr)
        return 0
    for start in range(0, len(items), args.batch_size):
        group = slice(start, start + args.batch_size)
        results = engine.generate(prompts[group], params[group])
        for rid, result in zip(ids[group], results):
            print_result(rid, result, args.json)
    return 0


def fit_to_context(args: argparse.Namespace, target) -> None:
    """--max-new-tokens against the target's context, the first moment it is known: an
    explicit value beyond it is an error (the KV cache is sized by it), the default is capped."""
    if args.max_new_tokens is None:
        args.max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, target.max_context)
    else:
        target.check_new_tokens(args.max_new_tokens)


def read_prompts(args: argparse.Namespace) -> list[dict]:
    """[{'id', 'prompt'}] from --prompt (id 0) or --prompts-file."""
    from ..prompts import read_prompts_file

    if args.prompt is not None:
        return [{"id": 0, "prompt": args.prompt}]
    return read_prompts_file(args.prompts_file)


def encode_prompts(target, items: list[dict], chat: bool) -> list[list[int]]:
    """Token ids of every prompt, all checked before any is decoded, so a bad prompt late
    in a file fails the run before it prints anything."""
    return [target.encode_decodable(item["id"], item["prompt"], chat) for item in items]


def stream_to_stdout(engine, prompt: list[int], params: SamplingParams):
    """Write text deltas as they are accepted; return the GenerationResult."""
    result = None
    for piece in engine.stream(prompt, params):
        if isinstance(piece, str):
            sys.stdout.write(piece)
            sys.stdout.flush()
        else:
            result = piece
    sys.stdout.write("\n")
    sys.stdout.flush()
    return result


def print_result(rid, result, as_json: bool) -> None:
    """One request's output: a JSON line, or a header, its text, and stats on stderr."""
    if as_json:
        print(json.dumps({"id": rid, **result.to_dict()}), flush=True)
        return
    print(f"=== {rid} ===\n{result.text}", flush=True)
    print(format_stats(result, rid), file=sys.stderr, flush=True)


def format_stats(result, rid=None) -> str:
    """One compact line of a request's statistics (drafting: the share of decode steps
    adaptive drafting ran plain, and steps by drafted depth)."""
    from ..adaptive import depth_summary

    stages = " ".join(f"{k} {v:.3f}s" for k, v in result.stage_seconds.items())
    hist = " ".join(f"{k}:{v}" for k, v in sorted(result.accepted_hist.items()))
    prefix = f"[{rid}] " if rid is not None else ""
    return (f"{prefix}{result.new_tokens} tokens, {result.steps} steps, "
            f"τ {result.tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.1f} tokens/s, "
            f"{result.seconds:.2f}s ({result.finish_reason}) | {stages} | "
            f"accepted length:steps {hist} | drafting {depth_summary(result.drafted_hist, result.off_steps)}")
