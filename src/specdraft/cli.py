"""The ``specdraft`` command line.

Each subcommand is one entry of ``SUBCOMMANDS``: a function that adds its parser to the
subparsers and sets ``run`` (Namespace -> exit code) as its default. To add a subcommand,
write such a function and list it there; the option groups below (target, drafter,
sampling) are meant to be shared by subcommands that load a model.

User errors (``SpecdraftError``) become one line on stderr, ``specdraft: error: ...``,
and exit code 2, the same code argparse uses for its own usage errors.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from . import __version__
from .cli_bench import add_bench, add_sweep
from .cli_export import add_export
from .cli_serve import add_serve
from .cli_train import add_distill, add_train
from .errors import SpecdraftError
from .sampling import SamplingParams

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

# ---- shared option groups ---------------------------------------------------------------


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype, --trust-remote-code."""
    from .models import DTYPES

    g = parser.add_argument_group("target model")
    g.add_argument("--target", default="default", metavar="default|PATH|HUB_ID",
                   help="the model to decode: 'default' (SmolLM2-135M-Instruct), a local folder "
                        "with safetensors weights, or a Hugging Face hub id (default: %(default)s)")
    g.add_argument("--device", default="cpu", metavar="cpu|cuda", help="(default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES), help="(default: %(default)s)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code from its folder or hub repo to run")


def _tree_cap(text: str) -> int | None | str:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'none', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """--drafter and the shape of its proposals."""
    g = parser.add_argument_group("drafter")
    g.add_argument("--drafter", default="lookup", metavar="none|lookup|redrafter:PATH|medusa:PATH|draft:PATH",
                   help="where candidate tokens come from: none (plain decoding), lookup (prompt "
                        "n-gram lookup), a trained recurrent drafter or a small draft model "
                        "(checkpoint folders) (default: %(default)s)")
    g.add_argument("--max-tree-tokens", type=_tree_cap, default="auto", metavar="N|auto|none",
                   help="most tokens one verify step may hold over the whole batch, shared by its rows: "
                        "keeps speculation from slowing large batches (auto: 8 on CPU, no cap on GPU)")
    g.add_argument("--beam-width", type=int, metavar="W", help="candidate beams per step (drafter default if unset)")
    g.add_argument("--beam-length", type=int, metavar="L", help="tokens per beam, g0 included (drafter default if unset)")
    g.add_argument("--gamma", type=int, metavar="G", help="tokens a draft model drafts per step (draft: only)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Decoding settings; their rules live in SamplingParams.validate()."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="(default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 decodes greedily (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables it (default: %(default)s)")
    g.add_argument("--seed", type=int, metavar="S",
                   help="seed for sampling; with several prompts, prompt i (counting from 0 in "
                        "input order) uses seed S+i, so results do not depend on --batch-size")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (not part of the output); repeatable")


def sampling_params(args: argparse.Namespace, index: int = 0) -> SamplingParams:
    """The validated SamplingParams of the index-th prompt (seed S + index)."""
    seed = None if args.seed is None else args.seed + index
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=seed, stop=list(args.stop)).validate()


def check_model_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers and devices before the (slow) model load."""
    from .drafters.registry import check_shapes
    from .models import parse_device

    sampling_params(args)
    check_shapes(args.beam_width, args.beam_length, args.gamma)
    parse_device(args.device)


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Silence transformers' progress bars and warnings while loading, unless stderr is a
    terminal: in pipes and logs they would bury the stats and error lines."""
    if sys.stderr.isatty():
        yield
        return
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_engine(args: argparse.Namespace):
    """The target and drafter the options name, paired in a SpeculativeEngine."""
    from .drafters.registry import build_drafter
    from .engine import SpeculativeEngine
    from .models import load_target

    with quiet_loading():
        target = load_target(args.target, args.device, args.dtype, args.trust_remote_code)
        drafter = build_drafter(args.drafter, target, args.beam_width, args.beam_length, args.gamma)
    return SpeculativeEngine(target, drafter, max_tree_tokens=getattr(args, "max_tree_tokens", "auto"))


# ---- generate ---------------------------------------------------------------------------


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
    prompts = encode_prompts(engine.target, items, args.chat)
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


def read_prompts(args: argparse.Namespace) -> list[dict]:
    """[{'id', 'prompt'}] from --prompt (id 0) or --prompts-file."""
    from .prompts import read_prompts_file

    if args.prompt is not None:
        return [{"id": 0, "prompt": args.prompt}]
    return read_prompts_file(args.prompts_file)


def encode_prompts(target, items: list[dict], chat: bool) -> list[list[int]]:
    """Token ids of every prompt, all checked before any is decoded, so a bad prompt late
    in a file fails the run before it prints anything."""
    encoded = []
    for item in items:
        ids = target.encode_prompt(item["prompt"], chat)
        if not ids:
            raise SpecdraftError(f"prompt {item['id']!r} is empty")
        if len(ids) >= target.max_context:
            raise SpecdraftError(f"prompt {item['id']!r} has {len(ids)} tokens; "
                                 f"{target.name} has a context of {target.max_context}")
        encoded.append(ids)
    return encoded


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
    """One compact line of a request's statistics."""
    stages = " ".join(f"{k} {v:.3f}s" for k, v in result.stage_seconds.items())
    hist = " ".join(f"{k}:{v}" for k, v in sorted(result.accepted_hist.items()))
    prefix = f"[{rid}] " if rid is not None else ""
    return (f"{prefix}{result.new_tokens} tokens, {result.steps} steps, "
            f"τ {result.tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.1f} tokens/s, "
            f"{result.seconds:.2f}s ({result.finish_reason}) | {stages} | "
            f"accepted length:steps {hist}")


# ---- entry point ------------------------------------------------------------------------

# name -> function that adds the subcommand's parser (and sets its ``run`` default).
SUBCOMMANDS: dict[str, Callable] = {
    "generate": add_generate,
    "bench": add_bench,
    "sweep": add_sweep,
    "serve": add_serve,
    "train": add_train,
    "distill": add_distill,
    "export": add_export,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft",
                                     description="Lossless speculative decoding for Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(subparsers)
    return parser


def one_line(message: object) -> str:
    """Collapse a message to one line: the error must stay a single stderr line."""
    return " ".join(str(message).split())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed arguments; ``command_line`` records them, so reports say how they were made."""
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["specdraft", *(sys.argv[1:] if argv is None else map(str, argv))])
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = parse_args(argv)
    try:
        return args.run(args)
    except SpecdraftError as e:
        print(f"specdraft: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nspecdraft: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
