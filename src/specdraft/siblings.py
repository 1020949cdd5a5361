"""Sibling linears as one product: the linears of one module that read the same input (a
Llama attention's q/k/v projections, its MLP's gate and up) run as one matrix product of
their weights stacked, wherever ``fastpath`` runs its layout for them.

Why: on CPU a few-row product pays a fixed cost per call. oneDNN's packed bfloat16 product
takes ~14 us for any weight up to ~1 MB on the AVX512-BF16 EPYC (192 x 576: 14 us; the
stacked q/k/v, 960 x 576: 21 us against 3 calls), and one SmolLM2 decode step makes 211
linear calls; stacked q/k/v and gate/up make it 121. Measured there, the 30 layers' linears
of one row: 7.2-7.7 ms separate, 5.9 ms stacked (docs/engine.md, "Sibling linears").

Which linears are siblings is observed, not named (no per-family code): ``find_siblings``
runs one small forward with hooks and groups the linears of one parent module that received
the very same input tensor, in call order. At run time the first member called computes the
group's product and keeps the others' outputs for that very input (the same tensor object at
the same version); a member called with another input, outside ``fastpath.active()``, above
the layout's row limit or with grads, computes alone exactly as it did before. A group is
stacked only where its product is bitwise the members' own at every probed row count
(``fastpath.PROBE_ROWS`` up to the layout's limit), so stacking changes speed, never values.

Worked example (SmolLM2, one row, bfloat16): ``q_proj(x)`` finds no kept output for ``x``,
computes ``x @ [Wq; Wk; Wv].T`` (1, 960) once with the group's packed copy, returns columns
0-575 and keeps 576-767 for ``k_proj`` and 768-959 for ``v_proj``; ``k_proj(x)`` and
``v_proj(x)`` then return those without a product.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import fastpath

# Layouts whose product is stacked. The packed one needs no second plain copy (the stack is
# packed from a temporary); the transposed one would need the stacked plain weight, a copy of
# every member (see docs/engine.md, "Sibling linears", for why float32 is not stacked).
STACKED_LAYOUTS = (fastpath.PACKED,)


class SiblingGroup:
    """Linears of one parent that read one input. ``sizes``: their output widths, in order."""

    def __init__(self, members: list[torch.nn.Linear], sizes: list[int] | None = None):
        self.members = members
        self.sizes = sizes or [m.out_features for m in members]
        self.stamp = None  # [(weight, version)] of the members when the packed copy was made
        self.packed = None
        self.stacked_bias, self.bias_stamp = None, []
        self.input = None  # the input whose outputs are kept, at ``version``
        self.version = -1
        self.kept: dict[torch.nn.Linear, torch.Tensor] = {}  # member -> its output for ``input``

    def __getstate__(self) -> dict:
        # Copies of the model carry the group without what it made or holds: the
        # packed copy (an opaque oneDNN tensor cannot be copied) and the kept outputs.
        return {"members": self.members, "sizes": self.sizes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["members"], state["sizes"])  # members may be half restored yet (a cycle)

    def weights_changed(self) -> bool:
        """Whether a member's weight or bias is another tensor, or was written, since the packed copy."""
        if self.stamp is None:
            return True
        for m, (weight, version) in zip(self.members, self.stamp):  # a plain loop: this runs every product
            if m.weight is not weight or weight._version != version:
                return True
        for bias, (kept, version) in zip(self.biases(), self.bias_stamp):
            if bias is not kept or bias._version != version:
                return True
        return False

    def biases(self) -> list[torch.Tensor]:
        return [m.bias for m in self.members if m.bias is not None]

    def packed_weight(self) -> torch.Tensor:
        """The stacked weight's packed copy (and stacked bias), made again when a member's changes."""
        if self.weights_changed():
            self.packed = fastpath.pack_weight(torch.cat([m.weight.detach() for m in self.members]))
            self.stamp = [(m.weight, m.weight._version) for m in self.members]
            biases = self.biases()
            self.stacked_bias = torch.cat([b.detach() for b in biases]) if biases else None
            self.bias_stamp = [(b, b._version) for b in biases]
        return self.packed

    def product(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The members' outputs for ``x`` (..., in), each contiguous, from one product."""
        y = fastpath.packed_linear(x, self.packed_weight(), self.stacked_bias)
        return [part.contiguous() for part in y.split(self.sizes, dim=-1)]

    def output(self, member: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s output for ``x``: kept from the group's last product on this very
        input, else from a new one (whose other outputs are then kept)."""
        if x is self.input and x._version == self.version and member in self.kept:
            out = self.kept.pop(member)
            if not self.kept:
                self.input = None  # nothing left to hand out: do not hold the input
            if not self.weights_changed():  # else a weight or bias was written since: stale
                return out
        outs = self.product(x)
        self.kept = {m: o for m, o in zip(self.members, outs) if m is not member}
        self.input, self.version = x, x._version
        return outs[self.members.index(member)]


def _member_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    layout = fastpath.layout_for(x, self.weight)
    if layout is None:
        return F.linear(x, self.weight, self.bias)
    # An inference-mode tensor has no version counter, so a kept output could not be known
    # fresh: such inputs (bulk corpus extraction) compute alone.
    if (layout not in STACKED_LAYOUTS or x.is_inference()
            or (self.bias is not None and self.bias.requires_grad and torch.is_grad_enabled())):
        return fastpath.product(x, self.weight, self.bias, self, layout)
    return self._specdraft_group.output(self, x)


def find_siblings(model: torch.nn.Module, run) -> list[list[torch.nn.Linear]]:
    """Groups of >= 2 ``nn.Linear`` children of one module that received the very same input
    tensor during ``run()`` (one forward of ``model``), each in call order, with one dtype,
    input width and bias presence."""
    seen: list[tuple[torch.nn.Linear, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((m, args[0])) if args else None)
             for m in model.modules() if type(m) is torch.nn.Linear]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    parent = {id(child): id(module) for module in model.modules() for child in module.children()}
    groups: dict[tuple, list[torch.nn.Linear]] = {}
    for module, x in seen:
        key = (parent.get(id(module)), id(x), module.weight.dtype, module.in_features, module.bias is None)
        members = groups.setdefault(key, [])
        if module not in members:
            members.append(module)
    return [g for g in groups.values() if len(g) >= 2]


def stacks_bitwise(members: list[torch.nn.Linear]) -> bool:
    """Whether the stacked product is bitwise each member's own (packed) product at every
    probed row count up to the dtype's row limit (oneDNN picks kernels by shape)."""
    group, dtype = SiblingGroup(members), members[0].weight.dtype
    limit = fastpath.ROW_LIMIT.get(dtype, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (r for r in fastpath.PROBE_ROWS if r <= limit):
            x = torch.randn(rows, members[0].in_features, generator=g).to(dtype)
            alone = [fastpath.packed_linear(x, fastpath.pack_weight(m.weight.detach()),
                                            None if m.bias is None else m.bias.detach()) for m in members]
            if not all(torch.equal(a, b) for a, b in zip(group.product(x), alone)):
                return False
    return limit > 0


def stacks_here(weight: torch.Tensor) -> bool:
    """Whether this process's layout for ``weight`` (on CPU, at its dtype) is one that stacks."""
    return weight.is_cpu and fastpath.CHOSEN.get(weight.dtype, fastpath.LAYOUTS.get(weight.dtype)) in STACKED_LAYOUTS


def fuse_siblings(model: torch.nn.Module, run) -> int:
    """Stack the sibling linears of ``model`` (``find_siblings`` over ``run()``) where this
    process's layout for their dtype stacks and the stack is bitwise (checked once per group
    shape); in place, idempotent. Returns the number of groups stacked."""
    if not any(stacks_here(m.weight) for m in model.modules() if type(m) is torch.nn.Linear):
        return 0  # e.g. float32 or a GPU: no forward needed to find out
    verdict: dict[tuple, bool] = {}
    stacked = 0
    try:
        groups = find_siblings(model, run)
    except Exception:  # stacking only saves time: a model the probe cannot run keeps its linears apart
        return 0
    for members in groups:
        if any(hasattr(m, "_specdraft_group") for m in members) or not stacks_here(members[0].weight):
            continue
        shape = (members[0].weight.dtype, members[0].bias is None, tuple(tuple(m.weight.shape) for m in members))
        if shape not in verdict:
            verdict[shape] = stacks_bitwise(members)
        if verdict[shape]:
            group = SiblingGroup(members)
            for m in members:
                m._specdraft_group = group
                m.forward = types.MethodType(_member_forward, m)
            stacked += 1
    return stacked


def stacked_groups(model: torch.nn.Module) -> int:
    """How many sibling groups of ``model`` run stacked (what its forward costs depends on it)."""
    return len({id(m._specdraft_group) for m in model.modules()
                if getattr(m, "_specdraft_group", None) is not None and getattr(m, "_specdraft_fastpath", False)})
