"""``specdraft sweep``: find the fastest drafting shape on this machine and record it.

Every shape (beam width W x beam length L, or W x γ for a draft model, where L = γ + 1)
is one bench row (``DRAFTER@WxL/fixed``) measured next to ``none`` on the same prompts. The
shape with the highest median tokens/s is written where the drafter reads its defaults:

- ``redrafter:PATH`` / ``medusa:PATH``: ``beam_width`` and ``beam_length`` in PATH/config.json
- ``draft:PATH``: ``gamma`` and ``beam_width`` in PATH/config.json
- ``lookup``: ``beam_width`` and ``beam_length`` in ``specdraft.models.cache_dir()/lookup.json``

Each file also gets ``specdraft_sweep``: where and how the choice was measured. Explicit
--beam-width / --beam-length / --gamma still override a recorded shape. The recorded shape
is the fastest at the smallest batch size measured.

The same run also measures adaptive drafting (``DRAFTER@adaptive``: the drafter's default
shape as the cap, each step as deep as pays) and reports it against the best of plain
decoding and every fixed shape, per dataset and batch size (issue 15's check).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from ..errors import SpecdraftError
from ..models import cache_dir
from .runner import AR, BenchConfig, run_bench
from .store import write_json_atomic

SHAPED_KINDS = ("lookup", "redrafter", "medusa", "draft")


def sweep_specs(drafter: str, widths: list[int], lengths: list[int] | None, gammas: list[int] | None) -> list[str]:
    """The bench specs of every shape: DRAFTER@WxL/fixed (L = γ + 1 for a draft model)."""
    kind = drafter.partition(":")[0]
    if kind not in SHAPED_KINDS or "@" in drafter:
        raise SpecdraftError(f"sweep needs lookup, redrafter:PATH, medusa:PATH or draft:PATH, got {drafter!r}")
    if gammas and kind != "draft":
        raise SpecdraftError("--gammas applies to draft:PATH only; use --lengths for beam drafters")
    if gammas and lengths:
        raise SpecdraftError("give --lengths or --gammas, not both (L = γ + 1)")
    lengths = [g + 1 for g in gammas] if gammas else lengths
    if not widths or not lengths or min(widths) < 1 or min(lengths) < 2:
        raise SpecdraftError("sweep needs widths >= 1 and lengths >= 2 (gammas >= 1)")
    return [f"{drafter}@{w}x{l}/fixed" for w in widths for l in lengths]


def adaptive_spec(drafter: str) -> str:
    return f"{drafter}@adaptive"


def shape_rows(runs: list[dict]) -> list[dict]:
    """The measured fixed-shape rows (not ``none``, not the adaptive row)."""
    return [r for r in runs if r["drafter"] != AR and not r.get("adaptive") and r.get("status") == "ok"]


def best_row(runs: list[dict]) -> dict:
    """The fixed-shape row with the highest median tokens/s at the smallest batch size."""
    rows = shape_rows(runs)
    if not rows:
        raise SpecdraftError("the sweep measured no shape")
    smallest = min(r["batch_size"] for r in rows)
    return max((r for r in rows if r["batch_size"] == smallest), key=lambda r: r["tokens_per_second"])


def off_share(row: dict) -> float | None:
    """Share of a row's decode steps that ran with drafting off."""
    d = row.get("drafting") or {}
    return d["off_steps"] / d["decode_steps"] if d.get("decode_steps") else None


def adaptive_comparison(runs: list[dict]) -> list[dict]:
    """Per (dataset, temperature, batch size): plain decoding, the best fixed shape and the
    adaptive row, and adaptive's ratio to the better of the first two."""
    out = []
    ok = [r for r in runs if r.get("status") == "ok"]
    for key in sorted({(r["dataset"], r["temperature"], r["batch_size"]) for r in ok}):
        same = [r for r in ok if (r["dataset"], r["temperature"], r["batch_size"]) == key]
        none = next((r for r in same if r["drafter"] == AR), None)
        fixed = shape_rows(same)
        adaptive = next((r for r in same if r.get("adaptive") and r["drafter"] != AR), None)
        if none is None or adaptive is None:
            continue
        best = max(fixed, key=lambda r: r["tokens_per_second"], default=None)
        reference = max([none, *([best] if best else [])], key=lambda r: r["tokens_per_second"])
        out.append({"dataset": key[0], "temperature": key[1], "batch_size": key[2],
                    "none": none["tokens_per_second"], "best_fixed": best and best["drafter"],
                    "best_fixed_tokens_per_second": best and best["tokens_per_second"],
                    "adaptive": adaptive["tokens_per_second"], "adaptive_tau": adaptive.get("tokens_per_step"),
                    "adaptive_off_share": off_share(adaptive),
                    "ratio": adaptive["tokens_per_second"] / reference["tokens_per_second"]})
    return out


def record_path(drafter: str) -> Path:
    """The file where a drafter's defaults are recorded."""
    from ..drafters.registry import checkpoint_path

    kind, _, path = drafter.partition(":")
    if kind == "lookup":
        return cache_dir() / "lookup.json"
    return Path(checkpoint_path(kind, path)).expanduser() / "config.json"  # 'default': the shipped folder


