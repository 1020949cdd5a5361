"""Drafter checkpoints: a folder with config.json and model.safetensors.

Weights are read with safetensors only (never pickle). The config records which target
the drafter was trained for, so that loading it against another target fails with a
clear message instead of producing garbage or a shape error deep inside torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import SpecdraftError, first_line

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def target_signature(target) -> dict:
    """What a drafter must match in its target: architecture, vocabulary, hidden size."""
    arch = (getattr(target.config, "architectures", None) or [type(target.model).__name__])[0]
    return {"architecture": arch, "vocab_size": int(target.vocab_size), "hidden_size": int(target.hidden_size),
            "name": target.name}


def check_target(saved: dict, target, path: str | Path) -> None:
    """Raise if a checkpoint's recorded target differs in vocabulary or hidden size."""
    here = target_signature(target)
    for key in ("vocab_size", "hidden_size"):
        if key in saved and int(saved[key]) != here[key]:
            raise SpecdraftError(
                f"drafter {path} was made for a target with {key}={saved[key]} "
                f"({saved.get('name', '?')}), but {here['name']} has {key}={here[key]}")


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    if not folder.exists():
        raise SpecdraftError(f"drafter checkpoint not found: {folder}")
    cfg_path = folder / CONFIG if folder.is_dir() else None
    if cfg_path is None or not cfg_path.is_file():
        raise SpecdraftError(f"{folder} is not a drafter checkpoint folder (no {CONFIG})")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecdraftError(f"{cfg_path} is corrupt: {e}") from None


def load_weights(folder: str | Path, device="cpu") -> dict[str, torch.Tensor]:
    """The folder's model.safetensors as a state dict; anything else is refused."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (found {', '.join(others)}: only safetensors weights are loaded)" if others else ""
        raise SpecdraftError(f"{folder} has no {WEIGHTS}{hint}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SpecdraftError(f"{path} is not a valid safetensors file: {first_line(e)}") from None


def save_checkpoint(folder: str | Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors (tensors made contiguous, shared storage split)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(folder / WEIGHTS))
    with open(folder / CONFIG, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
