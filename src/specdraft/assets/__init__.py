"""Drafters shipped with specdraft for the embedded default target (SmolLM2-135M-Instruct).

``redrafter:default`` (and ``medusa:default`` / ``draft:default`` where shipped) resolve
to the folders here; each holds a config.json and safetensors weights exactly as the
training commands write them, with the command line that produced them recorded in the
config ("training"). See the README's Results section for how they were trained.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecdraftError

ROOT = Path(__file__).parent / "smollm2-135m-instruct"


def shipped(kind: str) -> Path:
    """The folder of the shipped ``kind`` drafter ("redrafter", "medusa", "draft")."""
    folder = ROOT / kind
    if not (folder / "config.json").is_file():
        have = sorted(p.name for p in ROOT.iterdir() if (p / "config.json").is_file()) if ROOT.is_dir() else []
        raise SpecdraftError(f"no {kind} drafter is shipped for the default target "
                             f"(shipped: {', '.join(have) or 'none'}); give a checkpoint folder: {kind}:PATH")
    return folder
