"""Saving and loading drafter heads (ReDrafter and Medusa) as checkpoint folders.

A folder holds config.json (``HeadConfig.to_dict``: kind, shapes, beam defaults, target
signature) and model.safetensors (the head's own parameters only; the target's
embeddings and LM head are never copied in). Every way loading can fail is a one-line
``SpecdraftError``: missing folder, no/corrupt config, another kind of checkpoint, no or
corrupt safetensors weights, a different target (vocabulary or hidden size), or weights
that do not fit the config.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import check_target, load_weights, read_config, save_checkpoint
from ..errors import SpecdraftError
from .config import HeadConfig
from .parts import TargetParts


def save_head(head: torch.nn.Module, folder: str | Path) -> Path:
    """Write ``head`` (a ReDrafterHead or MedusaHeads) to ``folder``; returns the folder."""
    save_checkpoint(folder, head.config.to_dict(), head.state_dict())
    return Path(folder)


class SavedHead:
    """``load`` / ``save`` of a head class whose ``CONFIG`` names its config class (a mixin:
    ReDrafterHead and MedusaHeads load and save the same way)."""

    CONFIG: type[HeadConfig]

    @classmethod
    def load(cls, folder, target):
        """Load a checkpoint folder for ``target`` (eval mode, frozen, on its device);
        every failure is a one-line SpecdraftError."""
        return load_head(folder, target, cls, cls.CONFIG)

    def save(self, folder) -> Path:
        """Write config.json + model.safetensors to ``folder`` (own parameters only)."""
        return save_head(self, folder)


def read_head_config(folder: str | Path, config_class: type[HeadConfig]) -> HeadConfig:
    """The folder's config, parsed as ``config_class`` (refusing other kinds)."""
    return config_class.from_dict(read_config(folder), folder)


def check_compatible(config: HeadConfig, target, folder: str | Path) -> None:
    """Refuse a head made for a target of another vocabulary or hidden size."""
    check_target(config.target, target, folder)
    for key, mine, theirs in (("vocab_size", config.vocab_size, int(target.vocab_size)),
                              ("hidden_size", config.hidden_size, int(target.hidden_size))):
        if mine != theirs:
            raise SpecdraftError(f"drafter {folder} has {key}={mine}, but the target {target.name} "
                                 f"has {key}={theirs}")
    deepest = max(getattr(config, "feature_layers", None) or [-1])
    if deepest >= target.num_layers:
        raise SpecdraftError(f"drafter {folder} reads the target's layer {deepest}, but {target.name} has "
                             f"{target.num_layers} layers")


def load_head(folder: str | Path, target, head_class, config_class: type[HeadConfig]):
    """Load a head of ``head_class`` for ``target``, on the target's device, in eval mode,
    computing in the target's dtype whatever dtype the file holds: a bfloat16 checkpoint
    (what ``fit`` ships) beside a float32 target runs in float32, since on a CPU without
    native bfloat16 a bfloat16 head would cost ~10x more per drafted token."""
    config = read_head_config(folder, config_class)
    check_compatible(config, target, folder)
    state = load_weights(folder, device=target.device)
    with torch.device("meta"):  # the loaded tensors become the parameters: no random init
        head = head_class(config, TargetParts.of(target))
    check_state(head, state, folder)
    head.load_state_dict(state, assign=True)
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def check_state(head: torch.nn.Module, state: dict[str, torch.Tensor], folder) -> None:
    """The weights must be exactly the head's parameters, with the config's shapes."""
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")] if missing else []) \
            + ([f"unexpected {', '.join(extra[:3])}" + (" ..." if len(extra) > 3 else "")] if extra else [])
        raise SpecdraftError(f"{folder}: weights do not match its {head.config.KIND} config ({'; '.join(parts)})")
    for k, shape in expected.items():
        if found[k] != shape:
            raise SpecdraftError(f"{folder}: weight {k} has shape {list(found[k])}, the config implies {list(shape)}")
    expected_dtypes = {k: v.dtype for k, v in head.state_dict().items()}
    for k, v in state.items():
        if expected_dtypes[k].is_floating_point and not v.is_floating_point():
            raise SpecdraftError(f"{folder}: weight {k} has dtype {v.dtype}, expected a float type")
        if not expected_dtypes[k].is_floating_point and v.dtype != expected_dtypes[k]:
            raise SpecdraftError(f"{folder}: buffer {k} has dtype {v.dtype}, expected {expected_dtypes[k]}")
    vocab = {k: v for k, v in state.items() if k.startswith("draft_vocab.")}
    if vocab:
        ids = vocab["draft_vocab.d2t"] + torch.arange(vocab["draft_vocab.d2t"].shape[0], device=vocab["draft_vocab.d2t"].device)
        V = vocab["draft_vocab.t2d"].shape[0]
        if (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= V \
                or not bool(vocab["draft_vocab.t2d"][ids].all()) or int(vocab["draft_vocab.t2d"].sum()) != ids.shape[0]:
            raise SpecdraftError(f"{folder}: its draft vocabulary (draft_vocab.d2t / t2d) is inconsistent")