def record_best(drafter: str, best: dict, environment: dict) -> Path:
    """Write the best shape into the drafter's config (atomically); return the file."""
    path = record_path(drafter)
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecdraftError(f"{path} is corrupt ({e}); not recording the sweep's shape") from None
    if drafter.startswith("draft:"):
        config.update(gamma=best["beam_length"] - 1, beam_width=best["beam_width"])
    else:
        config.update(beam_width=best["beam_width"], beam_length=best["beam_length"])
    config["specdraft_sweep"] = {
        "device_name": environment.get("device_name"), "device": environment.get("device"),
        "dtype": environment.get("dtype"), "target": environment.get("target"), "dataset": best["dataset"],
        "temperature": best["temperature"], "batch_size": best["batch_size"],
        "tokens_per_second": best["tokens_per_second"], "speedup_vs_ar": best.get("speedup_vs_ar"),
        "tokens_per_step": best.get("tokens_per_step"), "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(path, config)
    return path


def sweep_markdown(drafter: str, results: dict, best: dict, recorded: Path | None) -> str:
    rows = shape_rows(results["runs"])
    is_draft = drafter.startswith("draft:")
    env = results["environment"]
    lines = [f"# Sweep of `{drafter}`", "",
             f"- {env['target']}, {env['dtype']} on {env['device_name']} ({env['device']})",
             f"- best: W={best['beam_width']}, " + (f"γ={best['beam_length'] - 1}" if is_draft
                                                  else f"L={best['beam_length']}") +
             f" at {best['tokens_per_second']:.1f} tokens/s",
             f"- recorded in `{recorded}`" if recorded else "- not recorded (--no-record)", "",
             "| W | " + ("γ" if is_draft else "L") + " | dataset | tokens/s | vs none | τ |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["batch_size"], r["beam_width"] or 0, r["beam_length"] or 0)):
        shape = r["beam_length"] - 1 if is_draft else r["beam_length"]
        sp = "–" if r.get("speedup_vs_ar") is None else f"{r['speedup_vs_ar']:.2f}×"
        tau = "–" if r.get("tokens_per_step") is None else f"{r['tokens_per_step']:.2f}"
        lines.append(f"| {r['beam_width']} | {shape} | {r['dataset']} B={r['batch_size']} | "
                     f"{r['tokens_per_second']:.1f} | {sp} | {tau} |")
    lines += ["", "![sweep.png](sweep.png)", ""]
    compared = adaptive_comparison(results["runs"])
    if compared:
        lines += [f"## Adaptive drafting (`{adaptive_spec(drafter)}`) against plain decoding and every fixed shape",
                  "", "| dataset | T | B | none tokens/s | best fixed | its tokens/s | adaptive tokens/s | adaptive τ | "
                      "steps off | adaptive / best |", "|---|---|---|---|---|---|---|---|---|---|"]
        for c in compared:
            fixed = "–" if c["best_fixed"] is None else f"`{c['best_fixed']}`"
            fixed_speed = "–" if c["best_fixed"] is None else f"{c['best_fixed_tokens_per_second']:.1f}"
            tau = "–" if c["adaptive_tau"] is None else f"{c['adaptive_tau']:.2f}"
            off = "–" if c["adaptive_off_share"] is None else f"{100 * c['adaptive_off_share']:.0f}%"
            lines.append(f"| {c['dataset']} | {c['temperature']:g} | {c['batch_size']} | {c['none']:.1f} | {fixed} | "
                         f"{fixed_speed} | {c['adaptive']:.1f} | {tau} | {off} | {c['ratio']:.2f}× |")
        lines.append("")
    return "\n".join(lines)


def plot_sweep(results: dict, path: Path) -> None:
    """tokens/s and τ against beam width, one line per length."""
    from .report import log2_axis, pyplot, save

    rows = [r for r in shape_rows(results["runs"]) if r["batch_size"] == min(x["batch_size"] for x in results["runs"])]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for length in sorted({r["beam_length"] for r in rows}):
        pts = sorted((r["beam_width"], r["tokens_per_second"], r["tokens_per_step"]) for r in rows
                     if r["beam_length"] == length)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"L={length}")
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"L={length}")
    ar = next((r for r in results["runs"] if r["drafter"] == AR and r.get("status") == "ok"), None)
    if ar:
        axes[0].axhline(ar["tokens_per_second"], color="gray", ls="--", lw=0.8, label="none")
    for ax, ylabel in zip(axes, ("tokens/s (median)", "τ (tokens / target forward)")):
        log2_axis(ax, [r["beam_width"] for r in rows])
        ax.set_xlabel("beam width W")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    save(fig, plt, path)


def run_sweep(cfg: BenchConfig, drafter: str, widths: list[int], lengths: list[int] | None,
              gammas: list[int] | None, record: bool = True, target=None, adaptive: bool = True) -> dict:
    """Measure every shape (and, if ``adaptive``, the adaptive policy), write sweep.md /
    sweep.png (and the bench report), record the best fixed shape."""
    specs = sweep_specs(drafter, widths, lengths, gammas)
    # Fixed shapes are what a sweep compares (their specs say /fixed: adaptive drafting would
    # blur them); cfg.adaptive still decides whether the cost model is re-measured.
    results = run_bench(replace(cfg, drafters=[AR, *specs, *([adaptive_spec(drafter)] if adaptive else [])]), target)
    best = best_row(results["runs"])
    recorded = record_best(drafter, best, results["environment"]) if record else None
    out = Path(cfg.out)
    (out / "sweep.md").write_text(sweep_markdown(drafter, results, best, recorded), encoding="utf-8")
    plot_sweep(results, out / "sweep.png")
    results["adaptive"] = adaptive_comparison(results["runs"])
    results["best"] = {"beam_width": best["beam_width"], "beam_length": best["beam_length"],
                       "recorded_in": str(recorded) if recorded else None}
    write_json_atomic(out / "sweep.json", {**results["best"], "adaptive": results["adaptive"]})
    return results
