"""``specdraft fit``'s configuration: every option of the pipeline (``train.fit`` for heads,
``train.fit_draft`` for a draft model) as one dataclass, and its checks, which turn a bad
combination into one line before any work starts. Only the CLI layer fills it from argparse."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecdraftError


@dataclass
class FitConfig:
    """Everything ``fit`` needs; the CLI fills it from its options.

    tokens: stop extracting once the training corpus holds this many tokens (None: all).
    draft_vocab: N (0: the whole vocabulary). batch_positions: trained positions per
    optimizer step. epochs over the corpus as it stands when training starts.
    """

    out: Path
    drafter: str = "redrafter"  # "medusa": K independent heads, the paper's baseline; "draft": a draft model
    target: str = "default"
    dtype: str = "bfloat16"
    device: str = "cpu"
    trust_remote_code: bool = False
    data: str = "sharegpt"
    seq_len: int = 1024
    tokens: int | None = None
    data_offset: int = 0  # skip the first N training conversations (data a warm start has seen)
    budget_seconds: float | None = None
    extract_share: float = 0.5
    heldout_prompts: int = 64
    heldout_data: str | None = None  # a distill file of the target's answers, instead of stage 1
    heldout_max_new_tokens: int = 256  # also the length of the own answers
    own_answers: int = 0  # the target answers this many training prompts (stage 1b), trained beside the data
    own_offset: int = 0  # ...from the Nth training prompt on (a later round answers prompts no earlier one did)
    own_temperatures: list[float] = field(default_factory=lambda: [0.0])  # one answer per temperature (0: greedy)
    own_share: float | None = None  # the own answers' share of the examples per epoch (None: as extracted)
    draft_vocab: int = 8192
    head: str = "own"
    labels: str = "target"  # "target": the target's greedy choices (distillation); "agreeing": the same where the
    # text followed them at the shallower depths (``Corpus.gather``); "text": the data's own tokens
    K: int = 4
    num_blocks: int = 2
    context: int = 0  # redrafter: context attention over the last N target states (0: the paper's head)
    feature_layers: list[int] = field(default_factory=list)  # redrafter: fuse these target layers' states with h
    hidden_in_recurrence: bool = False  # redrafter: its recurrence reads h at every step (V·h)
    kl_weight: float = 0.0  # λ: + λ·KL(p ‖ q) against the target's distribution (``train.heads``), 0: CE only
    epochs: int = 2
    max_steps: int | None = None  # cap on optimizer steps (the LR schedule spans the cap)
    batch_positions: int = 1024
    lr: float = 1e-3
    warmup: float = 0.05
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 200
    save_every_seconds: float = 300.0
    progress: bool = True
    compile_target: bool = False  # extract the training corpus through Target.compile (faster; labels may flip at ties)
    compile_loss: bool = True  # a head's cross-entropy through torch.compile (train.cross_entropy; same math)
    init_from: str | None = None
    beam_width: int = 1
    beam_length: int = 3
    stop_after_steps: int | None = None  # stop as if interrupted (tests of resumption)
    # drafter "draft" only (``train.fit_draft``):
    loss: str = "tvdpp"  # fkl | rkl | tvd | tvdpp (``train.losses``)
    copy_layers: str | None = None  # "I,J,...": start from these target layers at full width
    gamma: int = 3  # held-out walk τ at γ = 1..gamma
    batch_sequences: int = 8  # sequences per optimizer step
    on_policy: bool = False  # train on the conversations' prompts continued by the draft itself
    on_policy_tokens: int = 128  # tokens the draft writes per prompt with on_policy

    def check(self) -> None:
        if self.num_blocks < 0 or self.eval_every < 0 or self.seq_len < 3:
            raise SpecdraftError(f"need num-blocks >= 0, eval-every >= 0 and seq-len >= 3, got {self.num_blocks}, "
                                 f"{self.eval_every} and {self.seq_len}")
        if not 0 <= self.save_every_seconds < 1e9:
            raise SpecdraftError(f"save-every must be a number of seconds >= 0, got {self.save_every_seconds}")
        for name in ("seq_len", "K", "epochs", "batch_positions", "heldout_prompts", "heldout_max_new_tokens"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab < 0 or not self.lr > 0 or not 0 <= self.warmup < 1 or not 0 < self.extract_share <= 1:
            raise SpecdraftError("need draft-vocab >= 0, lr > 0, 0 <= warmup < 1 and 0 < extract-share <= 1")
        if not 0 <= self.kl_weight < 1e6 or (self.kl_weight and (self.drafter == "draft" or self.labels == "text")):
            raise SpecdraftError(f"--kl-weight must be >= 0 and is for heads distilled on the target's labels, got "
                                 f"{self.kl_weight} with --drafter {self.drafter} --labels {self.labels}")
        if self.labels not in ("target", "agreeing", "text"):
            raise SpecdraftError(f"--labels must be target, agreeing or text, got {self.labels!r}")
        if self.drafter not in ("redrafter", "medusa", "draft"):
            raise SpecdraftError(f"fit trains redrafter or medusa heads or a draft model, got {self.drafter!r}")
        if self.drafter == "draft":
            self.check_draft()
        elif self.on_policy:
            raise SpecdraftError(f"--on-policy is for --drafter draft (a head trains on the target's own states), "
                                 f"not {self.drafter}")
        if self.max_steps is not None and self.max_steps < 1:
            raise SpecdraftError(f"max-steps must be >= 1, got {self.max_steps}")
        if self.data_offset < 0:
            raise SpecdraftError(f"data-offset must be >= 0, got {self.data_offset}")
        if self.compile_target and self.drafter == "draft":
            raise SpecdraftError("--compile-target speeds up a head fit's corpus extraction; a draft model's fit "
                                 "has no such stage")
        if self.feature_layers and self.drafter != "redrafter":
            raise SpecdraftError(f"--feature-layers is a redrafter option, not {self.drafter}'s")
        if self.hidden_in_recurrence and self.drafter != "redrafter":
            raise SpecdraftError(f"--hidden-in-recurrence is a redrafter option, not {self.drafter}'s")
        if self.context < 0 or (self.context and self.drafter != "redrafter"):
            raise SpecdraftError(f"--context must be >= 0 and is a redrafter option, got {self.context} "
                                 f"for {self.drafter}")
        if self.tokens is not None and self.tokens < 1:
            raise SpecdraftError(f"tokens must be >= 1, got {self.tokens}")
        if self.budget_seconds is not None and not self.budget_seconds > 0:
            raise SpecdraftError(f"the budget must be > 0 seconds, got {self.budget_seconds}")
        self.check_own_answers()

    def check_own_answers(self) -> None:
        if self.own_answers < 0 or (self.own_answers and self.drafter == "draft"):
            raise SpecdraftError(f"--own-answers must be >= 0 and is for heads, got {self.own_answers} "
                                 f"with --drafter {self.drafter}")
        if self.own_offset < 0 or (self.own_offset and not self.own_answers):
            raise SpecdraftError(f"--own-offset must be >= 0, with --own-answers > 0, got {self.own_offset}")
        if self.own_share is not None and not (0 < self.own_share < 1 and self.own_answers):
            raise SpecdraftError(f"--own-share must be in (0, 1), with --own-answers > 0, got {self.own_share}")
        if not self.own_temperatures or any(not t >= 0 for t in self.own_temperatures):
            raise SpecdraftError(f"--own-temperatures must be numbers >= 0, got {self.own_temperatures}")


    def check_draft(self) -> None:
        from .losses import LOSSES

        if self.loss not in LOSSES:
            raise SpecdraftError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.gamma < 1 or self.batch_sequences < 1:
            raise SpecdraftError(f"need gamma >= 1 and batch-sequences >= 1, got {self.gamma} and {self.batch_sequences}")
        if self.labels != "target":
            raise SpecdraftError(f"--labels {self.labels} is for heads; a draft model distils the target's "
                                 "distributions over the conversations")
        if self.tokens is not None:
            raise SpecdraftError("--tokens bounds the heads' extraction; a draft model reads the conversations as "
                                 "it trains: bound it with --budget or --max-steps")
        if self.copy_layers:
            from .draft.checks import parse_layers

            parse_layers(self.copy_layers)
        if self.init_from and self.copy_layers:
            raise SpecdraftError("--init-from continues a draft (its shape is given); drop --copy-layers")
        if self.on_policy_tokens < 1:
            raise SpecdraftError(f"--on-policy-tokens must be >= 1, got {self.on_policy_tokens}")
