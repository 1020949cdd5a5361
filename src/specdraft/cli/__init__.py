"""The ``specdraft`` command line: the only layer that knows argparse.

Each subcommand is one entry of ``SUBCOMMANDS``: a function that adds its parser to the
subparsers and sets ``run`` (Namespace -> exit code) as its default. To add a subcommand,
write such a function in its own module here and list it there; the option groups of
``options`` (target, drafter, sampling) are meant to be shared by subcommands that load a
model. The commands turn their options into the library's plain values (``EngineSpec``,
``BenchConfig``, ``FitConfig``, ...); nothing outside this package imports from it.

One error boundary (``run_command``): every subcommand's arguments are checked
(``checks.check_args``, then the subcommand's own checks) before any work starts. User
errors (``SpecdraftError``) and failures of the environment (``OSError``: a disk full, a file
vanished) become one line on stderr, ``specdraft: error: ...``, and exit code 2, the same
code argparse uses for its own usage errors. Anything else is a bug: still one line, exit
code 1, and the traceback only with ``--debug`` or ``SPECDRAFT_DEBUG=1`` (for bug reports).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from typing import Callable

from .. import __version__
from ..errors import SpecdraftError
from .bench import add_bench, add_sweep
from .checks import check_args
from .datastore import add_datastore
from .distill import add_distill
from .export import add_export
from .fit import add_fit
from .generate import add_generate
from .parity import add_parity
from .serve import add_serve
from .train import add_train

EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

# ---- entry point ------------------------------------------------------------------------

# name -> function that adds the subcommand's parser (and sets its ``run`` default).
SUBCOMMANDS: dict[str, Callable] = {
    "generate": add_generate,
    "bench": add_bench,
    "sweep": add_sweep,
    "serve": add_serve,
    "train": add_train,
    "distill": add_distill,
    "datastore": add_datastore,
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


def console() -> None:
    """The ``specdraft`` program (script and ``python -m specdraft``): ``main``, then exit.

    A process launched as one rank of several (``WORLD_SIZE`` > 1: ``accelerate launch``,
    ``torchrun``) leaves without the interpreter's teardown once the command has returned (its
    outputs saved and closed): gloo's worker threads outlive ``destroy_process_group`` there
    (held from C++), and tearing the interpreter down under them now and then aborted a rank
    after a finished run ("terminate called without an active exception"), which the launcher
    reports as a failed job."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run_command(args: argparse.Namespace) -> int:
    """The error boundary of every subcommand: shared checks, then ``args.run``; whatever
    fails becomes one stderr line and an exit code (see the module docstring)."""
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
