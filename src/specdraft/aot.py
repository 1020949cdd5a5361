"""The target's decoder step compiled ahead of time into AOTInductor packages kept on disk
(``--compile-target`` on CPU; ``compile_packaged``).

Why not torch.compile alone: inductor bypasses its on-disk cache for a frozen CPU graph (the
prepacked weights do not pickle: docs/engine.md, "Why a later process compiles again"), so
every process compiled every shape class again, 80-120 s each on 2 cores. A package is the
same kind of code (weights frozen in, GEMMs autotuned, inductor's C++ GEMM for few rows) as a
shared library with its weights: built once per target and machine, loaded by any later
process in about two seconds.

What a package computes (``Step``), one forward of the decoder stack over a cache:

    (input_ids (B, N), position_ids (B, N), mask, keys [L x (B, Hk, C, D)], values [same])
        -> [hidden (B, N, d)], or [hidden, states (B, N, n, d)] with n inner layers (a head's)

mask is (B, 1, N, K) bool over K = S + N keys (the S committed slots of the cache, then the N
new tokens), or a dict of such masks by layer type (sliding-window models). The N new keys and
values land in slots [S, K) of each buffer, in place, as ``CompactLayer.update`` writes them.

Which package serves a call: one per (size class of ``graphs``, layers read), its dynamic
dimensions the class's plus K and C; a call reading fewer layers than the engine's drafter
(``PackagedStep.layers``) takes them from the drafter's packages. Worked example, the shipped head at batch 1: a 40-token
prompt runs ``many-tokens`` (1, N >= 5), a step after a rejected draft ``one`` (1, 1), a
1 x 3 beam's tree ``few-tokens`` (1, 2..4), each with the head's feature layers. A call no
package serves (another dtype, a cache not allocated yet, a class not built once warm-up is
over) runs the eager stack: same numbers up to rounding, no stall.

Where: ``models.cache_dir()/compiled/<fingerprint>/<class>[-layers].pt2``. The fingerprint
covers the weights, the model's config, the dtype, the torch and transformers versions, the
CPU's instruction sets and the thread count (the kernels are built for them), inductor's
config, and the source of the code a package traces. A package is compiled code: it is only loaded from this
folder, written by this program on this machine (as inductor's own cache is), never from a
path a user passes.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import fastpath, graphs
from .cache import CompactCache

# Modules whose code a package traces (with ``Target.states``): a change to any of them is
# another fingerprint. Not ``siblings``: its stacked products step aside while traced.
TRACED_MODULES = ("aot", "cache", "fastpath", "graphs")
BOUND = graphs.MANY_ROWS  # upper bound of the key and capacity dimensions (more than any context)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "bmi")  # the CPU flags generated kernels may use


class Step(torch.nn.Module):
    """One forward of ``target``'s decoder stack as a function of tensors only (the signature
    in the module docstring): what ``torch.export`` traces for a package."""

    def __init__(self, target, layers: tuple[int, ...]):
        super().__init__()
        self.base = target.base  # registered: export sees the weights as the step's own
        self.states = target.states
        self.layers = layers

    def forward(self, input_ids, position_ids, mask, keys, values):
        tokens = input_ids.shape[1]
        width = key_width(mask) - tokens  # the cache's committed slots
        torch._check(width >= 0)
        torch._check(width + tokens <= keys[0].shape[2])  # the buffers hold the new tokens
        cache = CompactCache.over(keys, values, width)
        with fastpath.active():
            hidden, states = self.states(self.layers, input_ids=input_ids, attention_mask=mask,
                                         position_ids=position_ids, past_key_values=cache, use_cache=True)
        return (hidden,) if states is None else (hidden, states)


def key_width(mask) -> int:
    """K, the keys a mask (or a dict of masks by layer type) spans."""
    return next(iter(mask.values())).shape[-1] if isinstance(mask, dict) else mask.shape[-1]


def fingerprint(target, options: dict) -> str:
    """What a package of ``target`` compiled with inductor's config ``options`` depends on,
    hashed (the module docstring lists it)."""
    import transformers

    from .models import cpu_flags

    digest = hashlib.sha256()
    meta = dict(torch=torch.__version__, transformers=transformers.__version__, dtype=str(target.dtype),
                threads=torch.get_num_threads(), config=target.config.to_json_string(),
                isa=sorted(f for f in cpu_flags() if f.startswith(ISA_PREFIXES)),
                options=options)
    digest.update(json.dumps(meta, sort_keys=True).encode())
    here = Path(__file__).parent
    for name in TRACED_MODULES:
        digest.update((here / f"{name}.py").read_bytes())
    digest.update(inspect.getsource(type(target).states).encode())
    for name, tensor in sorted(target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:20]


def package_folder(target, options: dict) -> Path:
    """Where ``target``'s packages compiled with ``options`` live, by default."""
    from .models import cache_dir

    return cache_dir() / "compiled" / fingerprint(target, options)


