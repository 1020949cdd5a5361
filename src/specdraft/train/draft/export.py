"""The draft as a Hugging Face folder: ``save_draft`` (config.json, model.safetensors,
generation_config.json, the tokenizer files, specdraft.json) and ``standalone_draft``
(``specdraft export hf``: a self-contained copy for transformers and vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .model import load_draft


def save_draft(draft, tokenizer, folder: Path, meta: dict, dtype: str = "float32") -> Path:
    """A Hugging Face folder: config.json, model.safetensors (in ``dtype``; the config's
    dtype says so, and loaders upcast as they like), generation_config.json, the tokenizer
    files, and ``specdraft.json`` (``meta``). With ``meta["embeddings"] == "target"`` the
    embedding matrix (borrowed from the target) is left out of the weights. ``draft`` itself
    is left unchanged."""
    import copy

    from safetensors.torch import save_file

    from ...checkpoint import WEIGHTS
    from ...drafters.draft_folder import EMBEDDING_KEYS, SPECDRAFT_FILE
    from ...models import quiet_loading

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype != "float32":
        draft = copy.deepcopy(draft).to(getattr(torch, dtype))  # a copy: the caller may keep training
    draft.config.architectures = [type(draft).__name__]
    with quiet_loading():
        if meta.get("embeddings") == "target":
            draft.config.save_pretrained(str(folder))
            draft.generation_config.save_pretrained(str(folder))
            own = {k: v.contiguous() for k, v in draft.state_dict().items() if k not in EMBEDDING_KEYS}
            save_file(own, str(folder / WEIGHTS), metadata={"format": "pt"})
        else:
            draft.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
    (folder / SPECDRAFT_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return folder


def standalone_draft(path: str | Path, out: str | Path, target) -> Path:
    """Write the draft at ``path`` to ``out`` as a self-contained Hugging Face folder in
    float32: borrowed embedding matrices written back, no draft vocabulary (transformers and
    vLLM draft over the whole vocabulary). Its outputs equal the borrowing draft's over the
    full vocabulary (tested)."""
    draft, meta = load_draft(path, target)
    meta = {**meta, "embeddings": "own", "exported_from": str(path)}
    return save_draft(draft, target.tokenizer, Path(out), meta, dtype="float32")
