"""``specdraft fit --drafter draft``: the direct-alignment draft model in one resumable command.

Stages, each resumable (the same command continues where a run stopped):

    1. heldout   OUT/heldout.jsonl: the target's own greedy answers to held-out ShareGPT
                 prompts (``fit_stages.heldout_answers``, shared with the heads' fit): the draft
                 is scored on them, so the walk's τ is the engine's greedy τ there
    2. train     OUT/train: ``train draft --stage finetune`` (``draft.command.run``) on the
                 training conversations (every turn, assistant tokens), distillation with
                 ``loss`` against the target's distributions. The target's hidden states
                 are computed on the first pass over each conversation and kept in
                 OUT/hidden-cache (the target's dtype: bfloat16 where the CPU has it), so
                 later epochs and reruns never run the target again. With ``on_policy`` the
                 sequences are instead each conversation's first prompt continued by the
                 draft itself (``on_policy_tokens``, sampled every step), scored by one target
                 pass (no cache: they change every step). Checkpoints every
                 ``save_every_seconds``; the budget stops it with a checkpoint
    3. final     OUT/final (written by the trainer when the schedule ends): loadable as
                 ``draft:OUT/final``, as transformers' ``assistant_model`` (full
                 vocabulary export: ``specdraft export hf``). A run stopped before
                 (budget, Ctrl-C, SIGTERM) leaves the draft as it stands in OUT/latest

The draft starts from (first that applies): ``init_from`` (a draft folder, or "default":
the draft shipped for the default target), ``copy_layers`` (those target layers at full
width, the target's embeddings borrowed: nothing to pretrain), else the target's
embeddings projected onto the default small shape (``draft.model.init_from_target``).
OUT/curve.jsonl and OUT/curve.png: held-out greedy τ (the walk, γ = 1..gamma) and the
acceptance rate against training tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from .configs import DraftTrainConfig


def draft_config(config, heldout: Path, deadline: float | None) -> DraftTrainConfig:
    """The trainer's configuration for a fit ``config`` (``fit_config.FitConfig``)."""
    from ..drafters.registry import checkpoint_path

    init_from = checkpoint_path("draft", config.init_from) if config.init_from else None
    copy = None if init_from else config.copy_layers
    return DraftTrainConfig(
        out=str(Path(config.out) / "train"), stage="finetune", target=config.target, device=config.device,
        dtype=config.dtype, trust_remote_code=config.trust_remote_code, data=config.data,
        data_offset=config.data_offset, seq_len=config.seq_len, epochs=config.epochs, max_steps=config.max_steps,
        batch_size=config.batch_sequences, lr=config.lr, warmup=config.warmup, weight_decay=config.weight_decay,
        seed=config.seed, eval_every=config.eval_every, eval_data=str(heldout), eval_examples=config.heldout_prompts,
        # On-policy sequences change every step: nothing of the target's to cache.
        hidden_cache=None if config.on_policy else str(Path(config.out) / "hidden-cache"),
        on_policy=config.on_policy, on_policy_tokens=config.on_policy_tokens,
        # bfloat16 autocast where the target runs bfloat16 (the CPUs with native bf16, GPUs)
        mixed_precision="bf16" if config.dtype == "bfloat16" else "no",
        resume=True, save_every=10**9, save_every_seconds=config.save_every_seconds, deadline=deadline,
        no_progress=not config.progress, stop_after_steps=config.stop_after_steps,
        resume_hint=f"run the same specdraft fit command, --out {config.out}, to continue",
        draft=init_from, copy_layers=copy, embeddings="target" if copy else "own",
        init_from_target=not init_from and not copy, draft_vocab=config.draft_vocab, loss=config.loss,
        gamma=config.gamma, save_dtype="bfloat16")


def fit_draft(config, target, budget) -> int:
    """All stages for a draft model; returns the exit code (0 also when the budget stopped it)."""
    from .best import BEST
    from .draft.command import EVAL_LOG, LATEST, run
    from .fit_stages import heldout_answers, say, sigterm_as_interrupt

    out = Path(config.out)
    heldout = Path(config.heldout_data) if config.heldout_data else out / "heldout.jsonl"
    try:
        with sigterm_as_interrupt():
            if not config.heldout_data:
                heldout_answers(config, target, heldout)
            code = run(draft_config(config, heldout, budget.deadline()), target=target)
    finally:  # an interrupted run (the trainer saved, then re-raised) gets its curve and links too
        write_curve(out, out / "train" / EVAL_LOG)
        for name in ("final", LATEST, BEST):
            if (out / "train" / name).is_dir() and not (out / name).exists():
                # Relative, so that the run folder can be moved; the trainer rewrites train/NAME.
                (out / name).symlink_to(Path("train") / name, target_is_directory=True)
    if (out / "final").is_dir():
        say(f"the draft is in {out / 'final'} (use --drafter draft:{out / 'final'})")
    return code


def write_curve(out: Path, eval_log: Path) -> None:
    """OUT/curve.jsonl (one line per held-out evaluation: step, training tokens, the walk's
    τ per γ, the acceptance rate) and OUT/curve.png."""
    if not eval_log.is_file():
        return
    rows = [json.loads(line) for line in eval_log.read_text().splitlines() if line.strip()]
    keep = ("step", "tokens", "eval_accept", "eval_greedy_accept", "eval_ce")
    rows = [{k: v for k, v in r.items() if k in keep or k.startswith("eval_tau_walk_g")} for r in rows]
    (out / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .fit_eval import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r.get("tokens", r["step"]) for r in rows]
    for key in sorted(k for k in rows[-1] if k.startswith("eval_tau_walk_g")):
        ax1.plot(x, [r.get(key) for r in rows], marker=".", label=f"γ={key.rsplit('g', 1)[1]}")
    ax2.plot(x, [r.get("eval_accept") for r in rows], marker=".", label="α (T = 1)")
    ax2.plot(x, [r.get("eval_greedy_accept") for r in rows], marker=".", label="greedy agreement")
    ax1.set(xlabel="training tokens", ylabel="held-out greedy τ", title="τ (engine's walk)")
    ax2.set(xlabel="training tokens", ylabel="per-token acceptance", title="acceptance")
    save_figure(fig, (ax1, ax2), out / "curve.png")
