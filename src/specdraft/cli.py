"""The ``specdraft`` command line.

Each subcommand is one entry of ``SUBCOMMANDS``: a function that adds its parser to the
subparsers and sets ``run`` (Namespace -> exit code) as its default. To add a subcommand,
write such a function and list it there; the option groups below (target, drafter,
sampling) are meant to be shared by subcommands that load a model.

One error boundary (``run_command``): every subcommand's arguments are checked
(``cli_checks.check_args``, then the subcommand's own checks) before any work starts. User
errors (``SpecdraftError``) and failures of the environment (``OSError``: a disk full, a file
vanished) become one line on stderr, ``specdraft: error: ...``, and exit code 2, the same
code argparse uses for its own usage errors. Anything else is a bug: still one line, exit
code 1, and the traceback only with ``--debug`` or ``SPECDRAFT_DEBUG=1`` (for bug reports).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

from . import __version__
from .cli_bench import add_bench, add_sweep
from .cli_export import add_export
from .cli_fit import add_fit
from .cli_parity import add_parity
from .cli_serve import add_serve
from .cli_train import add_distill, add_train
from .errors import SpecdraftError
from .sampling import SamplingParams

EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
DEFAULT_MAX_NEW_TOKENS = 256

# ---- shared option groups ---------------------------------------------------------------


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype, --trust-remote-code."""
    from .models import DTYPE_CHOICES

    g = parser.add_argument_group("target model")
    g.add_argument("--target", default="default", metavar="default|PATH|HUB_ID",
                   help="the model to decode: 'default' (SmolLM2-135M-Instruct), a local folder "
                        "with safetensors weights, or a Hugging Face hub id (default: %(default)s)")
    g.add_argument("--device", default="cpu", metavar="cpu|cuda", help="(default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="auto: bfloat16 where the device computes it natively (CPUs with AVX512-BF16 or AMX, "
                        "CUDA devices with bf16), else float32 (default: %(default)s)")
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
                        "keeps speculation from slowing large batches (auto: none with --adaptive on, which weighs "
                        "the cost itself; else 8 on CPU, no cap on GPU)")
    g.add_argument("--adaptive", choices=("on", "off", "refresh"), default="on",
                   help="on: each step drafts only as deep as pays on this machine, or not at all, from a cost model of the "
                        "target (measured once, a few seconds, cached) and each request's acceptance so far; off: the "
                        "drafter's fixed shape; refresh: re-measure the cost model, then on (default: %(default)s)")
    g.add_argument("--beam-width", type=int, metavar="W", help="candidate beams per step (drafter default if unset)")
    g.add_argument("--beam-length", type=int, metavar="L", help="tokens per beam, g0 included (drafter default if unset)")
    g.add_argument("--gamma", type=int, metavar="G", help="tokens a draft model drafts per step (draft: only)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Decoding settings; their rules live in SamplingParams.validate()."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, metavar="N",
                   help=f"at most the target's context (default: {DEFAULT_MAX_NEW_TOKENS}, capped to the context)")
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
    max_new = DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    return SamplingParams(max_new_tokens=max_new, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=seed, stop=list(args.stop)).validate()


def resolve_dtype_arg(args: argparse.Namespace) -> None:
    """Replace ``--dtype auto`` by the dtype it stands for on ``--device``; keep the reason
    in ``args.dtype_note`` for ``announce_dtype`` (printed once the command's input is known
    to be good, so that an error stays the only stderr line)."""
    from .models import parse_device, resolve_dtype

    if getattr(args, "dtype", None) != "auto" or not hasattr(args, "device"):
        return
    args.dtype = resolve_dtype("auto", parse_device(args.device))
    why = "native bf16 on this device" if args.dtype == "bfloat16" else "no native bf16 on this device"
    args.dtype_note = f"specdraft: dtype {args.dtype} (--dtype auto: {why})"


