"""``specdraft fit``: a ready drafter head for a target, in one resumable command.

Stages, each resumable and each skipped when its output is already complete:

    1. heldout   the target's own greedy answers to held-out ShareGPT prompts
                 (OUT/heldout.jsonl, ``distill.distill_responses``): what τ is measured on
    1b. own      with ``own_answers``: the target's answers to training prompts
                 (OUT/answers.jsonl; extracted into OUT/answers-corpus and joined after the
                 training corpus, at ``own_share`` of the examples: ``fit_stages``)
    2. extract   the training corpus (OUT/corpus, ``train.corpus``): one target pass per
                 training conversation (all turns, assistant positions), in the target's
                 dtype, hidden states and the target's greedy labels memory-mapped on disk;
                 and the held-out corpus (OUT/heldout-corpus) the same way
    3. vocab     the draft vocabulary: the N tokens the target chose most often at the
                 training answers' positions (OUT/vocab.json records its coverage)
    4. train     the head on the corpus (OUT/train: ``common.train_loop`` with accelerate:
                 checkpoints every few minutes, exact resume, logs), scored on the held-out
                 corpus every ``eval_every`` steps: per-depth top-1 accuracy and the
                 engine-exact greedy τ at W = 1 (``train.walk``); OUT/curve.jsonl and
                 OUT/curve.png plot them against training positions
    5. final     OUT/final, loadable as ``redrafter:OUT/final`` (``medusa:`` for Medusa heads)

Objective (per trained position t, depth i = 0..K-1; labels from ``corpus.gather``):
loss = Σ_i mean_{t: y_{t,i} in the draft vocabulary} CE(q_{t,i}, y_{t,i}), with y_{t,i} =
the target's greedy choice after x_<=t+1+i (``labels="text"``: the conversation's own token
x_{t+2+i}, the paper's no-distillation ablation). Labels outside the draft vocabulary cannot be
drafted; they are dropped from the loss and counted (``oov_i`` in the log).

Budget: ``budget_seconds`` bounds the whole command's wall-clock time; extraction stops
when the corpus holds ``tokens`` tokens or at ``extract_share`` of the budget, training
at the budget (a checkpoint is saved; rerun the same command to continue).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.chat import IGNORE
from ..errors import SpecdraftError
from ..vocab import DraftVocab
from .common import JsonLog, LoopOptions, Plan, TrainState, cosine_schedule, finish_run, make_accelerator, train_loop
from .corpus import Corpus, PositionBatch, corpus_manifest, extract, to_device, to_output_space
from .fit_eval import scheduled_scoring, summarise, write_curve_plot
from .fit_stages import (Budget, example_spans, heldout_answers, own_answers, say, sigterm_as_interrupt,
                         with_own_answers)
from .resume import latest_checkpoint

BLOCK = 16  # consecutive corpus positions per example: the unit the data order shuffles


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


# ---- the objective over the corpus ---------------------------------------------------------


class CorpusTask:
    """``common.train_loop``'s model-specific half for a head trained on a ``Corpus``:
    an example is a block of BLOCK consecutive corpus positions."""

    bar_fields = ("loss", "acc1_0")

    def __init__(self, corpus: Corpus, vocab: DraftVocab | None, K: int, device, held_out=None,
                 labels: str = "target", window: int = 0, soft: bool = False, spans=None):
        """``labels``: "target" trains on the target's greedy choices (the corpus's "greedy"
        labels), "agreeing" on those where the text followed them at every shallower depth,
        "text" on the conversations' own next tokens (no distillation); window:
        the head's context window (0: none); soft: gather the states whose distributions
        the KL term distils (``HeadObjective``, --kl-weight); spans: the examples' (starts,
        ends) flat positions (``fit_stages.example_spans``; default: every block once)."""
        self.corpus, self.vocab, self.K, self.device, self.window = corpus, vocab, K, device, window
        self.starts, self.ends = spans if spans is not None else example_spans(corpus.parts, BLOCK, None)
        self.soft = soft
        self.held_out = held_out
        self.label = {"target": "greedy", "agreeing": "agreeing", "text": "text"}[labels]

    def micro_batch(self, indices: list[int]) -> PositionBatch:
        at = np.asarray(indices, dtype=np.int64)
        flat = self.starts[at, None] + np.arange(BLOCK)
        mb = self.corpus.gather(flat[flat < self.ends[at, None]], self.K, label=self.label, window=self.window,
                                soft=self.soft)
        mb.oov = ((mb.labels != IGNORE) & (to_output_space(self.vocab, mb.labels) == IGNORE)).sum(0)
        mb.labels = to_output_space(self.vocab, mb.labels)
        return mb

    def counts(self, mb: PositionBatch) -> torch.Tensor:
        return (mb.labels != IGNORE).sum(0).float()

    def num_tokens(self, mb: PositionBatch) -> int:
        return int(mb.hidden.shape[0])

    def loss(self, model, mb: PositionBatch, denom: torch.Tensor):
        d = self.device
        features = None if mb.features is None else mb.features.to(d)
        states, present = (None, None) if mb.soft is None else (mb.soft[0].to(d), mb.soft[1].to(d))
        loss, stats = model(mb.hidden.to(d), mb.inputs.to(d), mb.labels.to(d), states, denom, to_device(mb.window, d),
                            features, present)
        return loss, torch.cat([stats.flatten(), mb.oov.float().to(stats.device)])

    def sync(self, accelerator) -> None:
        pass

    def log_fields(self, stats: torch.Tensor, seconds: float, num_processes: int) -> dict:
        from .heads import STATS

        K = self.K
        per = stats[: K * len(STATS)].view(K, len(STATS)).tolist()
        oov = stats[K * len(STATS):].tolist()
        fields: dict = {}
        loss = 0.0
        for i, (ce, kl, c1, ck, n) in enumerate(per):
            n = max(n, 1.0)
            loss += ce / n
            fields[f"ce_{i}"], fields[f"acc1_{i}"] = round(ce / n, 4), round(c1 / n, 4)
            if self.soft:
                fields[f"kl_{i}"] = round(kl / n, 4)
            fields[f"oov_{i}"] = round(oov[i] / (n + oov[i]), 4)
        fields["loss"] = round(loss, 4)
        fields["positions_per_s"] = round(sum(p[4] for p in per[:1]) / max(seconds, 1e-9), 1)
        if self.held_out is not None:
            fields.update(self.held_out.at_log())
        return fields


# ---- stages --------------------------------------------------------------------------------


def extraction_left(folder: Path, tokens: int | None) -> bool:
    """Whether the corpus in ``folder`` holds fewer than ``tokens`` tokens (None: no cap)."""
    if tokens is None or not folder.is_dir():
        return True
    return Corpus.folder_tokens(folder) < tokens


def build_corpora(config: FitConfig, target, budget: Budget) -> tuple[Corpus, Corpus]:
    """Stage 2: extract (or continue extracting) both corpora; returns them opened."""
    from .examples import load_examples

    out = Path(config.out)
    held_path = Path(config.heldout_data) if config.heldout_data else out / "heldout.jsonl"
    if not config.heldout_data:
        heldout_answers(config, target, held_path)
    if config.own_answers:  # before --compile-target: answers come from the eager target
        own_answers(config, target, out / "answers.jsonl")
    held = load_examples(str(held_path), target.tokenizer, seq_len=config.seq_len, K=config.K, eos_ids=target.eos_ids)
    layers = config.feature_layers
    extract(target, held, out / "heldout-corpus", corpus_manifest(target, held, config.seq_len, layers), chunk=16,
            progress=False)
    if latest_checkpoint(out / "train") is not None:
        # Training has begun on the corpus as it stands (its checkpoints record which chunks):
        # extending it now would change the data under the schedule, so a rerun trains on.
        return with_own_answers(config, target, Corpus(out / "corpus")), Corpus(out / "heldout-corpus")
    train = load_examples(config.data, target.tokenizer, seq_len=config.seq_len, K=config.K,
                          eos_ids=target.eos_ids).skip(config.data_offset)
    if config.compile_target and extraction_left(out / "corpus", config.tokens):
        # After the held-out corpus, which stays eager: every run scores against the same labels.
        say("compiling the target's decoder stack for the extraction (--compile-target; minutes)")
        target.compile()
    report = extract(target, train, out / "corpus", corpus_manifest(target, train, config.seq_len, layers),
                     max_tokens=config.tokens, deadline=budget.deadline(config.extract_share),
                     progress=config.progress)
    if report.tokens:
        say(f"extracted {report.tokens} tokens ({report.positions} trained positions) in {report.seconds:.0f} s: "
            f"{report.tokens_per_s:.0f} tokens/s")
    return with_own_answers(config, target, Corpus(out / "corpus")), Corpus(out / "heldout-corpus")



def draft_vocabulary(config: FitConfig, corpus: Corpus, held: Corpus, vocab_size: int) -> DraftVocab | None:
    """Stage 3: the draft vocabulary from the training corpus's greedy labels (fixed once
    made: OUT/vocab.json holds its ids, so a resumed run trains the same output layer)."""
    if not config.draft_vocab:
        return None
    path = Path(config.out) / "vocab.json"
    if path.exists():
        saved = json.loads(path.read_text())
        vocab = DraftVocab(len(saved["ids"]), vocab_size)
        vocab.set_ids(torch.tensor(saved["ids"]))
        return vocab
    counts = corpus.label_counts(vocab_size)
    vocab = DraftVocab.from_counts(counts, config.draft_vocab)
    record = {"size": vocab.size, "train_coverage": round(vocab.coverage(counts), 4),
              "heldout_coverage": round(vocab.coverage(held.label_counts(vocab_size)), 4),
              "ids": vocab.ids().tolist()}
    path.write_text(json.dumps(record))
    say(f"draft vocabulary: {vocab.size} tokens cover {record['train_coverage']:.1%} of the target's training "
        f"labels, {record['heldout_coverage']:.1%} held out")
    return vocab


def build_objective(config: FitConfig, target, vocab: DraftVocab | None):
    """The head (fresh, or ``init_from``'s weights) and its loss, in float32."""
    from ..drafters.registry import checkpoint_path
    from ..heads import MedusaHeads, ReDrafterHead
    from .heads import HeadObjective

    if config.drafter == "medusa":  # Medusa's own init: zero blocks, own heads = the target's head rows
        head = MedusaHeads.for_target(target, num_heads=config.K, num_blocks=config.num_blocks, head=config.head,
                                      beam_width=config.beam_width, beam_length=config.beam_length,
                                      draft_vocab=vocab)
    else:
        head = ReDrafterHead.for_target(target, num_blocks=config.num_blocks, head=config.head,
                                        beam_width=config.beam_width, beam_length=config.beam_length,
                                        draft_vocab=vocab, context=config.context,
                                        feature_layers=config.feature_layers,
                                        hidden_in_recurrence=config.hidden_in_recurrence)
    if config.init_from:
        warm_start(head, type(head).load(checkpoint_path(config.drafter, config.init_from), target))
    elif config.head == "shared" and config.drafter == "redrafter":
        with torch.no_grad():
            head.proj.weight.zero_()  # uniform start (see train.heads.build_head)
    return HeadObjective(head.float(), config.K, kl_weight=config.kl_weight, compiled_loss=config.compile_loss)


EXTRA_BLOCK = re.compile(r"(^|\.)blocks\.\d+\.linear\.")  # a residual block's parameters (heads and Medusa heads)


def warm_start(head: torch.nn.Module, warm: torch.nn.Module) -> None:
    """Copy ``warm``'s trained weights into ``head`` (float32). The draft vocabulary is the
    fit's own: a warm head over the whole vocabulary gives its output rows for the draft
    ids, and a "shared" head needs nothing more (its output is the target's LM head). Any
    other difference of shape (head variant, width) is a one-line error. A head with more
    residual blocks than ``warm`` grows: the extra blocks start at zero, and z + SiLU(0·z + 0)
    = z, so the grown head's logits are the warm head's own (training continues)."""
    ids = head.draft_vocab.ids() if getattr(head, "draft_vocab", None) is not None else None
    mine = head.state_dict()
    loaded = {}
    for name, value in warm.state_dict().items():
        if name.startswith("draft_vocab."):
            continue  # the fit's vocabulary wins (below: the warm output rows it selects)
        if name == "out.weight" and name in mine and ids is not None and value.shape[0] != mine[name].shape[0]:
            if getattr(warm, "draft_vocab", None) is not None:
                raise SpecdraftError("--init-from: a head with another draft vocabulary cannot seed this one's "
                                     "output layer; start from a full-vocabulary head or use the same --draft-vocab")
            value = value[ids.to(value.device)]
        if name not in mine or mine[name].shape != value.shape:
            raise SpecdraftError(f"--init-from: its {name} {tuple(value.shape)} does not fit this head "
                                 f"({tuple(mine[name].shape) if name in mine else 'absent'}); use the same "
                                 "--head as the checkpoint and at least its --num-blocks")
        loaded[name] = value.float()
    # A head with context, feature layers or V·h may start from a paper head: those parts start as the identity.
    fresh = ("draft_vocab.", "context.", "fuse.", "rnn_h.")
    grown = {k: torch.zeros_like(v) for k, v in mine.items() if k not in loaded and EXTRA_BLOCK.search(k)}
    missing = [k for k in mine if k not in loaded and k not in grown and not k.startswith(fresh)]
    if missing:
        raise SpecdraftError(f"--init-from: the checkpoint has no {', '.join(missing)}; use the same --head as "
                             "the checkpoint and at least its --num-blocks")
    head.load_state_dict({**mine, **grown, **loaded})


def train_head(config: FitConfig, target, corpus: Corpus, held: Corpus, vocab: DraftVocab | None,
               budget: Budget) -> bool:
    """Stage 4: returns True when the planned epochs are done."""
    from accelerate.utils import set_seed

    out = Path(config.out) / "train"
    accelerator = make_accelerator(cpu=config.device == "cpu",
                                   mixed_precision="bf16" if config.dtype == "bfloat16" else "no")
    spans = example_spans(corpus.parts, BLOCK, config.own_share)
    plan = Plan(len(spans[0]), max(1, config.batch_positions // BLOCK), 1, accelerator.num_processes, config.epochs,
                config.max_steps, config.seed)
    set_seed(config.seed)
    model = build_objective(config, target, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = cosine_schedule(optimizer, plan.total_steps, config.warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState({**plan.signature(), "corpus": corpus.fingerprint(), **signature(config)})
    accelerator.register_for_checkpointing(scheduler, state)
    resume = latest_checkpoint(out)
    if resume is not None:
        accelerator.load_state(str(resume))
        say(f"resuming training at step {state.step} of {plan.total_steps}")
    save = lambda name: (save_final(accelerator.unwrap_model(model).head, Path(config.out) / name, config,  # noqa: E731
                                    state, corpus), config.drafter)
    held_out, keep_best = scheduled_scoring(config, held, vocab, accelerator, model, state, plan, resume is not None,
                                            save)
    if resume is None:
        first = held_out.first()
        say(f"before training: held-out {summarise(first, config.K)}")
    task = CorpusTask(corpus, vocab, config.K, target.device, held_out, labels=config.labels,
                      window=config.context, soft=config.kl_weight > 0, spans=spans)
    deadline = budget.deadline()
    opts = LoopOptions(out=out, save_every=10**9, save_every_seconds=config.save_every_seconds, keep_checkpoints=2,
                       # Logged steps divide eval_every, so evaluations fall on its multiples only
                       # (never on the step a run was stopped at): a resumed run scores the same steps.
                       log_every=math.gcd(20, config.eval_every), deadline=deadline, progress=config.progress,
                       stop_after_steps=config.stop_after_steps,
                       resume_hint=f"run the same specdraft fit command, --out {config.out}, to continue")
    own = int((spans[0] >= corpus.parts[0][1]).sum())
    say(f"training on {len(corpus)} positions ({corpus.tokens} tokens), {plan.total_steps} steps of "
        f"{plan.batch_size * BLOCK} positions" + (f"; {own} of {len(spans[0])} examples per epoch from the "
                                                 "target's own answers" if own else ""))
    with sigterm_as_interrupt():
        finished = train_loop(accelerator, task, model, optimizer, scheduler, plan, state, opts)
    write_curve_plot(Path(config.out))
    if keep_best.describe():
        say(keep_best.describe())
    finish_run(accelerator, accelerator.is_main_process, finished, state, plan, lambda: save("final"),
               opts.resume_hint, save_latest=lambda: save("latest"))
    return finished


def signature(config: FitConfig) -> dict:
    keep = ("drafter", "draft_vocab", "head", "K", "num_blocks", "context", "feature_layers", "epochs", "max_steps", "lr", "warmup", "weight_decay", "seed", "init_from",
            "target", "dtype")
    # Options added later only when not the default, so the checkpoints of runs from before still resume.
    extra = {**({"kl_weight": config.kl_weight} if config.kl_weight else {}),
             **({"hidden_in_recurrence": True} if config.hidden_in_recurrence else {}),
             **({"labels": config.labels} if config.labels != "target" else {}),
             **({"own_answers": config.own_answers, "own_temperatures": config.own_temperatures,
                 "own_share": config.own_share} if config.own_answers else {})}
    return {**{k: getattr(config, k) for k in keep}, **extra}


def save_final(head, folder: Path, config: FitConfig, state: TrainState, corpus: Corpus) -> Path:
    """The head's weights in bfloat16 (the head itself is left as it is), loadable as
    redrafter:FOLDER or medusa:FOLDER, its training recorded under "training" in
    config.json (ignored when loading)."""
    from ..checkpoint import save_checkpoint

    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in head.state_dict().items()}
    saved = head.config.to_dict()
    saved["training"] = {"fit": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                         "steps": state.step, "positions": state.tokens, "corpus_tokens": corpus.tokens,
                         "argv": list(sys.argv)}
    save_checkpoint(folder, saved, weights)
    return folder


def run_fit(config: FitConfig) -> int:
    """All stages; returns the exit code (0 also when the budget stopped it: rerun to go on)."""
    from ..models import load_target

    config.check()
    budget = Budget(config.budget_seconds)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(config.target, config.device, config.dtype, config.trust_remote_code)
    if config.drafter == "draft":
        from .fit_draft import fit_draft

        return fit_draft(config, target, budget)
    with sigterm_as_interrupt():
        corpus, held = build_corpora(config, target, budget)
    if budget.left() <= 0:  # before the vocabulary: it is fixed once made, and the corpus may still grow
        say(f"the budget ended before training; rerun the same command to continue ({len(corpus)} positions so far)")
        return 0
    vocab = draft_vocabulary(config, corpus, held, int(target.vocab_size))
    train_head(config, target, corpus, held, vocab, budget)
    return 0
