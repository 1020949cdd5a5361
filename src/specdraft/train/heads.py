"""``specdraft train redrafter``: train a ReDrafter head (or Medusa heads) on a frozen target.

Objective, per trained position t (h_t = the target's last hidden state at token t) and
depth i = 0..K-1 (K = --future-tokens, default 5), with y_{t,i} the label (see
``train.examples``: x_{t+2+i} under teacher forcing, g_{i+1} for next-k distillation)
and q_{t,i} the head's distribution:

    loss = Σ_i [ Σ_{t in S_i} CE(q_{t,i}, y_{t,i})  +  λ · Σ_{t in S_i} KL(p_{t+1+i} || q_{t,i}) ] / |S_i|

S_i = the positions whose depth-i label is an assistant token (-100 elsewhere), counted
over the whole optimizer step and all processes, so each depth's term is an exact
per-token mean (the reference's uniform Σ_i CE_i). p_{t+1+i} is the target's own
next-token distribution at the position that predicts y_{t,i} (teacher forcing only;
λ = --kl-weight, default 0).

The target runs once per batch, over all positions, without gradients (or not at all
when its hidden states are in ``--hidden-cache``); the head then runs at the trained
positions only: ReDrafter's recurrence over the K fed tokens, Medusa's K heads on h_t.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..data.chat import IGNORE
from ..errors import SpecdraftError
from ..heads import MedusaHeads, ReDrafterHead
from .best import KeepBest
from .configs import HeadTrainConfig
from .common import (HeldOut, JsonLog, Plan, TargetStatesTask, TrainState, cosine_schedule, describe,
                     finish_run, load_target_for, loop_options, make_accelerator, open_hidden_cache, reduced_sums,
                     train_loop)
from .examples import Batch, ExampleSet, collate, load_examples
from .hidden_cache import HiddenCache
from .resume import resume_point
from .cross_entropy import cross_entropy_sum
from .walk import greedy_walk, labelled_spans

ARCHS = ("redrafter", "medusa")
EVAL_LOG = "eval.jsonl"
STATS = ("ce", "kl", "correct1", "correctk", "count")  # per depth, then 3 totals below


def build_head(arch: str, target, K: int, head: str, num_blocks: int | None):
    """A fresh float32 head for ``target``: ReDrafter (N = 2 blocks by default) or K Medusa
    heads (1 block each by default, initialised by ``MedusaHeads.for_target``).

    ReDrafter "shared" heads start with P = 0, i.e. uniform logits (LM(0) = 0), like the
    near-uniform start of an "own" output layer: from random P the target's LM head makes
    the first predictions large and wrong (SmolLM2: CE ≈ 17 nats per depth instead of
    ln V ≈ 10.8).
    """
    if arch == "redrafter":
        drafter = ReDrafterHead.for_target(target, num_blocks=2 if num_blocks is None else num_blocks, head=head)
        if head == "shared":
            with torch.no_grad():
                drafter.proj.weight.zero_()
        return drafter
    if arch == "medusa":
        return MedusaHeads.for_target(target, num_heads=K, num_blocks=1 if num_blocks is None else num_blocks,
                                      head=head)
    raise SpecdraftError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")


class HeadObjective(nn.Module):
    """The head and its loss as one module, so DDP sees one forward per micro-batch (its
    gradient hooks are armed in ``forward``) and mixed precision wraps all of it."""

    def __init__(self, head: nn.Module, K: int, kl_weight: float = 0.0, topk: int = 5,
                 compiled_loss: bool = False):
        """compiled_loss: the cross-entropy through torch.compile (``train.cross_entropy``)."""
        super().__init__()
        self.head = head
        self.K, self.kl_weight, self.topk, self.compiled_loss = K, kl_weight, topk, compiled_loss

    def depth_logits(self, hidden: torch.Tensor, inputs: torch.Tensor, window: tuple | None = None,
                     features: torch.Tensor | None = None, float32: bool = True):
        """Yield (i, logits (N, n_out)) for depth i = 0..K-1 at every row, labelled or not,
        float32 unless ``float32=False`` (then in the output layer's product dtype), over the
        head's output vocabulary (its draft vocabulary if it has one, else all V); labels
        must be in that space (``corpus.to_output_space``).
        hidden (N, d); inputs (N, K) long, the tokens fed at depths 0..K-1; window: the
        context windows (``corpus.PositionBatch.window``) for a head with context; features
        (N, n, d) the target's states after its feature layers, for a head that fuses them.

        Why every row: selecting the labelled rows first (~94% of them) gave each depth of
        each batch its own row count, and the CPU's matrix kernels (oneDNN) are built per
        shape: a training step ran 1.3-1.5× slower than at one shape per batch (docs/fit.md)."""
        head = self.head
        if getattr(head, "fuse", None) is not None:
            if features is None:
                raise SpecdraftError("a head with feature layers trains only through `specdraft fit`")
            hidden = head.fuse_features(hidden, features)
        if getattr(head, "context", None) is not None:
            if window is None:
                raise SpecdraftError("a head with context attention trains only through `specdraft fit`")
            hidden = head.contextualize(hidden, *window)
        if isinstance(head, MedusaHeads):
            for i in range(self.K):  # head i only sees h_t
                yield i, head.head_logits(i, hidden, float32)
            return
        embedded = head.embed_input(inputs)  # (N, K, d)
        bias = head.recurrence_bias(hidden)  # (N, d) or 0
        state = head.initial_state((inputs.shape[0],), device=inputs.device)
        for i in range(self.K):
            state = head.step_embedded(state, embedded[:, i] + bias)
            yield i, head.draft_logits(hidden, state, float32)

    def target_log_probs(self, states: torch.Tensor) -> torch.Tensor:
        """(n, N) float32: the target's next-token log-probabilities from its states (n, d),
        over the head's output vocabulary — with a draft vocabulary, restricted to it and
        renormalised (the head can put mass nowhere else)."""
        vocab = getattr(self.head, "draft_vocab", None)
        parts = self.head.parts
        logits = parts.rows_logits(states, vocab.ids()) if vocab is not None else parts.logits(states)
        return F.log_softmax(logits.float(), dim=-1)

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor,
                target_hidden: torch.Tensor | None, denom: torch.Tensor, window: tuple | None = None,
                features: torch.Tensor | None = None, target_present: torch.Tensor | None = None):
        """hidden (N, d) h_t; inputs, labels (N, K); target_hidden (N, K, d) the target's
        states that predict each label (for KL) or None; denom (K,) float normalisers;
        window, features as in ``depth_logits``; target_present (N, K) bool: where
        target_hidden holds a state (None: everywhere; KL counts only there).
        Returns the loss (scalar) and stats (K, 5): ce sum, kl sum, top-1 and top-k hits, count."""
        valid = labels != IGNORE
        stats = torch.zeros(self.K, len(STATS), device=hidden.device)
        # Every parameter enters the graph even when this micro-batch holds no label: DDP
        # expects a gradient for each parameter from every process.
        loss = sum(p.sum() for p in self.parameters()) * 0.0
        for i, logits in self.depth_logits(hidden, inputs, window, features, float32=False):
            ce, rank = cross_entropy_sum(logits, labels[:, i], self.compiled_loss)  # unlabelled rows add 0
            kl = torch.zeros((), device=hidden.device)
            if self.kl_weight and target_hidden is not None:
                rows = valid[:, i] if target_present is None else valid[:, i] & target_present[:, i]
                with torch.no_grad():
                    logp = self.target_log_probs(target_hidden[rows, i])
                logq = F.log_softmax(logits[rows].float(), dim=-1)
                kl = (logp.exp() * (logp - logq)).sum()
            loss = loss + (ce + self.kl_weight * kl) / denom[i]
            # top-1 / top-k hits from the label's rank (ties with the label count as hits;
            # an unlabelled row's rank is the vocabulary size: never a hit)
            stats[i] = torch.stack([ce.detach(), kl.detach(), (rank == 0).sum().float(),
                                    (rank < self.topk).sum().float(), valid[:, i].sum().float()])
        return loss, stats


# ---- held-out evaluation ------------------------------------------------------------------


class HeadEvaluator:
    """Scores a head on held-out examples, teacher-forced like training.

    Per depth i: CE, top-1 and top-k accuracy. And τ_L, the tokens per target forward a
    single greedy beam (W = 1) of length L gets, for L = 2..K+1, by replaying the engine's
    greedy walk over each answer (``train.walk``) with r_t = how many leading depths the
    head guesses right at t: on the target's own greedy answers, the engine's greedy τ at
    W = 1 (up to numerics: the walk does not run the target); on other text, the τ the
    engine would get if the target had written it. Each process scores every
    num_processes-th example; the sums are reduced."""

    def __init__(self, examples: list, target, K: int, batch_size: int, topk: int = 5):
        self.examples, self.target, self.K = examples, target, K
        self.batch_size, self.topk = batch_size, topk

    @torch.no_grad()
    def sums(self, model: "HeadObjective", rank: int = 0, world: int = 1) -> torch.Tensor:
        """(K, 4) per-depth [ce, top-1 hits, top-k hits, count], then (K, 2) [tokens, steps]
        of the walks at L = 2..K+1."""
        device, K = self.target.device, self.K
        per_depth = torch.zeros(K, 4, dtype=torch.float64)
        walks = torch.zeros(K, 2, dtype=torch.float64)
        mine = self.examples[rank::world]
        for start in range(0, len(mine), self.batch_size):
            examples = mine[start: start + self.batch_size]
            mb = collate(examples, K)
            ids, mask = mb.input_ids.to(device), mb.attention_mask.to(device)
            hidden = self.target.base(input_ids=ids, attention_mask=mask).last_hidden_state
            h = hidden[mb.rows.to(device), mb.cols.to(device)]
            labels = mb.labels.to(device)
            valid = labels != IGNORE
            right = torch.zeros_like(valid)
            for i, logits in model.depth_logits(h, mb.inputs.to(device)):
                ce, rank = cross_entropy_sum(logits, labels[:, i])  # the training loss's own CE and hit counts
                right[:, i] = rank == 0  # never at an unlabelled row (its rank is the vocabulary size)
                per_depth[i] += torch.tensor([ce.item(), (rank == 0).sum().item(), (rank < self.topk).sum().item(),
                                              valid[:, i].sum().item()], dtype=torch.float64)
            runs = torch.zeros(mb.input_ids.shape, dtype=torch.long)  # r_t; 0 where nothing is labelled
            runs[mb.rows, mb.cols] = right.long().cumprod(dim=1).sum(dim=1).cpu()
            for b, example in enumerate(examples):
                for first, last in labelled_spans(example.labels):
                    for j in range(1, K + 1):
                        walks[j - 1] += torch.tensor(greedy_walk(runs[b], first, last, j), dtype=torch.float64)
        return torch.cat([per_depth.flatten(), walks.flatten()])

    def __call__(self, accelerator, model: "HeadObjective") -> dict:
        return self.fields(reduced_sums(accelerator, model, lambda rank, world: self.sums(model, rank, world)))

    def fields(self, sums: torch.Tensor) -> dict:
        K = self.K
        per_depth, walks = sums[: 4 * K].view(K, 4).tolist(), sums[4 * K:].view(K, 2).tolist()
        out: dict = {}
        for i, (ce, c1, ck, n) in enumerate(per_depth):
            n = max(n, 1.0)
            out[f"eval_ce_{i}"] = round(ce / n, 4)
            out[f"eval_acc1_{i}"] = round(c1 / n, 4)
            out[f"eval_acc{self.topk}_{i}"] = round(ck / n, 4)
        for j, (tokens, steps) in enumerate(walks, 1):
            out[f"eval_tau_w1_l{j + 1}"] = round(tokens / max(steps, 1.0), 4)
        out["eval_tokens"] = int(walks[0][0])
        return out


class HeadTask(TargetStatesTask):
    """The model-specific half of ``common.train_loop`` for drafter heads."""

    bar_fields = ("loss", "acc1_0")

    def __init__(self, target, examples: ExampleSet, K: int, cache: HiddenCache | None, kl_weight: float = 0.0,
                 topk: int = 5, held_out: HeldOut | None = None):
        self.target, self.examples, self.K = target, examples, K
        self.cache, self.kl_weight, self.topk = cache, kl_weight, topk
        self.use_kl = bool(kl_weight)
        self.device = target.device
        self.held_out = held_out
        self.reset_totals()

    # -- data --
    def micro_batch(self, indices: list[int]) -> Batch:
        return collate([self.examples[i] for i in indices], self.K)

    def counts(self, mb: Batch) -> torch.Tensor:
        return mb.counts()

    def num_tokens(self, mb: Batch) -> int:
        return sum(mb.lengths)

    # -- the target --
    @torch.no_grad()
    def hidden(self, mb: Batch) -> torch.Tensor:
        """(B, T, d) the target's last hidden states (after its final norm), from the cache
        where every row is there, else from one target pass over the padded batch."""
        if self.cache is not None:
            rows = [self.cache.get(k, self.device) for k in mb.keys]
            if all(r is not None for r in rows):
                out = torch.zeros(len(rows), mb.input_ids.shape[1], self.target.hidden_size,
                                  dtype=rows[0].dtype, device=self.device)
                for b, r in enumerate(rows):
                    out[b, : r.shape[0]] = r
                return out
        start = time.perf_counter()
        ids, mask = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        hidden = self.target.base(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._totals += torch.tensor([time.perf_counter() - start, float(sum(mb.lengths)), 0.0])
        if self.cache is not None:
            for b, (key, n) in enumerate(zip(mb.keys, mb.lengths)):
                self.cache.put(key, hidden[b, :n])
        return hidden

    # -- the loss --
    def loss(self, model, mb: Batch, denom: torch.Tensor):
        hidden = self.hidden(mb)
        rows, cols = mb.rows.to(self.device), mb.cols.to(self.device)
        target_hidden = None
        if self.use_kl:
            tcols = mb.target_cols.to(self.device)
            target_hidden = hidden[rows[:, None], tcols.clamp(min=0)]  # (N, K, d); -1 entries are unlabelled
        loss, stats = model(hidden[rows, cols], mb.inputs.to(self.device), mb.labels.to(self.device),
                            target_hidden, denom)
        return loss, self.with_totals(stats, mb.lengths)

    def log_fields(self, stats: torch.Tensor, seconds: float, num_processes: int) -> dict:
        """Loss, per-depth CE / KL / top-1 / top-k accuracy, and throughput, from summed stats."""
        per = stats[: self.K * len(STATS)].view(self.K, len(STATS)).tolist()
        target_s, target_tok, tokens = stats[self.K * len(STATS):].tolist()
        fields: dict = {}
        loss = 0.0
        for i, (ce, kl, c1, ck, n) in enumerate(per):
            n = max(n, 1.0)
            loss += (ce + self.kl_weight * kl) / n
            fields[f"ce_{i}"] = round(ce / n, 4)
            if self.use_kl:
                fields[f"kl_{i}"] = round(kl / n, 4)
            fields[f"acc1_{i}"] = round(c1 / n, 4)
            fields[f"acc{self.topk}_{i}"] = round(ck / n, 4)
        fields["loss"] = round(loss, 4)
        fields["labels"] = int(sum(p[4] for p in per))
        per_process = seconds * num_processes
        if target_s > 0:
            fields["target_tokens_per_s"] = round(target_tok / target_s, 1)  # per process
        head_s = per_process - target_s
        if head_s > 0:
            fields["head_tokens_per_s"] = round(tokens / head_s, 1)  # per process, target time excluded
        if self.held_out is not None:
            fields.update(self.held_out.at_log())
        return fields


# ---- the command ------------------------------------------------------------------------


def run(config: HeadTrainConfig) -> int:
    """Train a head as ``config`` says; returns the exit code."""
    from accelerate.utils import set_seed

    check_config(config)
    out = Path(config.out)
    accelerator = make_accelerator(cpu=config.device == "cpu", mixed_precision=config.mixed_precision)
    main = accelerator.is_main_process
    resume_from = resume_point(out, config.resume)
    target = load_target_for(config, accelerator)
    examples = load_examples(config.data, target.tokenizer, seq_len=config.seq_len, K=config.future_tokens,
                             eos_ids=target.eos_ids, limit=config.limit, heldout_fraction=config.heldout_fraction)
    if config.kl_weight and "next-k" in examples.describe.get("kinds", []):
        raise SpecdraftError("--kl-weight needs teacher-forced data (ShareGPT or response records); "
                             "next-k records have no target distribution along their chains")
    plan = Plan(len(examples), config.batch_size, config.grad_accum, accelerator.num_processes, config.epochs,
                config.max_steps, config.seed)
    set_seed(config.seed)
    model = HeadObjective(build_head(config.arch, target, config.future_tokens, config.head, config.num_blocks),
                          config.future_tokens, config.kl_weight, config.topk)
    if not any(p.requires_grad for p in model.parameters()):
        raise SpecdraftError(f"a {config.head} {config.arch} head with {config.num_blocks} blocks has no trainable parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = cosine_schedule(optimizer, plan.total_steps, config.warmup)
    # The scheduler is stepped by the loop itself (accelerate's wrapper would step it once
    # per process), and saved as a registered object.
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState(run_signature(config, plan, examples))
    accelerator.register_for_checkpointing(scheduler, state)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
    cache = open_hidden_cache(config, accelerator, target, examples)
    held = heldout_examples(config, target)
    record = {**run_record(config, plan, examples), "heldout_examples": len(held)}
    save = lambda name: (save_final(accelerator.unwrap_model(model).head, out / name, record, state),  # noqa: E731
                         config.arch)
    eval_log = JsonLog(out, state.step, main, name=EVAL_LOG)  # evaluations, trimmed on resume like the log
    held_out = None
    if held:
        evaluator = HeadEvaluator(held, target, config.future_tokens, config.batch_size, config.topk)
        keep_best = KeepBest(out, f"eval_tau_w1_l{config.future_tokens + 1}", save, state, resume_from is not None,
                             main)  # OUT/best: the head at its best held-out τ
        held_out = HeldOut(lambda: evaluator(accelerator, accelerator.unwrap_model(model)), config.eval_every, state,
                           plan.total_steps, eval_log, keep_best)
    task = HeadTask(target, examples, config.future_tokens, cache, kl_weight=config.kl_weight, topk=config.topk,
                    held_out=held_out)
    if main:
        announce(config, out, record, plan, state, resumed=resume_from is not None)
    if resume_from is None and held_out is not None:
        first = held_out.first()
        if main:
            print(f"specdraft: before training, on {len(held)} held-out sequences: "
                  f"{summarise_eval(first, config.future_tokens)}", file=sys.stderr)
    opts = loop_options(config, out)
    finished = train_loop(accelerator, task, model, optimizer, scheduler, plan, state, opts)
    return finish_run(accelerator, main, finished, state, plan, lambda: save("final"), config.resume_hint)


def heldout_examples(config, target) -> list:
    """``--eval-data``: the first --eval-examples sequences of a distill file (all of it is
    held out: give one the training never saw), or of ShareGPT's held-out split."""
    if not config.eval_data:
        return []
    held = load_examples(config.eval_data, target.tokenizer, seq_len=config.seq_len, K=config.future_tokens,
                         eos_ids=target.eos_ids, limit=config.eval_examples, heldout_fraction=config.heldout_fraction,
                         split="heldout")
    return [held[i] for i in range(len(held))]


def summarise_eval(found: dict, K: int) -> str:
    accs = " / ".join(f"{found[f'eval_acc1_{i}']:.3f}" for i in range(K))
    return f"top-1 accuracy {accs} at depths 1-{K}, estimated τ (W=1, L={K + 1}) {found[f'eval_tau_w1_l{K + 1}']:.3f}"


def announce(config, out: Path, record: dict, plan: Plan, state: TrainState, resumed: bool) -> None:
    """Write OUT/train_args.json and say what is about to happen (main process)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_args.json").write_text(json.dumps(record, indent=2, default=str))
    where = (f", resuming at step {state.step}" if resumed else
             " (no checkpoint to resume: starting from scratch)" if config.resume else "")
    print(f"specdraft: training {config.arch} ({config.head} head, K={config.future_tokens}) on {plan.num_examples} "
          f"examples, {plan.total_steps} steps{where}", file=sys.stderr)


def check_config(config: HeadTrainConfig) -> None:
    for name in ("future_tokens", "batch_size", "grad_accum", "epochs", "seq_len", "save_every", "log_every", "topk"):
        if getattr(config, name) < 1:
            raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.seq_len < 2:
        raise SpecdraftError(f"--seq-len must be >= 2, got {config.seq_len}")
    if not config.lr > 0 or not 0 <= config.warmup < 1 or config.kl_weight < 0:
        raise SpecdraftError("need --lr > 0, 0 <= --warmup < 1 and --kl-weight >= 0")
    if config.limit is not None and config.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {config.limit}")
    if config.eval_every < 0 or config.eval_examples < 1:
        raise SpecdraftError(f"need --eval-every >= 0 and --eval-examples >= 1, got {config.eval_every} and "
                             f"{config.eval_examples}")


def run_signature(config, plan: Plan, examples: ExampleSet) -> dict:
    """Everything a resumed run must share with the run it continues."""
    return {**plan.signature(), "data": examples.fingerprint(), "seq_len": config.seq_len, "arch": config.arch,
            "head": config.head, "K": config.future_tokens, "num_blocks": config.num_blocks, "epochs": config.epochs,
            "max_steps": config.max_steps, "lr": config.lr, "kl_weight": config.kl_weight, "target": config.target}


def run_record(config, plan: Plan, examples: ExampleSet) -> dict:
    """What the saved head's config records about its training."""
    options = asdict(config)
    return {"argv": list(sys.argv), "options": options, "data": examples.describe, "plan": describe(plan)}


def save_final(head, folder: Path, record: dict, state: TrainState) -> Path:
    """The trained head through ``redrafter.io`` (loadable as --drafter ARCH:FOLDER), with
    its training recorded under "training" in config.json (ignored when loading)."""
    from ..checkpoint import CONFIG

    head.save(folder)
    path = folder / CONFIG
    config = json.loads(path.read_text())
    config["training"] = {**record, "steps": state.step, "tokens": state.tokens}
    path.write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    return folder