def announce_dtype(args: argparse.Namespace) -> None:
    """Say on stderr (one line, once) which dtype ``--dtype auto`` picked: results differ
    between dtypes, so a run must tell."""
    note = getattr(args, "dtype_note", None)
    if note:
        print(note, file=sys.stderr, flush=True)
        args.dtype_note = None


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

    resolve_dtype_arg(args)
    with quiet_loading():
        target = load_target(args.target, args.device, args.dtype, args.trust_remote_code)
        drafter = build_drafter(args.drafter, target, args.beam_width, args.beam_length, args.gamma)
    return SpeculativeEngine(target, drafter, max_tree_tokens=getattr(args, "max_tree_tokens", "auto"),
                             policy=adaptive_policy(target, drafter, getattr(args, "adaptive", "off")))


def adaptive_policy(target, drafter, mode: str):
    """--adaptive on|refresh: a policy over the target's cached cost model (measured here on
    first use, a few seconds); off, or a drafter that never drafts: None (fixed shapes)."""
    from .adaptive import AdaptivePolicy, load_cost_model

    if mode == "off" or drafter.acceptance_prior <= 0:
        return None
    return AdaptivePolicy(load_cost_model(target, refresh=mode == "refresh"))


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
    fit_to_context(args, engine.target)
    prompts = encode_prompts(engine.target, items, args.chat)
    announce_dtype(args)
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
    """One compact line of a request's statistics (drafting: the share of decode steps
    adaptive drafting ran plain, and steps by drafted depth)."""
    from .adaptive import depth_summary

    stages = " ".join(f"{k} {v:.3f}s" for k, v in result.stage_seconds.items())
    hist = " ".join(f"{k}:{v}" for k, v in sorted(result.accepted_hist.items()))
    prefix = f"[{rid}] " if rid is not None else ""
    return (f"{prefix}{result.new_tokens} tokens, {result.steps} steps, "
            f"τ {result.tokens_per_step:.2f} tokens/step, {result.tokens_per_second:.1f} tokens/s, "
            f"{result.seconds:.2f}s ({result.finish_reason}) | {stages} | "
            f"accepted length:steps {hist} | drafting {depth_summary(result.drafted_hist, result.off_steps)}")


# ---- entry point ------------------------------------------------------------------------

# name -> function that adds the subcommand's parser (and sets its ``run`` default).
SUBCOMMANDS: dict[str, Callable] = {
    "generate": add_generate,
    "bench": add_bench,
    "sweep": add_sweep,
    "serve": add_serve,
    "train": add_train,
    "distill": add_distill,
    "fit": add_fit,
    "export": add_export,
    "parity": add_parity,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft",
                                     description="Lossless speculative decoding for Hugging Face causal LMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an unexpected error (also: SPECDRAFT_DEBUG=1)")
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
    return run_command(parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """The error boundary of every subcommand: shared checks, then ``args.run``; whatever
    fails becomes one stderr line and an exit code (see the module docstring)."""
    from .cli_checks import check_args

    debug = getattr(args, "debug", False) or os.environ.get("SPECDRAFT_DEBUG", "") not in ("", "0")
    try:
        check_args(args)
        return args.run(args)
    except SpecdraftError as e:
        message, code = one_line(e), EXIT_USAGE
    except KeyboardInterrupt:
        print("\nspecdraft: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:  # the environment's (no space left, permission changed mid-run), not a bug
        where = f": {e.filename}" if e.filename else ""
        message, code = one_line(f"{e.strerror or e}{where}"), EXIT_USAGE
        if debug:
            traceback.print_exc()
    except Exception as e:
        message, code = one_line(f"unexpected {type(e).__name__}: {e}"), EXIT_BUG
        if debug:
            traceback.print_exc()
        else:
            message += " (run with --debug or SPECDRAFT_DEBUG=1 for the traceback)"
    print(f"specdraft: error: {message}", file=sys.stderr)
    return code
