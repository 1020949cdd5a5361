"""Method specs of ``specdraft bench``: ``KIND[:PATH][@SHAPE]`` checked before anything is
measured, and built into a Method: our drafter through the engine (``methods``) or a
transformers peer (``peers``). Its own module so that neither of those imports the other."""

from __future__ import annotations

import re
from pathlib import Path

from ..drafters.registry import build_drafter, checkpoint_path, combined_parts
from ..errors import SpecdraftError
from .methods import EngineMethod, Method
from .peers import build_peer

PEER_KINDS = ("hf-ar", "hf-assisted", "hf-lookup")
WITH_PATH = ("redrafter", "medusa", "draft", "retrieval", "hf-assisted")
WITHOUT_PATH = ("none", "auto", "lookup", "hf-ar", "hf-lookup")


def split_shape(spec: str) -> tuple[str, dict]:
    """'lookup@4x6' -> ('lookup', {beam_width: 4, beam_length: 6}); 'draft:P@g5' ->
    ('draft:P', {gamma: 5}); 'lookup@1x3/fixed' -> ('lookup', {..., adaptive: False});
    'lookup@adaptive' -> ('lookup', {adaptive: True}); 'draft:P@g1/compiled' -> ('draft:P',
    {gamma: 1, compiled: True}); 'redrafter:P@no-int8' -> ('redrafter:P', {int8: False})
    ('@int8': {int8: True}, the default anyway); no suffix -> (spec, {}). The suffix lets one
    run compare shapes of the same drafter, the adaptive policy against fixed shapes, and a
    compiled or float32 drafter against its usual self (each spec is its own row; without
    fixed/adaptive a row follows --adaptive)."""
    base, at, suffix = spec.rpartition("@")
    if not at:
        return spec, {}
    shape: dict = {}
    for item in suffix.split("/"):
        flag = {"compiled": ("compiled", True), "int8": ("int8", True), "no-int8": ("int8", False)}.get(item)
        if flag and flag[0] not in shape:
            shape[flag[0]] = flag[1]
            continue
        m = re.fullmatch(r"(\d+)x(\d+)|g(\d+)|(fixed|adaptive)", item)
        shaped = len(shape) - sum(flag in shape for flag in ("adaptive", "compiled", "int8"))
        if not m or (m.group(4) and "adaptive" in shape) or (not m.group(4) and shaped):
            raise SpecdraftError(f"bad suffix in {spec!r}: use @WxL (beam width x length) or @gG (gamma), "
                                 "optionally with /fixed or /adaptive, /compiled and /int8 or /no-int8 "
                                 "(or one of them alone)")
        if m.group(4):
            shape["adaptive"] = m.group(4) == "adaptive"
        elif m.group(3):
            shape["gamma"] = int(m.group(3))
        else:
            shape.update(beam_width=int(m.group(1)), beam_length=int(m.group(2)))
    return base, shape


def check_spec(spec: str) -> None:
    """Fail on an unknown method name or a missing checkpoint folder before anything is
    measured, rather than after an hour of other rows."""
    base, _ = split_shape(spec)
    if "+" in base:  # a combined drafter: every part must be one of ours
        for part in combined_parts(base):
            if part.partition(":")[0] in PEER_KINDS:
                raise SpecdraftError(f"{spec}: only our drafters combine, not {part!r}")
            check_spec(part)
        return
    kind, colon, path = base.partition(":")
    if kind in WITHOUT_PATH and not colon:
        return
    path = checkpoint_path(kind, path)
    if kind in WITH_PATH and path:
        if not Path(path).expanduser().exists():
            raise SpecdraftError(f"{spec}: checkpoint folder not found: {path}")
        return
    raise SpecdraftError(f"unknown method {spec!r}; choose from none, auto, lookup, redrafter:PATH, medusa:PATH, "
                         "draft:PATH, retrieval:PATH, hf-ar, hf-assisted:PATH, hf-lookup")


def feature_layers(specs: list[str], target) -> tuple[int, ...]:
    """The target's inner layers the drafters of ``specs`` read, together, sorted (what a
    packaged target's packages return, so that every method of a run shares one set:
    ``aot.PackagedStep.route``). Peers read none."""
    layers: set[int] = set()
    for spec in specs:
        base, _ = split_shape(spec)
        if base.partition(":")[0] not in PEER_KINDS:
            layers |= set(getattr(build_drafter(base, target), "feature_layers", ()))
    return tuple(sorted(layers))


def build_method(spec: str, target, beam_width=None, beam_length=None, gamma=None, policy=None) -> Method:
    """Our drafter through the engine, or a transformers peer (``hf-*``). A shape suffix
    (``@WxL``, ``@gG``) overrides the run-wide shape options for this method."""
    base, shape = split_shape(spec)
    beam_width = shape.get("beam_width", beam_width)
    beam_length = shape.get("beam_length", beam_length)
    gamma = shape.get("gamma", gamma)
    if base.partition(":")[0] in PEER_KINDS:
        method = build_peer(base, target, beam_length=beam_length, gamma=gamma)
    else:
        method = EngineMethod(base, target, beam_width, beam_length, gamma, policy, shape.get("compiled", False),
                              shape.get("int8", True))  # as the engine runs it unless the row says /no-int8
    method.spec = spec
    return method
