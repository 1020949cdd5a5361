"""report.md and PNG plots from a results.json object (nothing here measures).

Tables: one per dataset x temperature, a row per (method, batch size). Plots
(matplotlib, Agg backend, so no display is needed): speed-up per method and dataset,
τ vs beam width (when some drafter was run at several widths), and the stage breakdown
as stacked bars of milliseconds per generated token.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecdraftError
from .metrics import STAGE_KEYS

MAX_DEPTH_COLUMNS = 4  # acceptance-by-depth columns shown in tables (all are in results.json)


# ---- formatting ---------------------------------------------------------------------------


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """A number for a table cell; '–' when missing."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def params(n) -> str:
    """A parameter count for humans: 134.5M, 6.7B, 27.6k."""
    if not n:
        return "?"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def groups(runs: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """Rows by (dataset, temperature), in measuring order."""
    out: dict[tuple[str, float], list[dict]] = {}
    for row in runs:
        out.setdefault((row["dataset"], row["temperature"]), []).append(row)
    return out


def rate_cell(row: dict) -> str:
    if row.get("status") != "ok":
        return f"unsupported: {row.get('reason', '')}"
    return (f"{row['tokens_per_second']:.1f} [{row['tokens_per_second_min']:.1f}–"
            f"{row['tokens_per_second_max']:.1f}]")


def figure_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        depth = r.get("acceptance_by_depth") or {}
        out.append([f"`{r['drafter']}`", str(r["batch_size"]), rate_cell(r), fmt(r.get("speedup_vs_ar"), ".2f", "×"),
                    fmt(r.get("speedup_vs_hf_ar"), ".2f", "×"), fmt(r.get("tokens_per_step")),
                    *[fmt(depth.get(str(k)), ".2f") for k in range(1, MAX_DEPTH_COLUMNS + 1)],
                    fmt(r.get("mbsu")), fmt(r.get("peak_memory_mb"), ".0f")])
    return out


def stage_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        frac = r.get("stage_fractions")
        if frac:
            shares = [fmt(100 * frac[k], ".0f", "%") for k in STAGE_KEYS]
            out.append([f"`{r['drafter']}`", str(r["batch_size"]), *shares])
    return out


def header_lines(results: dict) -> list[str]:
    env, s = results.get("environment", {}), results.get("settings", {})
    return [
        "# specdraft bench", "",
        f"- target: **{env.get('target')}** ({params(env.get('target_params'))} parameters), "
        f"{env.get('dtype')}{' (our methods: target compiled)' if env.get('compiled_target') else ''} on {env.get('device_name')} ({env.get('device')}, {env.get('threads')} threads)",
        f"- torch {env.get('torch')}, transformers {env.get('transformers')}, specdraft {env.get('specdraft')}"
        + (f"; linears: {env['linear_layout']}, {env.get('stacked_groups', 0)} stacked groups" if "linear_layout" in env else "")
        + (f"; tree attention: {env['tree_attention']}" if "tree_attention" in env else ""),
        f"- {s.get('max_new_tokens')} new tokens {'every row (EOS ignored)' if s.get('ignore_eos') else 'max'}, "
        f"{s.get('repeats')} repeat(s), top-p {s.get('top_p')}, "
        f"top-k {s.get('top_k')}, seed {s.get('seed')}, chat template {'on' if s.get('chat') else 'off'}",
        f"- command: `{results.get('command', '')}`", "",
        "tokens/s: median [min–max] over repeats. Speed-ups: ratio of median tokens/s to `none` "
        "(our autoregressive decoding) / `hf-ar` (transformers generate()) in the same setting of this run. "
        "τ: new tokens per target forward (prefill counted). acc≥k: share of decode steps that accepted at "
        "least k drafted tokens. MBSU: τ / (1 + γ·N_draft/N_target), draft models only. "
        "Definitions: docs/bench.md.", ""]


def markdown(results: dict) -> str:
    """The whole report.md."""
    lines = header_lines(results)
    header = ["method", "B", "tokens/s", "vs none", "vs hf-ar", "τ",
              *[f"acc≥{k}" for k in range(1, MAX_DEPTH_COLUMNS + 1)], "MBSU", "peak MB"]
    for (dataset, temperature), rows in groups(results["runs"]).items():
        turn = " (MT-Bench turn 2)" if any(r.get("mt_bench_turn") == 2 for r in rows) else ""
        n = max(r.get("prompts", 0) for r in rows)
        lines += [f"## {dataset}{turn}, temperature {temperature:g} ({n} prompts)", ""]
        lines += md_table(header, figure_rows(rows)) + [""]
        stages = stage_rows(rows)
        if stages:
            lines += ["Share of wall time per engine stage:", ""]
            lines += md_table(["method", "B", *STAGE_KEYS], stages) + [""]
    for name in ("speedup.png", "tau_vs_width.png", "stages.png"):
        lines.append(f"![{name}]({name})")
    return "\n".join(lines) + "\n"


# ---- plots --------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    try:
        import matplotlib
    except ImportError:
        raise SpecdraftError("plots need matplotlib: pip install matplotlib==3.11.2") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ok_rows(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r.get("status") == "ok"]


def short(spec: str) -> str:
    """A method's label for plots: checkpoint paths cut to their last part."""
    base, at, shape = spec.rpartition("@")
    if not at:
        base, shape = spec, ""
    kind, colon, path = base.partition(":")
    return kind + (":" + Path(path).name if colon else "") + at + shape


def plot_speedups(runs: list[dict], path: Path) -> bool:
    """Grouped bars: speed-up vs none per dataset, one bar per method (same colour in
    every panel); a panel per (temperature, batch size)."""
    rows = [r for r in ok_rows(runs) if r.get("speedup_vs_ar") is not None]
    panels = sorted({(r["temperature"], r["batch_size"]) for r in rows})
    if not panels:
        return False
    plt = pyplot()
    methods = list(dict.fromkeys(r["drafter"] for r in rows))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5, 4.2 * len(panels)), 4.2), squeeze=False)
    for ax, (t, b) in zip(axes[0], panels):
        sub = [r for r in rows if (r["temperature"], r["batch_size"]) == (t, b)]
        datasets = list(dict.fromkeys(r["dataset"] for r in sub))
        here = [m for m in methods if any(r["drafter"] == m for r in sub)]
        width = 0.8 / len(here)
        for j, m in enumerate(here):
            ys = [next((r["speedup_vs_ar"] for r in sub if r["drafter"] == m and r["dataset"] == d), 0)
                  for d in datasets]
            ax.bar([i + j * width for i in range(len(datasets))], ys, width, color=colors[m])
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
        ax.set_title(f"T={t:g}, batch {b}")
        ax.set_ylabel("speed-up vs none (×)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in methods]
    fig.legend(handles, [short(m) for m in methods], loc="lower center", ncol=min(len(methods), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return save(fig, plt, path, layout=False)


def plot_tau_vs_width(runs: list[dict], path: Path, y: str = "tokens_per_step") -> bool:
    """τ (or another figure) against beam width, one line per (drafter, beam length),
    when some drafter was measured at two or more widths."""
    lines: dict[tuple, list[tuple[int, float]]] = {}
    for r in ok_rows(runs):
        if r.get("beam_width") and r.get(y) is not None:
            base = r["drafter"].rpartition("@")[0] or r["drafter"]
            label = (base, r.get("beam_length"), r["dataset"], r["temperature"], r["batch_size"])
            lines.setdefault(label, []).append((r["beam_width"], r[y]))
    lines = {k: sorted(v) for k, v in lines.items()}
    if not any(len({w for w, _ in v}) >= 2 for v in lines.values()):
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (base, length, dataset, t, b), pts in lines.items():
        if len(pts) >= 2:
            ax.plot([w for w, _ in pts], [v for _, v in pts], marker="o",
                    label=f"{short(base)} L={length} ({dataset}, T={t:g}, B={b})")
    log2_axis(ax, [w for pts in lines.values() if len(pts) >= 2 for w, _ in pts])
    ax.set_xlabel("beam width W")
    ax.set_ylabel("τ (tokens / target forward)" if y == "tokens_per_step" else y)
    ax.legend(fontsize=7)
    return save(fig, plt, path)


def plot_stages(runs: list[dict], path: Path) -> bool:
    """Stacked bars: milliseconds per generated token spent in each engine stage."""
    rows = [r for r in ok_rows(runs) if r.get("stage_seconds") and r.get("new_tokens")]
    if not rows:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    labels = [f"{short(r['drafter'])}\n{r['dataset']} T={r['temperature']:g} B={r['batch_size']}" for r in rows]
    bottom = [0.0] * len(rows)
    for stage in STAGE_KEYS:
        # stage_seconds are per repeat; new_tokens is summed over repeats
        ms = [1000 * r["stage_seconds"].get(stage, 0.0) * r["repeats"] / r["new_tokens"] for r in rows]
        ax.bar(range(len(rows)), ms, bottom=bottom, label=stage)
        bottom = [a + b for a, b in zip(bottom, ms)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms per generated token")
    ax.legend(fontsize=7)
    return save(fig, plt, path)


def log2_axis(ax, values) -> None:
    """A log-2 x axis labelled with the plain values measured (1, 2, 4, ... not 2^k)."""
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.minorticks_off()


def save(fig, plt, path: Path, layout: bool = True) -> bool:
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(results: dict, out: Path) -> list[Path]:
    """report.md and the plots that have data; returns the files written. Plots that
    have nothing to show are removed, so a folder never holds a stale one."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (("speedup.png", plot_speedups), ("tau_vs_width.png", plot_tau_vs_width),
                       ("stages.png", plot_stages)):
        path = out / name
        if plot(results["runs"], path):
            written.append(path)
        else:
            path.unlink(missing_ok=True)
    text = markdown(results)
    for path in (out / "tau_vs_width.png", out / "stages.png", out / "speedup.png"):
        if path not in written:
            text = text.replace(f"![{path.name}]({path.name})\n", "").replace(f"![{path.name}]({path.name})", "")
    (out / "report.md").write_text(text, encoding="utf-8")
    return [out / "report.md", *written]
