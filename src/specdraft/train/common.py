"""The training loop shared by specdraft's trainers: Hugging Face accelerate, exact
resumption, checkpoints, logs.

One command runs on one CPU, one GPU or many GPUs/nodes (``accelerate launch``; DDP):
each process sees ``batch_size`` examples per micro-batch, gradients are averaged over
processes, and ``grad_accum`` micro-batches make one optimizer step.

Data order is a pure function of (seed, epoch): ``Plan`` maps a global optimizer step to
the micro-batches and example indices every process uses, so the *data position* of a
run is its step count alone. A checkpoint (``accelerator.save_state``) holds the model's
trainable weights, optimizer, LR scheduler, RNG states and the ``TrainState`` (step,
tokens seen, the plan's signature); resuming from it replays nothing and skips nothing,
and on CPU gives bitwise the weights of an uninterrupted run (where checkpoints live and
which one is resumed: ``train.resume``).

A task (e.g. ``train.heads.HeadTask``) supplies the model-specific parts:
``micro_batch(indices)`` (data only), ``counts(micro)`` (per-loss-term token counts, summed
over the whole step and all processes to normalise the loss exactly, whatever the
accumulation or process split), ``loss(micro, denom)`` -> (loss, stats), ``sync()`` at
checkpoints/epoch ends, and ``log_fields(stats)`` for the logs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import SpecdraftError
from .hidden_cache import HiddenCache
from .resume import checkpoint_dir, save_training_state

LOG = "log.jsonl"


@dataclass
class Plan:
    """Which examples each process trains on at each optimizer step.

    An epoch is a seeded permutation of the examples, wrapped around to a multiple of the
    global micro-batch (batch_size x num_processes) so every process gets exactly
    batch_size examples per micro-batch; grad_accum micro-batches per optimizer step (the
    epoch's last step may have fewer).
    """

    num_examples: int
    batch_size: int
    grad_accum: int
    num_processes: int
    epochs: int
    max_steps: int | None
    seed: int

    def __post_init__(self):
        for name in ("num_examples", "batch_size", "grad_accum", "num_processes", "epochs"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise SpecdraftError(f"max steps must be >= 1, got {self.max_steps}")
        self._orders: dict[int, list[int]] = {}

    @property
    def global_micro(self) -> int:
        return self.batch_size * self.num_processes

    @property
    def micro_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.global_micro)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_per_epoch / self.grad_accum)

    @property
    def total_steps(self) -> int:
        total = self.epochs * self.steps_per_epoch
        return min(total, self.max_steps) if self.max_steps else total

    def signature(self) -> dict:
        """What must not change between a run and its resumption."""
        return {k: getattr(self, k) for k in ("num_examples", "batch_size", "grad_accum", "num_processes", "seed")}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            perm = torch.randperm(self.num_examples, generator=g).tolist()
            padded = self.micro_per_epoch * self.global_micro
            self._orders = {epoch: (perm * math.ceil(padded / len(perm)))[:padded]}  # keep one epoch cached
        return self._orders[epoch]

    def micro_batches(self, step: int) -> list[tuple[int, int]]:
        """(epoch, micro-batch index within the epoch) of the micro-batches of ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        first = k * self.grad_accum
        return [(epoch, m) for m in range(first, min(first + self.grad_accum, self.micro_per_epoch))]

    def indices(self, epoch: int, micro: int, rank: int) -> list[int]:
        start = micro * self.global_micro + rank * self.batch_size
        return self.order(epoch)[start: start + self.batch_size]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


class TrainState:
    """The loop's own counters, saved in every checkpoint (register_for_checkpointing)."""

    def __init__(self, plan_signature: dict):
        self.step = 0
        self.tokens = 0
        self.plan_signature = plan_signature
        self.interrupted = False  # set by train_loop on Ctrl-C / SIGTERM; never checkpointed

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "plan_signature": self.plan_signature}

    def load_state_dict(self, state: dict) -> None:
        if state["plan_signature"] != self.plan_signature:
            diff = {k: (state["plan_signature"].get(k), v) for k, v in self.plan_signature.items()
                    if state["plan_signature"].get(k) != v}
            raise SpecdraftError("cannot resume: the checkpoint was made with different data or batch settings "
                                 + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


@dataclass
class LoopOptions:
    out: Path
    save_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    stop_after_steps: int | None = None  # stop as if interrupted (a checkpoint is saved first)
    max_grad_norm: float | None = 1.0
    progress: bool = True
    save_every_seconds: float | None = None  # also checkpoint when this much time has passed
    resume_hint: str = "rerun with --resume to continue"  # what an interrupted run tells the user
    deadline: float | None = None  # time.monotonic() at which to checkpoint and stop


# ---- learning rate ----------------------------------------------------------------------


def cosine_schedule(optimizer, total_steps: int, warmup_ratio: float = 0.1):
    """Linear warmup over ceil(warmup_ratio x total) steps to the base LR, then cosine
    decay to 0 at ``total_steps``."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- logs -------------------------------------------------------------------------------


class JsonLog:
    """out/``name`` (default log.jsonl), one object per entry, main process only. On
    resume, entries after the resumed step (logged by the interrupted run past its last
    checkpoint) are dropped, so each step is logged once."""

    def __init__(self, out: Path, resume_step: int, enabled: bool, name: str = LOG):
        self.path = Path(out) / name
        self.enabled = enabled
        if not enabled:
            return
        kept = []
        if resume_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the crash
                if entry.get("step", 0) <= resume_step:
                    kept.append(line + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(kept))

    def write(self, entry: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


# ---- held-out evaluation ----------------------------------------------------------------


TOTALS = ("target_seconds", "target_tokens", "tokens")  # appended by TargetStatesTask.with_totals


class TargetStatesTask:
    """What the trainers that read the target's states (computed, or from a ``HiddenCache``)
    share: the running totals of target time, target tokens and trained tokens appended to
    their own stats, and making cached states visible to every process."""

    cache = None

    def reset_totals(self) -> None:
        self._totals = torch.zeros(len(TOTALS))

    def with_totals(self, stats: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(S,) or (K, S) stats -> flat stats + the totals since the last call (then reset)."""
        self._totals[2] += float(sum(lengths))
        totals = self._totals.to(stats.device)
        self.reset_totals()
        return torch.cat([stats.flatten(), totals])

    def sync(self, accelerator) -> None:
        """Make every process's cached states visible to all (checkpoints, epoch ends)."""
        if self.cache is not None:
            self.cache.flush()
            accelerator.wait_for_everyone()
            self.cache.refresh()


class HeldOut:
    """Held-out scoring on the training schedule: ``first()`` before the first step, then at
    the first logged step at or past each multiple of ``every`` (0: none) and at the last
    step. ``score()`` -> dict must be called by every process (its sums are reduced); each
    score is written to ``log`` (eval.jsonl) with its step and handed to ``keep_best``
    (``best.KeepBest``: OUT/best, the drafter at its best score)."""

    def __init__(self, score, every: int, state: TrainState, total_steps: int, log: JsonLog, keep_best=None):
        self.score, self.every, self.state, self.total_steps, self.log = score, every, state, total_steps, log
        self.keep_best = keep_best or (lambda found: None)
        self.next = (state.step // every + 1) * every if every else 0

    def first(self) -> dict:
        found = self.score()
        self.log.write({"step": 0, "tokens": self.state.tokens, **found})
        self.keep_best(found)
        return found

    def at_log(self) -> dict:
        """The scores if one is due at this (logged) step, else {}."""
        step = self.state.step
        if not ((self.every and step >= self.next) or step == self.total_steps):
            return {}
        found = self.score()
        if self.every:
            self.next = (step // self.every + 1) * self.every
        if found:
            self.log.write({"step": step, "tokens": self.state.tokens, **found})
            self.keep_best(found)
        return found


def reduced_sums(accelerator, module, sums) -> torch.Tensor:
    """``sums(rank, world)`` -> tensor, computed with ``module`` in eval mode (its mode is
    restored), summed over processes; float64 on the CPU."""
    was_training = module.training
    module.eval()
    try:
        local = sums(accelerator.process_index, accelerator.num_processes)
    finally:
        module.train(was_training)
    return accelerator.reduce(local.float().to(accelerator.device), "sum").double().cpu()


# ---- the loop ---------------------------------------------------------------------------


def make_accelerator(cpu: bool, mixed_precision: str = "no"):
    from accelerate import Accelerator

    return Accelerator(cpu=cpu, mixed_precision=mixed_precision)


def accumulate_gradients(accelerator, task, model, plan: Plan, step: int) -> tuple[torch.Tensor, list]:
    """Forward and backward over optimizer step ``step``'s micro-batches (this process's
    share); returns (the summed stats, the micro-batches)."""
    micros = [task.micro_batch(plan.indices(e, m, accelerator.process_index)) for e, m in plan.micro_batches(step)]
    # Normalisers over the whole step and all processes: every micro-batch's loss
    # is its sum of per-token terms divided by these (times the process count,
    # because DDP averages gradients over processes).
    denom = accelerator.reduce(sum(task.counts(mb) for mb in micros).to(accelerator.device), "sum")
    denom = denom.clamp(min=1).float() / accelerator.num_processes
    stats = None
    for j, mb in enumerate(micros):
        last = j == len(micros) - 1
        with nullcontext() if last else accelerator.no_sync(model):  # gradients sync once, on the last
            loss, mb_stats = task.loss(model, mb, denom)
            accelerator.backward(loss)
        stats = mb_stats if stats is None else stats + mb_stats
    return stats, micros


class LogWindow:
    """The stats summed since the last logged step, written to log.jsonl (main process)
    with the progress bar's postfix; the bar itself advances every step."""

    def __init__(self, accelerator, task, plan: Plan, state: TrainState, opts: LoopOptions):
        from tqdm.auto import tqdm

        main = accelerator.is_main_process
        self.accelerator, self.task = accelerator, task
        self.log = JsonLog(opts.out, state.step, main)
        self.bar = tqdm(total=plan.total_steps, initial=state.step, unit="step", desc="train",
                        disable=not (opts.progress and main), dynamic_ncols=True, file=sys.stderr)
        self.stats, self.start = None, time.perf_counter()

    def add(self, stats: torch.Tensor) -> None:
        self.stats = stats if self.stats is None else self.stats + stats
        self.bar.update(1)

    def write(self, state: TrainState, epoch: int, lr: float) -> None:
        """One log entry for the window (stats reduced over processes), then a new window."""
        seconds = time.perf_counter() - self.start
        fields = self.task.log_fields(self.accelerator.reduce(self.stats, "sum"), seconds,
                                      self.accelerator.num_processes)
        entry = {"step": state.step, "epoch": epoch, "lr": lr, "tokens": state.tokens, **fields,
                 "seconds": round(seconds, 3)}
        self.log.write(entry)
        self.bar.set_postfix({k: fields[k] for k in self.task.bar_fields if k in fields}, refresh=False)
        self.stats, self.start = None, time.perf_counter()

    def close(self) -> None:
        self.bar.close()


def clock_says(accelerator, opts: LoopOptions, last_save: float) -> tuple[bool, bool]:
    """(a timed checkpoint is due, the deadline has passed). Every process must agree on
    time-based decisions: the flags are reduced with max, so one process's clock is enough."""
    now = time.monotonic()
    timed = accelerator.reduce(torch.tensor([
        float(opts.save_every_seconds is not None and now - last_save >= opts.save_every_seconds),
        float(opts.deadline is not None and now >= opts.deadline)], device=accelerator.device), "max")
    return bool(timed[0]), bool(timed[1])


def train_loop(accelerator, task, model, optimizer, scheduler, plan: Plan, state: TrainState,
               opts: LoopOptions) -> bool:
    """Run optimizer steps from ``state.step`` to ``plan.total_steps``. Returns True when
    training finished, False when it stopped early (``stop_after_steps``, the deadline, or
    Ctrl-C / SIGTERM on a single process between steps; a checkpoint is saved each way).
    An interrupt sets ``state.interrupted`` and returns, so that ``finish_run`` still saves
    OUT/latest before it passes the interrupt on; anywhere else it propagates at once."""
    window = LogWindow(accelerator, task, plan, state, opts)
    stop_at = plan.total_steps if opts.stop_after_steps is None else min(plan.total_steps, opts.stop_after_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    updating = False  # True between optimizer.step() and the step count catching up
    last_save = time.monotonic()
    try:
        while state.step < stop_at:
            epoch = plan.epoch_of(state.step)
            stats, micros = accumulate_gradients(accelerator, task, model, plan, state.step)
            if opts.max_grad_norm:
                accelerator.clip_grad_norm_(params, opts.max_grad_norm)
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            updating = True
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            updating = False
            state.tokens += sum(task.num_tokens(mb) for mb in micros) * accelerator.num_processes
            window.add(stats)
            if state.step % opts.log_every == 0 or state.step == stop_at:
                window.write(state, epoch, lr)
            if plan.epoch_of(state.step) != epoch:
                task.sync(accelerator)
            save_due, out_of_time = clock_says(accelerator, opts, last_save)
            if state.step % opts.save_every == 0 or state.step == stop_at or save_due or out_of_time:
                save_training_state(accelerator, task, opts.out, state.step, opts.keep_checkpoints)
                last_save = time.monotonic()
            if out_of_time:
                break
    except KeyboardInterrupt:
        if accelerator.num_processes > 1 or state.step == 0 or updating:
            raise  # mid-update or across processes the state is not one we can save
        # Between steps the state is consistent: keep the work done so far.
        save_training_state(accelerator, task, opts.out, state.step, opts.keep_checkpoints)
        print(f"\nspecdraft: interrupted; saved {checkpoint_dir(opts.out, state.step)}", file=sys.stderr)
        state.interrupted = True
    finally:
        window.close()
    return state.step >= plan.total_steps


def describe(plan: Plan) -> dict:
    return {**asdict(plan), "steps_per_epoch": plan.steps_per_epoch, "total_steps": plan.total_steps}


def finish_run(accelerator, main: bool, finished: bool, state: TrainState, plan: Plan, save_final,
               resume_hint: str = "rerun with --resume to continue", save_latest=None) -> int:
    """End a training command: on the main process, ``save_final()`` (returning the final
    folder and the --drafter kind that loads it) when training finished, else say how to
    resume and, given ``save_latest`` (same return), save the drafter as it stands (a usable
    drafter mid-schedule; training goes on from the checkpoint); then wait for every
    process. Returns the exit code."""
    if main and finished:
        final, kind = save_final()
        print(f"specdraft: saved {final} (use --drafter {kind}:{final})", file=sys.stderr)
    elif main:
        print(f"specdraft: stopped at step {state.step} of {plan.total_steps}; {resume_hint}", file=sys.stderr)
        if save_latest is not None and state.step:
            latest, kind = save_latest()
            print(f"specdraft: the drafter as it stands is in {latest} (use --drafter {kind}:{latest})",
                  file=sys.stderr)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    # Left to interpreter exit, gloo's teardown raced its own threads: now and then a rank
    # aborted ("terminate called without an active exception") after the run had finished.
    accelerator.state.destroy_process_group()
    if state.interrupted:
        raise KeyboardInterrupt  # saved; the CLI reports the interrupt and its exit code
    return 0


# ---- the scaffold every trainer shares ---------------------------------------------------


def loop_options(config, out: Path) -> LoopOptions:
    """The loop's options from a trainer's ``configs.LoopConfig``."""
    return LoopOptions(out=out, save_every=config.save_every, keep_checkpoints=config.keep_checkpoints,
                       log_every=config.log_every, stop_after_steps=config.stop_after_steps,
                       max_grad_norm=config.max_grad_norm, progress=not config.no_progress,
                       save_every_seconds=config.save_every_seconds, resume_hint=config.resume_hint,
                       deadline=config.deadline)


def load_target_for(config, accelerator):
    """The frozen target on this process's device: under a launcher each process has its
    own (cuda:<local rank>), so the accelerator decides unless --device cpu."""
    from ..models import load_target, quiet_loading

    device = "cpu" if config.device == "cpu" else str(accelerator.device)
    if config.device.startswith("cuda") and accelerator.device.type != "cuda":
        raise SpecdraftError("--device cuda was asked for, but no CUDA device is available")
    with quiet_loading():
        return load_target(config.target, device, config.dtype, config.trust_remote_code)


def open_hidden_cache(config, accelerator, target, examples) -> HiddenCache | None:
    """The trainer's hidden-state cache (``config.hidden_cache``), or None; created by the
    main process, opened by each for its own shards."""
    from ..checkpoint import target_signature

    if not config.hidden_cache:
        return None

    manifest = {"target": target_signature(target), "dtype": str(target.dtype).replace("torch.", ""),
                "data": examples.fingerprint(), "seq_len": config.seq_len, "format": 1}
    if accelerator.is_main_process:
        HiddenCache.create(config.hidden_cache, manifest)
    accelerator.wait_for_everyone()
    return HiddenCache(config.hidden_cache, manifest, rank=accelerator.process_index)
