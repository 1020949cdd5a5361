"""``specdraft train draft`` itself: the data, the draft, the objective and the schedule put
together on ``common.train_loop``, and the final folder (``export.save_draft``) with every
stage's record in its specdraft.json."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ...drafters.draft_folder import save_vocab
from ..best import KeepBest
from ..configs import DraftTrainConfig
from ..common import (HeldOut, JsonLog, Plan, TrainState, cosine_schedule, describe, finish_run,
                      load_target_for, loop_options, make_accelerator, open_hidden_cache, train_loop)
from ..resume import resume_point
from .checks import check_config, parse_layers
from .data import answer_vocabulary, eval_examples_from, finetune_data, pretrain_data
from .evaluate import Evaluator
from .export import save_draft
from .model import borrow_embeddings, build_draft, load_draft
from .objective import DraftObjective
from .shape import DraftShape, TargetFacts, choose_shape, shape_of
from .task import DraftTask

STAGES = ("pretrain", "finetune")
EVAL_LOG = "eval.jsonl"
LATEST = "latest"  # the draft as it stands when a run stops mid-schedule
DEFAULT_LR = {"pretrain": 1e-3, "finetune": 3e-4}


@dataclass
class BuiltDraft:
    """The draft to train and where it came from (train_args.json and the final
    specdraft.json record it)."""

    model: nn.Module  # float32, on the target's device
    shape: DraftShape
    how: str  # how the shape was chosen
    init: dict  # its initialisation, or the folder it continues
    history: list  # the continued folder's earlier stages ([] for a new draft)
    borrow: bool  # embedding matrices borrowed from the target (frozen, not saved)
    vocab: object  # the DraftVocab of --draft-vocab, else None
    vocab_coverage: float | None  # share of the training answer tokens inside ``vocab``
    parameters: int  # its own parameters (borrowed matrices not counted)


def training_data(config, target) -> tuple:
    """(training set, held-out examples (at most --eval-examples), the data's description)."""
    if config.stage == "pretrain":
        train, held, data_describe = pretrain_data(config, target)
    else:
        train, held, data_describe = finetune_data(config, target)
    if config.eval_data:
        held = eval_examples_from(config.eval_data, config, target)
    return train, held[: config.eval_examples], data_describe


def prepare_draft(config, target, facts: TargetFacts, copy_layers: list[int] | None, train) -> BuiltDraft:
    """The draft: continued from a folder, or built (the same way on every process and
    rerun), with the target's embeddings if borrowed and its vocabulary if --draft-vocab."""
    from ...drafters.draft_folder import shared_parameters
    from ...models import parameter_count

    history: list = []
    if config.draft:
        draft, meta = load_draft(config.draft, target)
        history = list(meta.get("stages", []))
        shape, how = shape_of(draft), f"from {config.draft}"
        init = {"source": str(config.draft), **(meta.get("init") or {})}
    else:
        shape, how = choose_shape(facts, layers=config.layers, hidden=config.hidden, heads=config.heads,
                                  kv_heads=config.kv_heads, intermediate=config.intermediate, tie=config.tie_embeddings,
                                  copy_layers=copy_layers, max_fraction=config.max_fraction)
        draft = build_draft(target, shape, from_target=config.init_from_target, copy_layers=copy_layers, seed=config.seed)
        init = {"from_target": bool(config.init_from_target or copy_layers), "copy_layers": copy_layers,
                "seed": config.seed}
    borrow = bool(config.embeddings == "target" or (config.draft and meta.get("embeddings") == "target"))
    if borrow:
        borrow_embeddings(draft, target, facts)
    vocab, vocab_coverage = answer_vocabulary(train, target, config.draft_vocab) if config.draft_vocab else (None, None)
    own = parameter_count(draft) - shared_parameters(draft)
    draft.to(target.device)
    return BuiltDraft(draft, shape, how, init, history, borrow, vocab, vocab_coverage, own)


def run_signature(config, plan: Plan, train, draft: BuiltDraft, lr: float, loss_name: str) -> dict:
    """What a checkpoint must have been made with to be resumed (``TrainState``)."""
    tvdpp = loss_name == "tvdpp"
    return {**plan.signature(), "data": train.fingerprint(), "stage": config.stage, "seq_len": config.seq_len,
            "loss": loss_name, "variant": config.tvdpp_variant if tvdpp else None,
            "samples": config.tvdpp_samples if tvdpp and config.tvdpp_variant == "sampled" else None,
            "temperature": config.temperature, "epochs": config.epochs, "max_steps": config.max_steps, "lr": lr,
            "on_policy": config.on_policy_tokens if config.on_policy else 0, "target": config.target,
            "shape": asdict(draft.shape), "init": draft.init, "embeddings": "target" if draft.borrow else "own"}


def run_record(config, lr: float, data_describe: dict, plan: Plan, draft: BuiltDraft, facts: TargetFacts,
               heldout_examples: int) -> dict:
    """OUT/train_args.json: the command line, the options (with the learning rate used), the
    data, the plan and the draft's shape."""
    options = asdict(config)
    return {"argv": list(sys.argv), "options": {**options, "lr": lr}, "data": data_describe, "plan": describe(plan),
            "shape": asdict(draft.shape), "shape_choice": draft.how, "parameters": draft.parameters,
            "target_parameters": facts.parameters, "heldout_examples": heldout_examples}


def scheduled_evaluation(config, held: list, target, facts: TargetFacts, draft: BuiltDraft, accelerator, model,
                         state: TrainState, plan: Plan, keep_best=None) -> HeldOut | None:
    """Held-out scoring on the training schedule (None without held-out examples), written
    to OUT/eval.jsonl and handed to ``keep_best`` (``best.KeepBest``: OUT/best)."""
    evaluator = Evaluator(held, target, batch_size=config.batch_size, chunk=config.loss_chunk, gamma=config.gamma,
                          target_parameters=facts.parameters, vocab=draft.vocab) if held else None
    # Made even without an evaluator: it trims entries past the resumed step, like the log.
    eval_log = JsonLog(Path(config.out), state.step, accelerator.is_main_process, name=EVAL_LOG)
    if evaluator is None:
        return None
    return HeldOut(lambda: evaluator(accelerator, accelerator.unwrap_model(model).draft), config.eval_every,
                   state, plan.total_steps, eval_log, keep_best)


def announce(config, draft: BuiltDraft, facts: TargetFacts, loss_name: str, sizes: tuple[int, int], plan: Plan,
             resumed_at: int | None) -> None:
    """The run in a few lines on stderr: the draft, its embeddings and vocabulary, the
    stage and its data (``sizes``: training and held-out sequences)."""
    where = f", resuming at step {resumed_at}" if resumed_at is not None else ""
    print(f"specdraft: draft model: {draft.shape.summary(facts.vocab, facts.parameters)} ({draft.how})",
          file=sys.stderr)
    if draft.borrow:
        print(f"specdraft: embeddings borrowed from the target: {draft.parameters / 1e6:.2f}M parameters of its own "
              f"({100 * draft.parameters / facts.parameters:.2f}% of the target)", file=sys.stderr)
    if draft.vocab is not None:
        print(f"specdraft: draft vocabulary of {draft.vocab.size} tokens: {100 * draft.vocab_coverage:.1f}% of the "
              f"training answer tokens", file=sys.stderr)
    print(f"specdraft: {config.stage} ({loss_name}{'/' + config.tvdpp_variant if loss_name == 'tvdpp' else ''}) "
          f"on {sizes[0]} sequences, {sizes[1]} held out, {plan.total_steps} steps{where}", file=sys.stderr)


def score_before_training(held_out: HeldOut, main: bool) -> None:
    """The first held-out score (step 0), said on stderr."""
    first = held_out.first()
    if main and first:
        print(f"specdraft: before training: held-out acceptance {first['eval_accept']:.3f} (greedy "
              f"{first['eval_greedy_accept']:.3f}), CE {first['eval_ce']:.3f}", file=sys.stderr)


def save_final(config, out: Path, trained, target, draft: BuiltDraft, facts: TargetFacts, state: TrainState,
               record: dict, loss_name: str, name: str = "final") -> tuple[Path, str]:
    """OUT/final (or OUT/``name``): the trained draft (``trained``), its vocabulary, and a
    specdraft.json whose stages are the continued folder's and this one (with its last
    evaluation)."""
    from ...checkpoint import target_signature

    last = {}
    if (out / EVAL_LOG).is_file():
        lines = (out / EVAL_LOG).read_text().splitlines()
        last = json.loads(lines[-1]) if lines else {}
    stage = {"stage": config.stage, "loss": loss_name, "on_policy": bool(config.on_policy),
             "tvdpp_variant": config.tvdpp_variant if loss_name == "tvdpp" else None, "data": record["data"],
             "steps": state.step, "tokens": state.tokens, "options": record["options"], "argv": record["argv"],
             "eval": last}
    vocab, n_draft = draft.vocab, draft.parameters
    meta = {"format": 1, "kind": "draft-model", "target": target_signature(target),
            "embeddings": "target" if draft.borrow else "own",
            "draft_vocab": {"size": vocab.size, "coverage": draft.vocab_coverage} if vocab is not None else None,
            "target_parameters": facts.parameters, "parameters": n_draft,
            "fraction": round(n_draft / facts.parameters, 5), "shape": asdict(draft.shape), "init": draft.init,
            "stages": draft.history + [stage]}
    final = save_draft(trained, target.tokenizer, out / name, meta, dtype=config.save_dtype)
    if vocab is not None:
        save_vocab(vocab, final)
    return final, "draft"


def run(config: DraftTrainConfig, target=None) -> int:
    """Train one stage as ``config`` says; returns the exit code. ``target``: the target
    already loaded (``specdraft fit``), else loaded here."""
    from accelerate.utils import set_seed

    check_config(config)
    copy_layers = parse_layers(config.copy_layers)
    out = Path(config.out)
    accelerator = make_accelerator(cpu=config.device == "cpu", mixed_precision=config.mixed_precision)
    main = accelerator.is_main_process
    resume_from = resume_point(out, config.resume)
    target = target if target is not None else load_target_for(config, accelerator)
    facts = TargetFacts.of(target)
    train, held, data_describe = training_data(config, target)
    draft = prepare_draft(config, target, facts, copy_layers, train)

    plan = Plan(len(train), config.batch_size, config.grad_accum, accelerator.num_processes, config.epochs,
                config.max_steps, config.seed)
    set_seed(config.seed)
    lr = config.lr if config.lr is not None else DEFAULT_LR[config.stage]
    loss_name = "ce" if config.stage == "pretrain" else config.loss
    model = DraftObjective(draft.model, config.stage, loss_name, config.tvdpp_variant, config.tvdpp_samples,
                           config.temperature, config.loss_chunk, target_logits=target.logits, vocab=draft.vocab)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=config.weight_decay)
    scheduler = cosine_schedule(optimizer, plan.total_steps, config.warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState(run_signature(config, plan, train, draft, lr, loss_name))
    accelerator.register_for_checkpointing(scheduler, state)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
    cache = open_hidden_cache(config, accelerator, target, train) if config.stage == "finetune" else None

    record = run_record(config, lr, data_describe, plan, draft, facts, len(held))
    save = lambda name: save_final(config, out, accelerator.unwrap_model(model).draft, target, draft, facts,  # noqa: E731
                                   state, record, loss_name, name)
    keep_best = KeepBest(out, f"eval_tau_walk_g{config.gamma}", save, state, resume_from is not None, main)
    held_out = scheduled_evaluation(config, held, target, facts, draft, accelerator, model, state, plan, keep_best)
    task = DraftTask(config.stage, train, target, cache, accelerator=accelerator, model=model, held_out=held_out,
                     on_policy_tokens=config.on_policy_tokens if config.on_policy else 0, seq_len=config.seq_len)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_args.json").write_text(json.dumps(record, indent=2, default=str))
        announce(config, draft, facts, loss_name, (len(train), len(held)), plan,
                 state.step if resume_from is not None else None)
    if resume_from is None and held_out is not None:
        score_before_training(held_out, main)
    opts = loop_options(config, out)
    finished = train_loop(accelerator, task, model, optimizer, scheduler, plan, state, opts)
    if keep_best.describe():
        print(f"specdraft: {keep_best.describe()}", file=sys.stderr)
    return finish_run(accelerator, main, finished, state, plan, lambda: save("final"), config.resume_hint,
                      save_latest=lambda: save(LATEST))
