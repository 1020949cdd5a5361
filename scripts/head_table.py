"""A comparison table of drafter heads from one `specdraft bench` run: τ and speed-up per
head x beam shape, e.g. ReDrafter vs Medusa, own vs shared output layer, distilled vs not.

    python scripts/head_table.py runs/cmp \
        --head "ReDrafter, shared, distilled=redrafter:runs/shared-distill" \
        --head "Medusa, shared, distilled=medusa:runs/medusa-distill" > table.md

Each --head LABEL=SPEC names the bench rows `SPEC@WxL` of that head; every shape found
becomes a column with "τ / speed-up vs our AR" (both from the same run). Shapes a head was
not measured at are left as "–".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft.bench.report import md_table


def shape_of(row: dict) -> tuple[int, int]:
    return int(row["beam_width"]), int(row["beam_length"])


def head_rows(runs: list[dict], spec: str) -> list[dict]:
    """The ok rows of ``spec`` (with or without an @WxL suffix)."""
    return [r for r in runs if r.get("status") == "ok" and (r["drafter"].rpartition("@")[0] or r["drafter"]) == spec]


def table(heads: dict[str, list[dict]]) -> str:
    """Markdown: one row per head, one "τ / speed-up" column per (W, L)."""
    cells: dict[tuple[int, int], dict[str, str]] = {}
    for label, rows in heads.items():
        for r in rows:
            speedup = "–" if r.get("speedup_vs_ar") is None else f"{r['speedup_vs_ar']:.2f}×"
            cells.setdefault(shape_of(r), {})[label] = f"{r['tokens_per_step']:.2f} / {speedup}"
    columns = sorted(cells)
    return "\n".join(md_table(["head", *(f"W={w} L={l}" for w, l in columns)],
                              [[label, *(cells[c].get(label, "–") for c in columns)] for label in heads]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", metavar="DIR", help="bench output folders (their results.json)")
    p.add_argument("--head", action="append", required=True, metavar="LABEL=SPEC")
    args = p.parse_args()
    runs = [r for folder in args.results for r in json.loads((Path(folder) / "results.json").read_text())["runs"]]
    heads = {}
    for item in args.head:
        label, _, spec = item.rpartition("=")
        heads[label] = head_rows(runs, spec)
    print("τ / speed-up (τ = new tokens per target forward; speed-up vs our autoregressive decoding, same run)\n")
    print(table(heads))


if __name__ == "__main__":
    main()
