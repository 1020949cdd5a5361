"""Sibling linears stacked into one product (``specdraft.siblings``): found by observation,
bitwise the separate products, and never serving a stale or foreign output."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import NEEDS_PACKED
from specdraft import fastpath, siblings
from specdraft.models import load_target
from specdraft.timing import prefill



@pytest.fixture
def fresh_layouts(monkeypatch):
    """Layouts chosen afresh (a tiny model does not time: the dtype's candidate)."""
    monkeypatch.setattr(fastpath, "CHOSEN", {})
    monkeypatch.setattr(fastpath, "ROW_LIMIT", {})


@pytest.fixture
def stock_packing(monkeypatch, fresh_layouts):
    """The packed product played by stock F.linear, so that the grouping logic is tested on
    any CPU (one without oneDNN's packed bf16 product included)."""
    monkeypatch.setattr(fastpath, "packing_available", lambda: True)
    monkeypatch.setattr(fastpath, "pack_weight", lambda w: w.clone())
    monkeypatch.setattr(fastpath, "packed_linear", lambda x, packed, bias=None: F.linear(x, packed, bias))


def member_names(target) -> list[list[str]]:
    names = {m: n for n, m in target.model.named_modules()}
    groups = {id(m._specdraft_group): m._specdraft_group for m in target.model.modules() if hasattr(m, "_specdraft_group")}
    return [[names[m].rsplit(".", 1)[1] for m in g.members] for g in groups.values()]


def logits(target, n: int, cache=None) -> torch.Tensor:
    """An engine forward's logits for n chain tokens after a 5-token cache."""
    cache = cache or prefill(target, 5, 16)
    ids = (torch.arange(1, n + 1)[None] * 7) % target.vocab_size
    chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return target.logits(target.forward(ids, 5 + torch.arange(n)[None], cache.attention_mask(chain), cache))


def test_siblings_are_found_by_what_they_read(tiny_target_path, stock_packing):
    """A Llama's q/k/v read one input and so do gate/up; o_proj and down_proj read their own."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    groups = member_names(target)
    layers = target.num_layers
    assert sorted(map(tuple, groups)) == sorted([("q_proj", "k_proj", "v_proj")] * layers + [("gate_proj", "up_proj")] * layers)


def test_float32_is_not_stacked(tiny_target_path, fresh_layouts):
    """float32's layout does not stack (measured: no faster, not bitwise): no groups, and no
    probe forward is run to look for them."""
    target = load_target(str(tiny_target_path), dtype="float32")
    assert member_names(target) == []
    assert siblings.fuse_siblings(target.model, lambda: pytest.fail("probe forward run for float32")) == 0


def test_one_product_serves_the_group(tiny_target_path, stock_packing, monkeypatch):
    """One product per group and layer in an engine forward: per layer 2 stacked products,
    o_proj and down_proj (4, not 7), plus the LM head."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    cache, calls = prefill(target, 5, 16), []
    monkeypatch.setattr(fastpath, "packed_linear", lambda x, packed, bias=None: calls.append(packed.shape) or F.linear(x, packed, bias))
    logits(target, 1, cache)
    assert len(calls) == 4 * target.num_layers + 1


@NEEDS_PACKED
def test_stacked_forward_is_bitwise_the_separate_one(tiny_target_path, fresh_layouts):
    """With oneDNN's real packed product: engine forwards of 1-9 tree tokens give bitwise the
    logits of the same model with every linear on its own."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    members = [m for m in target.model.modules() if hasattr(m, "_specdraft_group")]
    assert members
    stacked = {m: m.forward for m in members}
    for n in (1, 2, 3, 4, 8, 9):
        together = logits(target, n)
        for m in members:
            m.forward = types.MethodType(fastpath._forward, m)
        alone = logits(target, n)
        for m in members:
            m.forward = stacked[m]
        assert torch.equal(together, alone), n


def test_outputs_follow_their_input_and_weights(tiny_target_path, stock_packing):
    """A member called with another input than the one its outputs were kept for computes
    its own; an input written in place is another input; a weight written in place is
    stacked again."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    attn = target.model.model.layers[0].self_attn
    x, y = (torch.randn(1, 3, attn.q_proj.in_features).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad(), fastpath.active():
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(y), F.linear(y, attn.k_proj.weight))  # not x's kept output
        attn.q_proj(x)
        x.mul_(2)  # the kept outputs were for x before this write
        assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))
        attn.v_proj.weight.mul_(3)
        assert torch.equal(attn.v_proj(x), F.linear(x, attn.v_proj.weight))
        attn.q_proj(y)
        assert torch.equal(attn.v_proj(y), F.linear(y, attn.v_proj.weight))
        assert attn.q_proj._specdraft_group.input is y  # k_proj's output is still kept
        assert torch.equal(attn.k_proj(y), F.linear(y, attn.k_proj.weight))
        assert attn.q_proj._specdraft_group.input is None  # all handed out: the input is let go