def compile_packaged(target, folder=None, options: dict | None = None, layers: tuple[int, ...] = ()) -> None:
    """Run ``target``'s engine forwards (``Target.forward_features``) through packages of its
    decoder stack (kept under ``folder``, by default the model cache's ``compiled`` folder;
    ``options``: inductor's config, by default ``graphs.CPU_INDUCTOR_OPTIONS``; ``layers``: the
    inner layers the engine's drafter reads, which the packages built return). Each size class
    is built once per machine (minutes), loaded in seconds after. CPU only. The eager stack is
    left as it is: calls no package serves run it. Outputs may part from eager decoding at
    numerical near-ties, as with ``Target.compile``."""
    from .errors import SpecdraftError
    from .models import install_capture_hooks

    if target.compiled:
        return
    if target.device.type != "cpu":
        raise SpecdraftError(f"ahead-of-time packages are built for CPU targets; this one is on {target.device}")
    install_capture_hooks(target.base)  # before tracing: a head's inner-layer reads are in every package
    target.packaged, target.compiled = PackagedStep(target, folder, options, layers), True


def say(message: str) -> None:
    print(f"specdraft: {message}", file=sys.stderr, flush=True)


class PackagedStep:
    """``target``'s packages, each loaded on first use, or built first (minutes, once per
    machine) while ``build`` is on: the engine turns it off after warm-up (``Target.warmed``),
    after which a class without a package runs eager rather than stall a request.

    ``__call__`` returns the package's (hidden, states or None), or None where no package
    serves the call (the caller runs the eager stack)."""

    def __init__(self, target, folder: Path | None = None, options: dict | None = None,
                 layers: tuple[int, ...] = ()):
        self.target = target
        # The inner layers the packages built here return (the engine's drafter's): a call
        # asking for fewer (the cost model's timing, plain decoding) takes what it asked from
        # those packages instead of a second set of its own (``route``).
        self.layers = tuple(layers)
        self.routes: dict = {}  # (class name, layers asked) -> the key of the package serving them
        self.options = dict(graphs.CPU_INDUCTOR_OPTIONS if options is None else options)
        # under a given folder too, one subfolder per fingerprint: other weights, other packages
        self.folder = (Path(folder) / fingerprint(target, self.options) if folder is not None
                       else package_folder(target, self.options))
        self.runners: dict = {}  # (class name, layers) -> loaded package, or None: eager
        self.build = True
        self.failed: set = set()  # keys whose export or compile failed: eager for good
        self.built: list[str] = []  # package names built / loaded by this process, in order
        self.loaded: list[str] = []

    def __call__(self, layers: tuple[int, ...], inputs: dict):
        args = arguments(inputs, self.target.dtype)
        if args is None:
            return None
        size = graphs.size_class(*args[0].shape)
        asked = (size.name, tuple(layers))
        if asked not in self.routes:
            self.routes[asked] = self.route(*asked)
        key = self.routes[asked]
        served = key[1]
        if key not in self.runners:
            runner = self._load(key)
            if runner is None and self.build:
                runner = self._build(key, size, args)  # None if it failed (``failed``)
            self.runners[key] = runner  # None: eager, until the next warm-up
        runner = self.runners[key]
        if runner is None:
            return None
        out = runner(*args)
        if not layers:
            return out[0], None
        return out[0], out[1] if served == tuple(layers) else out[1][:, :, [served.index(i) for i in layers]]

    def warming(self) -> None:
        """Build missing packages again (a warm-up): classes left eager after the last one are
        tried again, except those whose compile failed."""
        self.build = True
        self.runners = {key: runner for key, runner in self.runners.items()
                        if runner is not None or key in self.failed}
        self.routes = {}

    def route(self, name: str, layers: tuple[int, ...]) -> tuple:
        """The key of the package serving class ``name`` for a call reading ``layers``: of those
        loaded or on disk, the one returning the fewest layers that include them; else the one
        to build, ``self.layers`` if they include them, else exactly ``layers``."""
        have = {key[1] for key, runner in self.runners.items() if key[0] == name and runner is not None}
        for path in self.folder.glob(f"{name}*.pt2"):
            rest = path.stem[len(name):].split("-")  # "many-rows-2-14" for "many": ["", "rows", "2", "14"]
            if rest[0] == "" and all(part.isdigit() for part in rest[1:]):
                have.add(tuple(int(part) for part in rest[1:]))
        fits = sorted((served for served in have if set(layers) <= set(served)), key=len)
        if fits:
            return name, fits[0]
        return name, self.layers if set(layers) <= set(self.layers) else layers

    def path(self, key) -> Path:
        name, layers = key
        return self.folder / (name + "".join(f"-{layer}" for layer in layers) + ".pt2")

    def _load(self, key):
        path = self.path(key)
        if not path.exists():
            return None
        try:
            runner = torch._inductor.aoti_load_package(str(path))
        except Exception as error:  # a damaged or foreign file: build it again
            say(f"could not load the compiled graph {path} ({type(error).__name__}: {error}); compiling it again")
            return None
        self.loaded.append(path.stem)
        return runner

    def _build(self, key, size: graphs.SizeClass, args):
        layers = key[1]
        path = self.path(key)
        say(f"compiling the target's {path.stem} graph once for this machine (a few minutes): {path}")
        started = time.perf_counter()
        example = example_arguments(args, size)
        try:
            with torch.no_grad():
                program = torch.export.export(Step(self.target, layers), example,
                                              dynamic_shapes=dynamic_shapes(example, size), strict=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")  # the packager wants .pt2
            options = self.options if size.few else {**self.options, **graphs.ATEN_GEMMS}  # as ``graphs`` says
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
            os.replace(partial, path)  # whole or absent: a stopped build leaves no package behind
        except Exception as error:  # an architecture export cannot trace: this class stays eager
            say(f"the {path.stem} graph could not be compiled ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); it runs eager")
            self.failed.add(key)
            return None
        say(f"compiled {path.stem} in {time.perf_counter() - started:.0f} s")
        self.built.append(path.stem)
        return self._load(key)


def arguments(inputs: dict, dtype: torch.dtype):
    """A package's positional arguments from ``Target.forward_features``' keyword arguments, or
    None where a package cannot take them (an int32 id, a cache of another dtype or not yet
    allocated, fewer than two keys, a buffer too small or not contiguous)."""
    ids, positions, mask, cache = (inputs[name] for name in ("input_ids", "position_ids", "attention_mask",
                                                              "past_key_values"))
    layers = getattr(cache, "layers", None)
    if not layers or not all(layer.is_initialized for layer in layers) or ids.device.type != "cpu":
        return None
    keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    width, tokens = key_width(mask), ids.shape[1]
    if (ids.dtype != torch.long or positions.dtype != torch.long or any(m.dtype != torch.bool for m in masks)
            or any(t.dtype != dtype or not t.is_contiguous() for t in keys + values)
            or not tokens <= width <= keys[0].shape[2] <= BOUND or width < 2):
        return None
    # Standard strides: the kernels index with the strides the package was traced with.
    ids, positions = (t.clone(memory_format=torch.contiguous_format) for t in (ids, positions))
    mask = {k: m.contiguous() for k, m in mask.items()} if isinstance(mask, dict) else mask.contiguous()
    return ids, positions, mask, keys, values


def example_arguments(args, size: graphs.SizeClass):
    """Fresh inputs of ``args``' shapes to trace with: rows and tokens as called (autotuning
    times the GEMMs at them), keys K and capacity C distinct from them and from each other
    (export would take sizes equal in the example for sizes equal always)."""
    ids, _, mask, keys, _ = args
    batch, tokens = ids.shape
    if size.bounds.keys() == {0, 1} and batch == tokens:
        tokens += 1
    used = {batch, tokens}
    width = _unused(tokens + 7, used)
    capacity = _unused(width + 9, used | {width})
    heads, dim = keys[0].shape[1], keys[0].shape[3]
    buffer = lambda: torch.zeros(batch, heads, capacity, dim, dtype=keys[0].dtype)  # noqa: E731
    example_mask = lambda: torch.ones(batch, 1, tokens, width, dtype=torch.bool)  # noqa: E731
    masks = {k: example_mask() for k in mask} if isinstance(mask, dict) else example_mask()
    positions = torch.arange(width - tokens, width).expand(batch, tokens).contiguous()
    return (torch.zeros(batch, tokens, dtype=torch.long), positions, masks,
            [buffer() for _ in keys], [buffer() for _ in keys])


def _unused(value: int, used: set) -> int:
    while value in used:
        value += 1
    return value


def dynamic_shapes(example, size: graphs.SizeClass):
    """``torch.export``'s dynamic shapes for ``example``: the size class's rows and tokens, the
    keys K and the capacity C in [2, BOUND]. Hints (``Dim.DYNAMIC``), not named dimensions:
    export then keeps a guard it cannot prove over the whole range as a runtime check rather
    than refuse (torch 2.13 cannot simplify ``N·min(64, 192·N) == 64·N`` for N >= 2: the
    strides of the rotary products over a transposed (B, Hk, N, D) view), and finds the
    sizes equal across inputs (ids, positions, mask) itself."""
    from torch.export import Dim

    dims = {d: Dim.DYNAMIC(min=low, max=high) for d, (low, high) in size.bounds.items()}
    keys, capacity = Dim.DYNAMIC(min=2, max=BOUND), Dim.DYNAMIC(min=2, max=BOUND)
    rows = {0: dims[0]} if 0 in dims else {}
    chain = {**rows, **({1: dims[1]} if 1 in dims else {})}
    mask = {**rows, **({2: dims[1]} if 1 in dims else {}), 3: keys}
    buffer = {**rows, 2: capacity}
    _, _, masks, buffers, _ = example
    return (chain, chain, {k: mask for k in masks} if isinstance(masks, dict) else mask,
            [buffer] * len(buffers), [buffer] * len(buffers))
