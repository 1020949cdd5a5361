"""The ``serve`` subcommand (registered in ``cli.SUBCOMMANDS``): an OpenAI-compatible HTTP server.

    specdraft serve --drafter lookup --port 8000 --max-batch-size 8
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

The server modules import lazily: the rest of the CLI works without the [serve] extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from ..errors import SpecdraftError
from .options import add_drafter_args, add_target_args, load_engine

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_serve(subparsers) -> None:
    """The ``serve`` subcommand's options."""
    p = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API with continuous batching",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
                    "Requests are decoded together with speculative decoding; new ones join the "
                    "running batch between steps. SIGTERM or Ctrl-C drains: new requests get 503, "
                    "running ones finish, then the server exits.")
    add_target_args(p)
    add_drafter_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 127.0.0.1 keeps the server local (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    g.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                   help="requests decoded together (default: %(default)s)")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for a batch slot; more get 429 (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("SPECDRAFT_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDRAFT_API_KEY, else none)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="end a request (408) that has not finished S seconds after it arrived; "
                        "0 disables it (default: %(default)s)")
    g.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the target's name)")
    g.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="max_tokens of requests that give none (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long running requests may go on before they are ended "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    p.set_defaults(run=run_serve)


def check_serve_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers before the (slow) model load."""
    from ..drafters.registry import check_shapes
    from ..models import parse_device

    check_shapes(args.beam_width, args.beam_length, args.gamma)
    parse_device(args.device)
    for name, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                             ("--default-max-tokens", args.default_max_tokens, 1),
                             ("--request-timeout", args.request_timeout, 0),
                             ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if not value >= low:
            raise SpecdraftError(f"{name} must be >= {low}, got {value}")
    if not 0 <= args.port <= 65535:
        raise SpecdraftError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise SpecdraftError("--api-key must not be empty")


def require_server_packages() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise SpecdraftError(f"specdraft serve needs the [serve] extra ({e.name} is missing): "
                             "pip install 'specdraft[serve]'") from None


def default_model_name(spec: str, target) -> str:
    """The target's name; for a local folder, the folder's name rather than its path."""
    path = Path(spec).expanduser()
    return path.name if spec != "default" and path.exists() else target.name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until a signal drains the server."""
    check_serve_args(args)
    require_server_packages()
    from ..server.app import ServeOptions, create_app
    from ..server.runner import in_passing_thread, listen, make_server, url_of

    logging.basicConfig(level=args.log_level.upper(), format="specdraft: %(levelname)s: %(message)s")
    if not is_loopback(args.host) and not args.api_key:
        print(f"specdraft: warning: listening on {args.host} without --api-key: anyone who can reach "
              "this address can use the model", file=sys.stderr)
    sock = listen(args.host, args.port)  # before the slow load, so a busy port fails at once
    # Loaded on a thread that ends, so that the scheduler thread's OpenMP pool is the only one
    # (runner.in_passing_thread: a second pool made every forward 1.9x slower).
    engine = in_passing_thread(load_engine, args)
    options = ServeOptions(
        model_name=args.model_name or default_model_name(args.target, engine.target), api_key=args.api_key,
        max_batch_size=args.max_batch_size, max_queue=args.max_queue,
        request_timeout=args.request_timeout or None, default_max_tokens=args.default_max_tokens)
    server = make_server(create_app(engine, options), sock, args.shutdown_timeout, args.log_level)
    from ..fastpath import layout_name
    from ..siblings import stacked_groups

    dtype = engine.target.dtype  # and the few-row layout it runs: a slow one slows every step
    drafter = args.drafter + (" in int8" if engine.drafter.int8 else "")  # --int8-drafter took: say so
    stacked = stacked_groups(engine.target.model)
    print(f"specdraft: serving {options.model_name} (drafter {drafter}, {str(dtype).removeprefix('torch.')}, "
          f"linear {layout_name(dtype)}{f', {stacked} stacked' if stacked else ''}) on {url_of(sock)}",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0
