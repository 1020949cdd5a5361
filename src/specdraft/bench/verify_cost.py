"""``specdraft bench --verify-cost``: what one target forward costs against the number of
tree tokens it verifies (the measurement itself: ``specdraft.timing``), written as
verify_cost.json, a table and a plot.

The target may be a real model or one built from a config with random weights
(``llama-1b``, ``llama-7b``, or a config.json): timing does not depend on the weights.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecdraftError
from ..models import Target, parse_device, parse_dtype
from ..timing import measure_verify_cost

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Shapes of public models (their configs), so their cost can be measured without weights.
RANDOM_PRESETS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                     tie_word_embeddings=True),  # Llama 3.2 1B
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                     tie_word_embeddings=False),  # Llama 2 7B
}


def random_target(spec: str, device: str, dtype: str) -> Target:
    """A target with random weights from a preset name or a config.json path."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if spec in RANDOM_PRESETS:
        config = LlamaConfig(**RANDOM_PRESETS[spec])
    else:
        path = Path(spec).expanduser()
        folder = path.parent if path.name.endswith(".json") else path
        if not (folder / "config.json").is_file():
            raise SpecdraftError(f"--random-target: choose {', '.join(RANDOM_PRESETS)} or a config.json path "
                                 f"(not found: {spec})")
        config = AutoConfig.from_pretrained(str(folder))
    dev, dt = parse_device(device), parse_dtype(dtype)
    with dev:  # allocate and initialise directly on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dt, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name=f"random {spec}")


MONOTONE_TOLERANCE = 0.02  # timing noise: 2-token forwards run 1-token ones' very kernels (fastpath)


def monotone_violations(rows: list[dict], tolerance: float = MONOTONE_TOLERANCE) -> list[dict]:
    """Rows with N >= 2 tree tokens measured cheaper than N = 1 (``ms_median``) by more than
    ``tolerance`` (a fraction). A healthy curve has none: a multi-token forward cheaper than
    a one-token one means plain decoding runs a slower kernel than verification does, and
    every speed-up over it is inflated."""
    one = next((r["ms_median"] for r in rows if r["tree_tokens"] == 1), None)
    if one is None:
        return []
    return [r for r in rows if r["tree_tokens"] >= 2 and r["ms_median"] < (1 - tolerance) * one]


def verify_cost_markdown(result: dict) -> str:
    from .report import params

    env = result["environment"]
    lines = ["# Verify cost: one target forward vs tree tokens", "",
             f"- target: **{env['target']}** ({params(env['target_params'])} parameters), {env['dtype']}"
             f"{' (compiled)' if env.get('compiled_target') else ''} on "
             f"{env['device_name']} ({env['device']}, {env['threads']} threads)",
             f"- {result['prefix']} tokens already cached; each figure: median [min–max] of "
             f"{result['rows'][0]['trials']} trials, forward + logits", f"- command: `{result.get('command', '')}`", "",
             "| tree tokens N | ms | ms [min–max] | × cost of N=1 | ms per token |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        rel = "–" if r["relative_to_one_token"] is None else f"{r['relative_to_one_token']:.2f}×"
        lines.append(f"| {r['tree_tokens']} | {r['ms_median']:.2f} | {r['ms_min']:.2f}–{r['ms_max']:.2f} | {rel} "
                     f"| {r['ms_per_token']:.3f} |")
    below = [str(r["tree_tokens"]) for r in monotone_violations(result["rows"])]
    tol = f"{100 * MONOTONE_TOLERANCE:.0f}%"
    lines += ["", f"**Not monotone**: N = {', '.join(below)} measured more than {tol} cheaper than N = 1." if below
              else f"Monotone: no N ≥ 2 measured more than {tol} (timing noise) cheaper than N = 1."]
    return "\n".join(lines + ["", "![verify_cost.png](verify_cost.png)", ""])


def plot_verify_cost(result: dict, path: Path) -> None:
    from .report import log2_axis, pyplot, save

    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["tree_tokens"] for r in rows]
    ax.plot(ns, [r["ms_median"] for r in rows], marker="o")
    ax.fill_between(ns, [r["ms_min"] for r in rows], [r["ms_max"] for r in rows], alpha=0.2)
    log2_axis(ax, ns)
    ax.set_xlabel("tree tokens verified in one forward (N)")
    ax.set_ylabel("ms per target forward")
    ax.set_title(f"{result['environment']['target']}, {result['prefix']} cached tokens", fontsize=9)
    save(fig, plt, path)


def run_verify_cost(cfg, tokens: list[int], prefix: int, trials: int, random_spec: str | None = None,
                    target=None) -> dict:
    """Measure and write verify_cost.json, verify_cost.md and verify_cost.png to cfg.out."""
    from ..models import load_target, quiet_loading
    from .runner import environment
    from .store import write_json_atomic

    out = Path(cfg.out)
    if target is None:
        with quiet_loading():
            target = (random_target(random_spec, cfg.device, cfg.resolved_dtype()) if random_spec else
                      load_target(cfg.target, cfg.device, cfg.resolved_dtype(), cfg.trust_remote_code,
                                  getattr(cfg, "tree_attention", "fast")))
    if getattr(cfg, "compile_target", False) and not target.compiled:
        from ..build import compile_target

        compile_target(target)  # untimed; each N's own warm-up forwards cover what is left
    rows = measure_verify_cost(target, tokens, prefix, trials, progress=cfg.progress)
    result = {"environment": environment(target, cfg), "command": cfg.command, "prefix": prefix, "rows": rows}
    write_json_atomic(out / "verify_cost.json", result)
    (out / "verify_cost.md").write_text(verify_cost_markdown(result), encoding="utf-8")
    plot_verify_cost(result, out / "verify_cost.png")
    return result