def test_outside_the_engine_members_run_stock(tiny_target_path, stock_packing, monkeypatch):
    """Outside ``fastpath.active()`` (transformers' own generate on the same model) every
    member is stock F.linear, with no product of the group."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    monkeypatch.setattr(fastpath, "packed_linear", lambda *a, **k: pytest.fail("packed product outside the engine"))
    attn = target.model.model.layers[0].self_attn
    x = torch.randn(1, 2, attn.q_proj.in_features).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))


def test_a_stack_that_is_not_bitwise_is_not_used(tiny_target_path, stock_packing, monkeypatch):
    """Where the stacked product differs from the members' own in any bit (another oneDNN
    kernel for the wider weight), the group is left unstacked."""
    product = siblings.SiblingGroup.product
    monkeypatch.setattr(siblings.SiblingGroup, "product", lambda self, x: [y + 1 for y in product(self, x)])
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    assert member_names(target) == []


def test_copies_of_the_model_keep_their_groups(tiny_target_path, stock_packing):
    """A deep copy of a stacked model has groups over its own members, without
    the packed copy or kept outputs of the original, and computes the same outputs."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    attn = target.model.model.layers[0].self_attn
    x = torch.randn(1, 2, attn.q_proj.in_features).to(torch.bfloat16)
    with torch.no_grad(), fastpath.active():
        attn.q_proj(x)  # a packed copy made, outputs kept
        for twin in (copy.deepcopy(attn),):
            group = twin.q_proj._specdraft_group
            assert group.members == [twin.q_proj, twin.k_proj, twin.v_proj] and group.packed is None and not group.kept
            assert torch.equal(twin.q_proj(x), F.linear(x, attn.q_proj.weight))
            assert torch.equal(twin.v_proj(x), F.linear(x, attn.v_proj.weight))


class Branches(torch.nn.Module):
    """Three biased linears on one input and one on another (a Qwen-like attention)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4))
        self.d = torch.nn.Linear(8, 8, bias=True)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], -1), self.d(self.a(x) + 1)


def test_biased_siblings_stack_with_their_biases(stock_packing):
    """Biases are stacked with their weights and followed like them; a linear reading
    another input (here ``d``) stays alone."""
    model = Branches().to(torch.bfloat16)
    fastpath.small_batch_linear(model)
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert siblings.fuse_siblings(model, lambda: model(x)) == 1
    assert model.a._specdraft_group.members == [model.a, model.b, model.c] and not hasattr(model.d, "_specdraft_group")
    with torch.no_grad(), fastpath.active():
        assert torch.equal(model(x)[0], torch.cat([F.linear(x, m.weight, m.bias) for m in (model.a, model.b, model.c)], -1))
        model.c.bias.add_(1)  # written in place: stacked again
        model.a(x)
        assert torch.equal(model.c(x), F.linear(x, model.c.weight, model.c.bias))
        model.a(x)
        model.b.bias.sub_(1)  # written after the product: b's kept output is stale
        assert torch.equal(model.b(x), F.linear(x, model.b.weight, model.b.bias))
        model.b.bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # another tensor
        model.a(x)
        assert torch.equal(model.b(x), F.linear(x, model.b.weight))


def test_the_cost_model_knows_the_stacking(tiny_target_path, stock_packing):
    """The adaptive policy's cached forward costs are keyed on how many groups run stacked:
    a curve measured before stacking (slower one-row forwards) is not reused after it."""
    from specdraft.costmodel import cost_model_key

    target = load_target(str(tiny_target_path), dtype="bfloat16")
    assert siblings.stacked_groups(target.model) == 2 * target.num_layers
    assert cost_model_key(target).endswith(f"|stacked={2 * target.num_layers}")
    fastpath.stock_linear(target.model)  # what a compiled target does: nothing stacked any more
    assert siblings.stacked_groups(target.model) == 0 and "stacked" not in cost_model_key(target)


def test_a_model_the_probe_cannot_run_stays_unstacked(stock_packing):
    """Stacking only saves time: where the probe forward fails, the model keeps its linears
    apart (and still loads); its real forwards report their own errors."""
    model = Branches().to(torch.bfloat16)
    fastpath.small_batch_linear(model)

    def broken():
        raise ValueError("this model wants more inputs")

    assert siblings.fuse_siblings(model, broken) == 0 and siblings.stacked_groups(model) == 0


def test_inference_mode_inputs_compute_alone(tiny_target_path, stock_packing):
    """Under ``torch.inference_mode`` (corpus extraction) an input has no version counter, so
    nothing is kept for it: each member computes its own product, and whole forwards run."""
    target = load_target(str(tiny_target_path), dtype="bfloat16")
    attn = target.model.model.layers[0].self_attn
    with torch.inference_mode(), fastpath.active():
        x = torch.randn(1, 2, attn.q_proj.in_features).to(torch.bfloat16)
        attn.q_proj(x)
        assert not attn.q_proj._specdraft_group.kept
        assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))
        cache = prefill(target, 5, 16)
        ids = torch.tensor([[3, 4]])
        hidden = target.forward(ids, 5 + torch.arange(2)[None], cache.attention_mask(torch.ones(1, 2, 2, dtype=torch.bool).tril()), cache)
    assert hidden.shape == (1, 2, target.hidden_size)
