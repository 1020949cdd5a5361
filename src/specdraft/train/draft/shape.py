"""The draft's shape: what it needs to know about the target (``TargetFacts``), the shape
itself (``DraftShape``, with its exact parameter count), the default size rule
(``choose_shape``; the package docstring gives examples), the LlamaConfig a shape becomes
(``draft_config``) and the shape of a built draft (``shape_of``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import SpecdraftError

MAX_DEFAULT_HIDDEN = 1024
DEFAULT_LAYERS = 4


@dataclass
class TargetFacts:
    """What the default shape and the initialisation need to know about the target."""

    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    parameters: int

    @classmethod
    def of(cls, target) -> "TargetFacts":
        from ...models import parameter_count

        cfg = target.config
        heads = int(getattr(cfg, "num_attention_heads", 0) or max(1, target.hidden_size // 64))
        kv = int(getattr(cfg, "num_key_value_heads", 0) or heads)
        head_dim = int(getattr(cfg, "head_dim", 0) or target.hidden_size // heads)
        inter = int(getattr(cfg, "intermediate_size", 0) or 4 * target.hidden_size)
        tied = target.model.get_input_embeddings().weight.data_ptr() == target.head.weight.data_ptr()
        return cls(vocab=target.vocab_size, hidden=target.hidden_size, heads=heads, kv_heads=kv, head_dim=head_dim,
                   intermediate=inter, tied=tied, parameters=parameter_count(target.model))


@dataclass
class DraftShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tie_embeddings: bool

    def parameters(self, vocab: int) -> int:
        """Exact parameter count of the LlamaForCausalLM (no biases; tied weights once)."""
        d, hd = self.hidden, self.head_dim
        attention = 2 * d * self.heads * hd + 2 * d * self.kv_heads * hd
        layer = attention + 3 * d * self.intermediate + 2 * d  # + two RMSNorms
        return vocab * d * (1 if self.tie_embeddings else 2) + self.layers * layer + d

    def summary(self, vocab: int, target_parameters: int) -> str:
        n = self.parameters(vocab)
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV (dim "
                f"{self.head_dim}), MLP {self.intermediate}, {'tied' if self.tie_embeddings else 'untied'} "
                f"embeddings: {n / 1e6:.2f}M parameters = {100 * n / target_parameters:.2f}% of the target's "
                f"{target_parameters / 1e6:.1f}M")


def complete_shape(facts: TargetFacts, layers: int, hidden: int, heads: int | None = None,
                   kv_heads: int | None = None, intermediate: int | None = None,
                   tie: bool | None = None, head_dim: int | None = None) -> DraftShape:
    """A shape from a hidden size and layer count; unset parts follow the target's
    proportions (head dimension, query heads per KV head, MLP ratio)."""
    if heads is None:
        head_dim = facts.head_dim if hidden % facts.head_dim == 0 else math.gcd(hidden, facts.head_dim)
        heads = hidden // head_dim
    if heads < 1 or hidden % heads:
        raise SpecdraftError(f"the draft's hidden size {hidden} is not a multiple of its {heads} heads")
    head_dim = head_dim or hidden // heads
    if kv_heads is None:
        group = max(1, facts.heads // max(1, facts.kv_heads))
        kv_heads = max(1, heads // group)
        while heads % kv_heads:
            kv_heads -= 1
    if kv_heads < 1 or heads % kv_heads:
        raise SpecdraftError(f"the draft's {heads} heads are not a multiple of its {kv_heads} KV heads")
    if intermediate is None:
        intermediate = max(head_dim, round(hidden * facts.intermediate / facts.hidden / head_dim) * head_dim)
    shape = DraftShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       intermediate=intermediate, tie_embeddings=facts.tied if tie is None else tie)
    for name in ("layers", "hidden", "intermediate"):
        if getattr(shape, name) < 1:
            raise SpecdraftError(f"the draft's {name} must be >= 1, got {getattr(shape, name)}")
    return shape


def choose_shape(facts: TargetFacts, *, layers: int | None = None, hidden: int | None = None,
                 heads: int | None = None, kv_heads: int | None = None, intermediate: int | None = None,
                 tie: bool | None = None, copy_layers: list[int] | None = None,
                 max_fraction: float = 0.1) -> tuple[DraftShape, str]:
    """The draft's shape and how it was chosen.

    - ``copy_layers``: the target's own layer shape (so its layers can be copied);
    - a given ``hidden``: that, with ``layers`` (default 4) and the target's proportions;
    - otherwise the default: for layers = ``layers`` or 4, 3, 2, 1 in turn, the widest
      hidden size h (multiples of the target's head dimension, h <= min(target hidden,
      1024)) whose draft has at most ``max_fraction`` of the target's parameters.
    """
    if copy_layers:
        if hidden not in (None, facts.hidden):
            raise SpecdraftError(f"--copy-layers needs the target's hidden size ({facts.hidden}), got --hidden {hidden}")
        n = layers or len(copy_layers)
        if n < len(copy_layers):
            raise SpecdraftError(f"--copy-layers names {len(copy_layers)} layers but --layers is {n}")
        shape = complete_shape(facts, n, facts.hidden, heads or facts.heads, kv_heads or facts.kv_heads,
                               intermediate or facts.intermediate, tie, None if heads else facts.head_dim)
        return shape, "the target's layer shape (--copy-layers)"
    if hidden is not None:
        return complete_shape(facts, layers or DEFAULT_LAYERS, hidden, heads, kv_heads, intermediate, tie), "given"
    budget = max_fraction * facts.parameters
    top = max(facts.head_dim, min(facts.hidden, MAX_DEFAULT_HIDDEN) // facts.head_dim * facts.head_dim)
    sizes = list(range(top, 0, -facts.head_dim))
    for n in ([layers] if layers else [DEFAULT_LAYERS, 3, 2, 1]):
        for h in sizes:
            shape = complete_shape(facts, n, h, heads if heads and h % heads == 0 else None, kv_heads,
                                   intermediate, tie)
            if shape.parameters(facts.vocab) <= budget:
                return shape, f"default: the widest within {100 * max_fraction:g}% of the target"
    shape = complete_shape(facts, layers or 1, sizes[-1], None, None, intermediate, tie)
    return shape, f"default: the smallest (nothing fits in {100 * max_fraction:g}% of the target)"


def draft_config(target, shape: DraftShape):
    """A LlamaConfig for ``shape`` with the target's vocabulary, special tokens, context
    length, RMSNorm epsilon and rotary embedding parameters."""
    from transformers import LlamaConfig

    cfg = target.config
    rope = getattr(cfg, "rope_parameters", None)
    if not (isinstance(rope, dict) and "rope_type" in rope):  # e.g. per-layer-type rope of other families
        theta = getattr(cfg, "rope_theta", None) or (rope or {}).get("rope_theta") or 10000.0
        rope = {"rope_type": "default", "rope_theta": float(theta)}
    context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    return LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, hidden_act="silu", max_position_embeddings=context,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6) or 1e-6), tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None), rope_parameters=dict(rope), attention_bias=False,
        mlp_bias=False, architectures=["LlamaForCausalLM"])


def shape_of(draft) -> DraftShape:
    cfg = draft.config
    heads = int(cfg.num_attention_heads)
    tied = draft.get_input_embeddings().weight.data_ptr() == draft.get_output_embeddings().weight.data_ptr()
    return DraftShape(layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=heads,
                      kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                      head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                      intermediate=int(getattr(cfg, "intermediate_size", 0) or 0), tie_embeddings=tied)
