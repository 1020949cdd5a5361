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
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..data.chat import IGNORE
from ..errors import SpecdraftError
from ..vocab import DraftVocab
from .common import JsonLog, LoopOptions, Plan, TrainState, cosine_schedule, finish_run, make_accelerator, train_loop
from .corpus import Corpus, PositionBatch, corpus_manifest, extract, to_device, to_output_space
from .fit_config import FitConfig
from .fit_eval import scheduled_scoring, summarise, write_curve_plot
from .fit_stages import (Budget, example_spans, heldout_answers, own_answers, say, say_extracted, sigterm_as_interrupt,
                         with_own_answers)
from .resume import latest_checkpoint

BLOCK = 16  # consecutive corpus positions per example: the unit the data order shuffles


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
    say_extracted("corpus", report)
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
                 "own_share": config.own_share} if config.own_answers else {}),
             **({"own_offset": config.own_offset} if config.own_offset else {})}
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
