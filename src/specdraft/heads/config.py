"""Configurations of the drafter heads, as written to a checkpoint's config.json.

A config records the head's shape, the beam defaults the drafter uses at inference,
which kind of checkpoint it is ("redrafter" or "medusa", so that one is never loaded as
the other) and the signature of the target it was made for
(``specdraft.checkpoint.target_signature``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecdraftError

FORMAT_VERSION = 1
HEAD_VARIANTS = ("own", "shared")


@dataclass
class HeadConfig:
    """Fields common to both head families.

    hidden_size: d, the target's hidden size.   vocab_size: V, the target's vocabulary.
    head: "own" (the head has its own output layer to V) or "shared" (the head ends in
          the target's frozen LM head).
    beam_width, beam_length: inference defaults W and L (L counts g0; see beam_search).
    target: the target signature (architecture, vocab_size, hidden_size, name).
    draft_vocab: N, the size of the draft vocabulary the output covers (``specdraft.vocab``;
          its ids are stored with the weights), or 0 for the whole vocabulary.
    """

    KIND = "head"

    hidden_size: int
    vocab_size: int
    head: str = "own"
    beam_width: int = 4
    beam_length: int = 5
    target: dict = field(default_factory=dict)
    draft_vocab: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("hidden_size", "vocab_size", "beam_width", "beam_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecdraftError(f"{self.KIND} config: {name} must be an integer >= 1, got {value!r}")
        if self.head not in HEAD_VARIANTS:
            raise SpecdraftError(f"{self.KIND} config: head must be one of {HEAD_VARIANTS}, got {self.head!r}")
        if not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool) \
                or not 0 <= self.draft_vocab <= self.vocab_size:
            raise SpecdraftError(f"{self.KIND} config: draft_vocab must be an integer in 0..vocab_size, "
                                 f"got {self.draft_vocab!r}")
        if not isinstance(self.target, dict):
            raise SpecdraftError(f"{self.KIND} config: target must be an object, got {self.target!r}")

    @property
    def output_size(self) -> int:
        """The width of the output layer: N with a draft vocabulary, else V."""
        return self.draft_vocab or self.vocab_size

    def to_dict(self) -> dict:
        return {"kind": self.KIND, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict, path: str | Path = "config") -> "HeadConfig":
        """Parse a config.json object; every problem is a one-line SpecdraftError."""
        if not isinstance(raw, dict):
            raise SpecdraftError(f"{path}: config.json is not a JSON object")
        kind = raw.get("kind")
        if kind != cls.KIND:
            found = f"a {kind!r} checkpoint" if kind else "not a specdraft drafter-head checkpoint (no 'kind')"
            raise SpecdraftError(f"{path} is {found}, expected a {cls.KIND!r} checkpoint")
        version = raw.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise SpecdraftError(f"{path}: unsupported {cls.KIND} checkpoint format_version {version!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("hidden_size", "vocab_size") if n not in raw)
        if missing:
            raise SpecdraftError(f"{path}: config.json lacks {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except SpecdraftError as e:
            raise SpecdraftError(f"{path}: {e}") from None


@dataclass
class ReDrafterConfig(HeadConfig):
    """ReDrafter head: num_blocks residual blocks at width 2d (paper: N = 2).

    context: C > 0 adds context attention over the last C target states
    (``heads.context``, beyond the paper); 0 is the paper's head. context_heads: its
    attention heads (must divide hidden_size). feature_layers: target layers (0-based)
    whose outputs the head fuses with h (beyond the paper, as EAGLE-3); [] is the paper's.
    hidden_in_recurrence: the recurrence also reads h at every step (beyond the paper).
    sample_length: L of the chain drawn from the head for rows that sample (g0 counted);
    0: beam_length. A drawn token is accepted with probability sum_x min(p, q) rather than
    the beams' top-1 rate, so the best depth for sampling rows need not be the beams'.
    sample_chains: how many chains sampling rows draw, their first tokens drawn from q
    without replacement (verified together by recursive rejection: a second chain's token
    is tried where the first was rejected); 1: one chain. sample_branch_length: L of the chains after the
    first (g0 counted; 0: sample_length): where a target forward costs the same for a few
    more tree tokens, short extra chains add acceptance at the first depths for free."""

    KIND = "redrafter"

    num_blocks: int = 2
    context: int = 0
    context_heads: int = 1
    feature_layers: list = field(default_factory=list)
    hidden_in_recurrence: bool = False
    sample_length: int = 0
    sample_chains: int = 1
    sample_branch_length: int = 0

    def validate(self) -> None:
        super().validate()
        chains = self.sample_chains
        if not isinstance(chains, int) or isinstance(chains, bool) or chains < 1:
            raise SpecdraftError(f"redrafter config: sample_chains must be an integer >= 1, got {chains!r}")
        for name, default in (("sample_length", "beam_length"), ("sample_branch_length", "sample_length")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value == 1:
                raise SpecdraftError(f"redrafter config: {name} must be 0 ({default}) or an integer >= 2, "
                                     f"got {value!r}")
        if not isinstance(self.hidden_in_recurrence, bool):
            raise SpecdraftError(f"redrafter config: hidden_in_recurrence must be true or false, "
                                 f"got {self.hidden_in_recurrence!r}")
        for name in ("num_blocks", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SpecdraftError(f"redrafter config: {name} must be an integer >= 0, got {value!r}")
        layers = self.feature_layers
        if not isinstance(layers, list) or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers) \
                or len(set(layers)) != len(layers):
            raise SpecdraftError(f"redrafter config: feature_layers must be a list of distinct layer indices >= 0, "
                                 f"got {layers!r}")
        heads = self.context_heads
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1 or self.hidden_size % heads:
            raise SpecdraftError(f"redrafter config: context_heads must be an integer >= 1 dividing hidden_size "
                                 f"{self.hidden_size}, got {heads!r}")


@dataclass
class MedusaConfig(HeadConfig):
    """Medusa heads: num_heads independent heads of num_blocks residual blocks at width d.

    beam_length defaults to num_heads + 1 (g0 plus one token per head) when not given.
    """

    KIND = "medusa"

    num_heads: int = 4
    num_blocks: int = 1
    beam_length: int | None = None  # None: num_heads + 1, resolved in __post_init__

    def __post_init__(self):
        if self.beam_length is None and isinstance(self.num_heads, int):
            self.beam_length = self.num_heads + 1
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads < 1:
            raise SpecdraftError(f"medusa config: num_heads must be an integer >= 1, got {self.num_heads!r}")
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks < 0:
            raise SpecdraftError(f"medusa config: num_blocks must be an integer >= 0, got {self.num_blocks!r}")
        if self.beam_length > self.num_heads + 1:
            raise SpecdraftError(f"medusa config: beam_length {self.beam_length} exceeds num_heads + 1 "
                                 f"= {self.num_heads + 1}")
