"""The ``bench`` and ``sweep`` subcommands (registered in ``cli.SUBCOMMANDS``).

    specdraft bench --drafters none,lookup,hf-ar --dataset mt-bench --limit 20 --out runs/mt
    specdraft bench --verify-cost --device cuda --random-target llama-7b --out runs/verify
    specdraft sweep --drafter lookup --widths 1,2,4 --lengths 4,6,8 --dataset mt-bench --limit 10 --out runs/sweep
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecdraftError
from .options import add_compile_target_arg, add_tree_attention_arg, resolve_dtype_arg

# ---- option parsing helpers ---------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8] (an argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ---- shared options -----------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Target options (as in ``generate``)."""
    from ..models import DTYPE_CHOICES

    g = p.add_argument_group("target model")
    g.add_argument("--target", default="default", metavar="default|NAME|PATH|HUB_ID",
                   help="the model to decode, as for generate --target (default: %(default)s, SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", metavar="cpu|cuda", help="(default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="auto: bfloat16 where the device computes it natively, else float32; every method, "
                        "transformers' peers included, runs at this dtype (default: %(default)s)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")
    add_compile_target_arg(g)
    add_tree_attention_arg(g)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Prompts, sampling and output options shared by bench and sweep."""
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", type=str_list, default=["mt-bench"],
                   metavar="mt-bench|humaneval|sharegpt-heldout|FILE.jsonl",
                   help='prompt set(s), comma-separated; a FILE.jsonl holds {"prompt": ...} lines (default: mt-bench)')
    g.add_argument("--limit", type=int, metavar="N", help="first N prompts of each set (default: all)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the target's chat template (default: on)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="every row writes --max-new-tokens (an EOS does not end it): throughput at a fixed "
                        "length, also where bfloat16 near-ties change a row's length (transformers' peers: "
                        "not run)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="for T > 0 (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="for T > 0, 0 = off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="prompt i samples with seed S+i (default: %(default)s)")
    g.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="timed passes over all prompts; tokens/s is their median (default: %(default)s)")
    g.add_argument("--interleave", action="store_true",
                   help="load every method at once and run their batches in turn (batch i of each before batch "
                        "i + 1 of any), so that a machine whose speed drifts slows every method alike; peak "
                        "memory is then the whole process's")
    g.add_argument("--lockstep", action="store_true",
                   help="as --interleave, and within a batch our methods advance one decode step each in turn "
                        "(each timing only its own steps), so that a machine whose speed swings within seconds "
                        "(a shared VM) slows every method alike; transformers' peers still run whole batches")
    o = p.add_argument_group("output")
    o.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder for results.json, report.md, plots")
    o.add_argument("--resume", action="store_true",
                   help="keep the rows already in DIR/results.json (same settings) and measure only the others")
    o.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up call of each method")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def base_config(args: argparse.Namespace, **extra):
    """A BenchConfig from the options common to bench and sweep."""
    from ..bench.runner import BenchConfig

    return BenchConfig(
        out=args.out, datasets=args.dataset, target=args.target, device=args.device, dtype=args.dtype,
        trust_remote_code=args.trust_remote_code, limit=args.limit, top_p=args.top_p, top_k=args.top_k,
        repeats=args.repeats, max_new_tokens=args.max_new_tokens, seed=args.seed, chat=args.chat,
        resume=args.resume, warmup=args.warmup, progress=args.progress, command=args.command_line,
        interleave=args.interleave, lockstep=args.lockstep,
        compile_target=args.compile_target, tree_attention=args.tree_attention, ignore_eos=getattr(args, "ignore_eos", False), **extra)


def check_device(args: argparse.Namespace) -> None:
    from ..models import parse_device

    parse_device(args.device)


# ---- bench --------------------------------------------------------------------------------


def add_bench(subparsers) -> None:
    """The ``bench`` subcommand's options."""
    p = subparsers.add_parser(
        "bench", help="measure speed, τ and acceptance of drafters and transformers peers",
        description="Measure our drafters (through the speculative engine) and transformers' own decoding on the "
                    "same prompts in one process: tokens/s, speed-up vs our autoregressive decoding and vs "
                    "transformers generate(), τ, acceptance by depth, stage times, peak memory. Writes "
                    "results.json (after every finished row), report.md and PNG plots to --out.")
    g = p.add_argument_group("methods")
    g.add_argument("--drafters", type=str_list, default=["none", "auto"], metavar="LIST",
                   help="comma-separated: none, auto (what generate and serve use by default), lookup, redrafter:PATH, medusa:PATH, draft:PATH (ours), hf-ar, "
                        "hf-assisted:PATH, hf-lookup (transformers); a suffix @WxL or @gG sets one method's shape, "
                        "@fixed or @adaptive (or /fixed, /adaptive after a shape) its policy, whatever --adaptive says. "
                        "'none' is always measured (default: none,auto)")
    g.add_argument("--batch-sizes", type=int_list, default=[1], metavar="LIST", help="(default: 1)")
    g.add_argument("--temperatures", type=float_list, default=[0.0], metavar="LIST", help="0 = greedy (default: 0)")
    g.add_argument("--beam-width", type=int, metavar="W", help="candidate beams per step (drafter default if unset)")
    g.add_argument("--beam-length", type=int, metavar="L",
                   help="tokens per beam, g0 included, and of a head's sampled chain (drafter default if unset)")
    g.add_argument("--gamma", type=int, metavar="G", help="tokens a draft model drafts per step")
    g.add_argument("--adaptive", choices=("on", "off", "refresh"), default="on",
                   help="on: each step drafts only as deep as pays on this machine, or not at all, from a cost model of the "
                        "target (measured once, a few seconds, cached) and each request's acceptance so far; off: the "
                        "drafter's fixed shape; refresh: re-measure the cost model, then on (default: %(default)s)")
    g.add_argument("--mt-bench-turns", type=int, default=1, choices=(1, 2),
                   help="2: measure MT-Bench's second turn, after the method's own greedy first answer (default: 1)")
    v = p.add_argument_group("verify cost (instead of the methods)")
    v.add_argument("--verify-cost", action="store_true",
                   help="time one target forward against the number of tree tokens it verifies")
    v.add_argument("--verify-tokens", type=int_list, default=None, metavar="LIST",
                   help="tree sizes N (default: 1,2,4,...,256)")
    v.add_argument("--verify-prefix", type=int, default=256, metavar="P",
                   help="cached tokens before the tree (default: %(default)s)")
    v.add_argument("--verify-trials", type=int, default=10, metavar="T",
                   help="timed forwards per N (default: %(default)s)")
    v.add_argument("--random-target", metavar="llama-1b|llama-7b|PATH/config.json",
                   help="time a target built from a config with random weights instead of --target")
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(run=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from ..bench.runner import run_bench
    from ..drafters.registry import check_shapes

    check_device(args)
    check_shapes(args.beam_width, args.beam_length, args.gamma)
    if args.verify_trials < 1:
        raise SpecdraftError(f"--verify-trials must be >= 1, got {args.verify_trials}")
    if args.random_target and not args.verify_cost:
        raise SpecdraftError("--random-target applies to --verify-cost only")
    cfg = base_config(args, drafters=args.drafters, batch_sizes=args.batch_sizes, temperatures=args.temperatures,
                      beam_width=args.beam_width, beam_length=args.beam_length, gamma=args.gamma,
                      mt_bench_turns=args.mt_bench_turns, adaptive=args.adaptive)
    if not args.verify_cost:
        cfg.validate()
    resolve_dtype_arg(args)
    cfg.dtype = args.dtype
    if args.verify_cost:
        from ..bench.verify_cost import DEFAULT_TOKENS, run_verify_cost

        result = run_verify_cost(cfg, args.verify_tokens or list(DEFAULT_TOKENS), args.verify_prefix,
                                 args.verify_trials, args.random_target)
        print(f"verify cost of {len(result['rows'])} tree sizes ({result['environment']['dtype']}) written to "
              f"{args.out}/verify_cost.md", file=sys.stderr)
        return 0
    results = run_bench(cfg)
    print(f"{len(results['runs'])} rows ({results['environment']['dtype']}) in {args.out}/results.json; "
          f"tables in {args.out}/report.md", file=sys.stderr)
    return 0


# ---- sweep --------------------------------------------------------------------------------


def add_sweep(subparsers) -> None:
    """The ``sweep`` subcommand's options."""
    p = subparsers.add_parser(
        "sweep", help="find the fastest drafting shape on this machine and record it in the drafter's config",
        description="Measure tokens/s of a drafter at every beam width x length (or width x gamma for a draft "
                    "model), next to plain decoding on the same prompts, and record the fastest shape where the "
                    "drafter reads its defaults: PATH/config.json, or lookup.json in the specdraft cache folder.")
    p.add_argument("--drafter", required=True, metavar="lookup|redrafter:PATH|medusa:PATH|draft:PATH")
    p.add_argument("--widths", type=int_list, default=[1, 2, 4, 8], metavar="LIST", help="(default: 1,2,4,8)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--lengths", type=int_list, metavar="LIST", help="beam lengths L, g0 included (default: 3,5,8)")
    shape.add_argument("--gammas", type=int_list, metavar="LIST", help="draft tokens per step (draft:PATH only)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="(default: %(default)s)")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=int_list, default=[1], metavar="LIST",
                   help="the shape recorded is the fastest at the smallest (default: 1)")
    p.add_argument("--no-record", dest="record", action="store_false",
                   help="only measure; leave the drafter's config as it is")
    p.add_argument("--adaptive", choices=("on", "off", "refresh"), default="on",
                   help="on: also measure adaptive drafting (DRAFTER@adaptive: the drafter's default shape as "
                        "its cap) against plain decoding and every fixed shape; refresh: re-measure the cost "
                        "model first; off: fixed shapes only (default: %(default)s)")
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(run=run_sweep_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    from ..bench.sweep import run_sweep

    check_device(args)
    if len(args.dataset) != 1:
        raise SpecdraftError("sweep measures one dataset at a time")
    resolve_dtype_arg(args)
    lengths = args.lengths if args.lengths or args.gammas else [3, 5, 8]
    cfg = base_config(args, batch_sizes=args.batch_sizes, temperatures=[args.temperature], adaptive=args.adaptive)
    cfg.dtype = args.dtype
    results = run_sweep(cfg, args.drafter, args.widths, lengths, args.gammas, record=args.record,
                        adaptive=args.adaptive != "off")
    best = results["best"]
    where = f"; recorded in {best['recorded_in']}" if best["recorded_in"] else ""
    print(f"best shape: W={best['beam_width']} L={best['beam_length']}{where} (table: {args.out}/sweep.md)",
          file=sys.stderr)
    for c in results["adaptive"]:
        print(f"adaptive, B={c['batch_size']}: {c['adaptive']:.1f} tokens/s = {c['ratio']:.2f}x the best of none "
              f"({c['none']:.1f}) and every fixed shape", file=sys.stderr)
    return 0
