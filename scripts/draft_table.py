"""The Direct Alignment paper's table from `specdraft bench` results: block efficiency τ
and MBSU per draft model (a training stage or loss) x task x γ x decoding mode.

    python scripts/draft_table.py --model pretrained=runs/tab/pre-mt-bench,runs/tab/pre-humaneval \
        --model FKL=runs/tab/fkl-mt-bench,runs/tab/fkl-humaneval ... > table.md

Each --model LABEL=DIR[,DIR...] names bench output folders (their results.json) whose
`draft:PATH@gG` rows belong to that model; every (dataset, γ, temperature) found becomes
a column pair. Cells a run did not measure are left as "–".
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from specdraft.bench.report import md_table

GAMMA = re.compile(r"^draft:.*@g(\d+)$")


def draft_rows(folders: list[str]) -> list[dict]:
    """The ok draft-model rows of the bench results in ``folders``."""
    rows = []
    for folder in folders:
        runs = json.loads((Path(folder) / "results.json").read_text())["runs"]
        rows += [r for r in runs if r.get("status") == "ok" and GAMMA.match(r["drafter"])]
    return rows


def mode(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def table(models: dict[str, list[dict]]) -> str:
    """Markdown: one row per model, columns (dataset, γ, mode) with "τ / MBSU"."""
    cells: dict[tuple, dict[str, str]] = {}
    for label, rows in models.items():
        for r in rows:
            key = (r["dataset"], int(GAMMA.match(r["drafter"]).group(1)), float(r["temperature"]))
            cells.setdefault(key, {})[label] = f"{r['block_efficiency']:.2f} / {r['mbsu']:.2f}"
    columns = sorted(cells)
    return "\n".join(md_table(["draft model", *(f"{d} γ={g} {mode(t)}" for d, g, t in columns)],
                              [[label, *(cells[c].get(label, "–") for c in columns)] for label in models]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, metavar="LABEL=DIR[,DIR...]")
    args = p.parse_args()
    models = {}
    for spec in args.model:
        label, _, dirs = spec.partition("=")
        models[label] = draft_rows(dirs.split(","))
    print("τ / MBSU (τ = new tokens per target forward; MBSU = τ / (1 + γ N_draft / N_target))\n")
    print(table(models))


if __name__ == "__main__":
    main()
