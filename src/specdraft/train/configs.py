"""Plain configuration objects of the trainers (``specdraft train redrafter`` / ``draft``).

The library takes these; only ``specdraft.cli`` knows argparse and builds them from its
options (``from_options``). Field names are the command-line options' names with ``_``
for ``-``, and the defaults are the command line's (a test compares both), so a
Python user writes e.g.

    from specdraft.train import HeadTrainConfig, train_head
    train_head(HeadTrainConfig(out="runs/head", data="distill.jsonl", head="shared", epochs=2))

``specdraft fit``'s own configuration is ``train.fit_config.FitConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(kw_only=True)
class LoopConfig:
    """What every trainer shares: the target, the optimisation loop, output and resumption.

    device "auto": the accelerator decides (cuda:<rank> under a launcher), "cpu" forces CPU.
    lr None: the trainer's default. max_steps caps optimizer steps (the LR schedule spans
    min(max_steps, epochs)). save_every: checkpoint every N steps; stop_after_steps: save and
    stop after step N, as if interrupted. eval_every 0: score the held-out set first and last only.
    """

    out: str
    target: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    lr: float | None = None
    warmup: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    seed: int = 0
    save_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False
    stop_after_steps: int | None = None
    log_every: int = 10
    no_progress: bool = False
    eval_every: int = 0
    eval_examples: int = 64
    eval_data: str | None = None
    seq_len: int = 1024
    limit: int | None = None
    heldout_fraction: float | None = None  # None: the data module's default (0.02)
    hidden_cache: str | None = None  # folder keeping the target's hidden states across epochs and reruns
    data: str | None = None
    # Library-only (``specdraft fit`` sets them; no command-line option):
    deadline: float | None = None  # time.monotonic() at which to checkpoint and stop (a budget)
    save_every_seconds: float | None = None  # also checkpoint when this much time has passed
    resume_hint: str = "rerun with --resume to continue"  # what a stopped run tells the user

    @classmethod
    def from_options(cls, options) -> "LoopConfig":
        """This config from any object with the fields as attributes (the CLI's namespace)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)})


@dataclass(kw_only=True)
class HeadTrainConfig(LoopConfig):
    """``train redrafter``: a ReDrafter head (arch "redrafter") or Medusa heads ("medusa")
    on the frozen target's last hidden states. head: "own" output layer or the target's
    "shared" LM head; future_tokens K: tokens predicted per position; kl_weight: weight of
    KL(target || head) added at each labelled position; topk: logged top-k accuracy."""

    data: str = "sharegpt"
    seq_len: int = 2048
    epochs: int = 2
    lr: float = 1e-3
    arch: str = "redrafter"
    head: str = "own"
    num_blocks: int | None = None  # None: 2 for redrafter, 1 per Medusa head
    future_tokens: int = 5
    kl_weight: float = 0.0
    topk: int = 5


@dataclass(kw_only=True)
class DraftTrainConfig(LoopConfig):
    """``train draft``: one stage of the direct-alignment draft model ("pretrain":
    next-token loss on text; "finetune": distillation with ``loss``). See the command's
    --help for each option; shape fields left None are chosen by ``draft.shape.choose_shape``."""

    stage: str
    text: list[str] | None = None
    dataset: str | None = None
    dataset_split: str = "train"
    dataset_field: str = "text"
    max_tokens: int | None = None
    eval_every: int = 200
    gamma: int = 4
    draft: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    intermediate: int | None = None
    tie_embeddings: bool | None = None
    max_fraction: float = 0.1
    init_from_target: bool = False
    copy_layers: str | None = None
    embeddings: str = "own"
    draft_vocab: int = 0
    save_dtype: str = "float32"
    loss: str = "tvdpp"
    tvdpp_variant: str = "exact"
    tvdpp_samples: int = 4
    temperature: float = 1.0
    on_policy: bool = False
    on_policy_tokens: int = 128
    loss_chunk: int = 1024
    data_offset: int = 0  # skip the first N training conversations / records (library-only)
