"""A ready ``SpeculativeEngine`` from plain values: the target, the drafter and how it drafts.

The command line (``generate``, ``serve``, ``parity``, ``distill``) turns its options into
an ``EngineSpec``; library users may build one directly. Loading stays quiet in pipes
(``models.quiet_loading``). Heavy modules (transformers, the drafters) are imported on use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineSpec:
    """What an engine is built from. ``dtype`` 'auto' is resolved for ``device`` by
    ``load_target``; ``beam_width`` / ``beam_length`` / ``gamma`` None keep the drafter's own
    defaults; ``adaptive`` is 'on', 'off' or 'refresh' (see ``adaptive_policy``)."""

    target: str = "default"
    device: str = "cpu"
    dtype: str = "auto"
    trust_remote_code: bool = False
    drafter: str = "auto"  # registry.resolve_auto: lookup + the shipped head on the default target, else lookup
    beam_width: int | None = None
    beam_length: int | None = None
    gamma: int | None = None
    max_tree_tokens: int | str | None = "auto"  # a cap, 'auto' (the engine decides) or None (no cap)
    adaptive: str = "off"
    compile_drafter: bool = False  # torch.compile the drafter's model code, then warm_up
    compile_target: bool = False  # torch.compile the target's decoder stack, then warm_up
    tree_attention: str = "fast"  # Target.tree_attention: "fast", or "bitwise" (reduced precision: see fastpath.QUERY_CHUNK)
    # The drafter's large linears in int8 where that applies (Drafter.quantize: a float32 ReDrafter
    # head on a CPU with fbgemm; elsewhere nothing changes). Exact either way: only the drafter's weights change.
    int8_drafter: bool = True


def build_engine(spec: EngineSpec):
    """The target and drafter ``spec`` names, paired in a SpeculativeEngine."""
    from .drafters.registry import build_drafter
    from .engine import SpeculativeEngine
    from .models import load_target, quiet_loading

    with quiet_loading():
        target = load_target(spec.target, spec.device, spec.dtype, spec.trust_remote_code, spec.tree_attention)
        drafter = build_drafter(spec.drafter, target, spec.beam_width, spec.beam_length, spec.gamma)
    if spec.int8_drafter:
        drafter.quantize()  # before the engine: adaptive drafting times the drafter as it will run
    if spec.compile_target:
        # before the cost model: adaptive drafting weighs the compiled forward's cost
        compile_target(target, layers=tuple(getattr(drafter, "feature_layers", ())))
    engine = SpeculativeEngine(target, drafter, max_tree_tokens=spec.max_tree_tokens,
                               policy=adaptive_policy(target, drafter, spec.adaptive))
    if (spec.compile_drafter and drafter.compile()) or spec.compile_target:
        warm_up(engine)
    return engine


WARM_UP_PROMPT = "Count from one to thirty, in words, separated by commas."
WARM_UP_TOKENS = 24


# The calls compile_target makes after a prefill: rows, then tokens per row, one per size class
# of ``graphs`` (1 row: one, few, many tokens; 2 rows: one and two tokens; 8 rows: many rows).
COMPILE_CLASSES = ((1, (1, 2, 5)), (2, (1, 2)), (8, (1,)))


def compile_target(target, backend: str = "inductor", layers: tuple[int, ...] = ()) -> None:
    """On a CPU with inductor: ``aot.compile_packaged`` (packages on disk, built or loaded as
    ``warm_up`` meets their classes, each returning the inner ``layers`` the drafter reads).
    Otherwise ``Target.compile``, then compile the size classes (``graphs``) the engine feeds
    before anything is timed or served: a prefill into an empty cache, then after a cached
    prefix one row of 1, 2 and 5 tokens (one, few, many), two rows of 1 and 2 (few; both
    dimensions above one) and eight rows of one token (many). Shapes met later still compile
    until ``warm_up`` ends with ``Target.warmed``."""
    from .timing import prefill, time_forward

    if backend == "inductor" and target.device.type == "cpu":
        # Packages kept on disk (``aot``): each class builds once per machine, as ``warm_up``
        # meets it, and loads in seconds in later processes.
        from .aot import compile_packaged

        compile_packaged(target, layers=layers)
        return
    target.compile(backend)
    prefix = min(16, target.max_context // 4)
    for rows, sizes in COMPILE_CLASSES:
        cache = prefill(target, prefix, 2 * prefix, rows=rows)
        for n in sizes:
            time_forward(target, cache, min(n, prefix), prefix, trials=0, warmup=1)


def warm_up(engine) -> None:
    """Generate a little at batch 1 and at batch 2 (and 8 for a packaged target), so that a
    compiled drafter or target compiles the shapes serving meets (a prompt, then steps feeding
    one and several tokens; torch.compile specialises sizes 0 and 1) before the first request; after it a shape not seen yet runs
    eager (``Drafter.warmed``). The policy is detached meanwhile: compiling takes seconds
    per shape, which must not reach its estimates of drafting cost. A compiled target
    compiles again while warming, even if an earlier engine's warm-up ended: a second drafter
    on the same target (``specdraft bench``: one engine per method) may feed it new shape
    classes (a tree, the inner layers a head reads), which would otherwise run eager."""
    from .sampling import SamplingParams

    target, tok = engine.target, engine.target.tokenizer
    if target.compiled:
        target.warming()
    chat = getattr(tok, "chat_template", None) is not None
    prompt = target.encode_prompt(WARM_UP_PROMPT, chat=chat) if tok is not None else list(range(1, 33))
    room = target.max_context // 2  # a tiny test model's context may be short
    params = SamplingParams(max_new_tokens=min(WARM_UP_TOKENS, room // 2))
    # A packaged target (``aot``) also builds the class of many one-token rows here, which
    # ``compile_target`` compiles up front for torch.compile (a batch of plain steps past FEW_ROWS).
    batches = (1, 2, 8) if getattr(target, "packaged", None) is not None else (1, 2)
    policy, engine.policy = engine.policy, None
    try:
        for batch in batches:
            for ids in (prompt[-8:], (prompt * 8)[: min(96, room)]):  # a short and a long first feed
                engine.generate([ids] * batch, params)
    finally:
        engine.policy = policy
    engine.drafter.warmed()
    target.warmed()


def adaptive_policy(target, drafter, mode: str):
    """--adaptive on|refresh: a policy over the target's cached cost model (measured here on
    first use, a few seconds); off, or a drafter that never drafts: None (fixed shapes)."""
    from .adaptive import AdaptivePolicy
    from .costmodel import load_cost_model

    if mode == "off" or drafter.acceptance_prior <= 0:
        return None
    return AdaptivePolicy(load_cost_model(target, refresh=mode == "refresh"))
