"""Build a drafter from its command-line spec: auto | none | lookup | redrafter:PATH | medusa:PATH |
draft:PATH | retrieval:PATH, or several joined by '+' (e.g. lookup+redrafter:PATH: the union of their candidates)."""

from __future__ import annotations

from ..errors import SpecdraftError
from .autoregressive import NoDrafter
from .base import Drafter, check_shapes  # check_shapes re-exported: the CLI checks shapes here
from .lookup import LookupDrafter

KINDS = ("auto", "none", "lookup", "redrafter:PATH", "medusa:PATH", "draft:PATH", "retrieval:PATH", "A+B (e.g. lookup+redrafter:PATH)")


SHIPPED_KINDS = ("redrafter", "medusa", "draft", "retrieval")
# transformers' assisted generation with our draft model: hf-assisted:default is draft:default.
SHIPPED_ALIASES = {"hf-assisted": "draft"}


# What 'auto' is for the default target: its shipped head and prompt lookup, verified as one
# tree. Measured (MT-Bench 16 x 128, bfloat16, batch 1, 2-core EPYC, one interleaved run): plain
# decoding 28.8 tokens/s, lookup 35.7 (tau 1.35), the head 37.2 (tau 1.52), both 44.2 (tau 1.88):
# lookup is right where the text repeats, the head elsewhere.
AUTO_DEFAULT_TARGET = "lookup+redrafter:default"


def resolve_auto(target) -> str:
    """The spec ``auto`` stands for on ``target``: lookup with the shipped ReDrafter head on
    the default target (the head is trained for it alone), prompt lookup on any other."""
    from ..models import DEFAULT_TARGET

    return AUTO_DEFAULT_TARGET if target.name == DEFAULT_TARGET else "lookup"


def combined_parts(spec: str) -> list[str]:
    """'lookup+redrafter:P' -> ['lookup', 'redrafter:P']: distinct parts, none of them 'none'."""
    parts = [p.strip() for p in spec.split("+")]
    if any(p in ("", "none") for p in parts) or len(set(parts)) != len(parts):
        raise SpecdraftError(f"a combined drafter joins distinct drafters other than none, got {spec!r}")
    return parts


def untrained(part: str) -> bool:
    """Whether a combined spec's part keeps its own shape (the shapes given are the trained parts')."""
    return part == "lookup" or part.startswith("retrieval:")


def checkpoint_path(kind: str, path: str) -> str:
    """The checkpoint folder a spec names: 'default' is the drafter shipped for the default
    target (a one-line error when none of that kind is shipped); any other path as given."""
    kind = SHIPPED_ALIASES.get(kind, kind)
    if path == "default" and kind in SHIPPED_KINDS:
        from ..assets import shipped

        return str(shipped(kind))
    return path


def build_drafter(spec: str, target, beam_width: int | None = None, beam_length: int | None = None,
                  gamma: int | None = None) -> Drafter:
    """A drafter for ``target``. Unset shapes take the drafter's own defaults. In a
    combined spec (A+B) the shapes apply to the trained parts; lookup keeps its own."""
    check_shapes(beam_width, beam_length, gamma)
    if spec == "auto":
        spec = resolve_auto(target)
    if "+" in spec:
        from .combined import CombinedDrafter

        return CombinedDrafter([build_drafter(p, target) if untrained(p) else
                                build_drafter(p, target, beam_width, beam_length, gamma) for p in combined_parts(spec)])
    kind, _, path = spec.partition(":")
    path = checkpoint_path(kind, path)
    if kind == "none" and not path:
        return NoDrafter()
    if kind == "lookup" and not path:
        width, length = LookupDrafter.default_shape()
        return LookupDrafter(beam_width=beam_width or width, beam_length=beam_length or length)
    if kind == "draft" and path:
        from .draft_model import DraftModelDrafter

        return DraftModelDrafter.load(path, target, gamma=gamma if gamma is not None else (beam_length - 1 if beam_length and beam_length > 1 else None),
                                      beam_width=beam_width)
    if kind == "redrafter" and path:
        from .redrafter import ReDrafter

        return ReDrafter.load(path, target, beam_width=beam_width, beam_length=beam_length)
    if kind == "medusa" and path:
        from .medusa import MedusaDrafter

        return MedusaDrafter.load(path, target, beam_width=beam_width, beam_length=beam_length)
    if kind == "retrieval" and path:
        from .retrieval import RetrievalDrafter

        return RetrievalDrafter.load(path, target, beam_width=beam_width, beam_length=beam_length)
    raise SpecdraftError(f"unknown drafter {spec!r}; choose one of: {', '.join(KINDS)}")
