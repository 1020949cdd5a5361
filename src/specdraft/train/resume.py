"""Training-state checkpoints: where they live, which is the latest complete one, and
saving one from every process (``accelerator.save_state``).

A run's folder holds ``checkpoints/step-NNNNNNNN/``; a save is complete once the main
process has written ``COMPLETE`` into it after every process saved its part, so a save cut
off half-way is never resumed from. (A drafter's own folder, config.json and
model.safetensors, is ``specdraft.checkpoint``'s, not this.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import SpecdraftError

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"  # written into a checkpoint folder once every process has saved


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def completed_checkpoints(out: Path) -> list[Path]:
    """The completed checkpoints of a run, oldest step first (an interrupted save is left out)."""
    root = Path(out) / CHECKPOINTS
    done = [p for p in root.glob("step-*") if (p / COMPLETE).is_file()] if root.is_dir() else []
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    """The completed checkpoint with the highest step, if any."""
    done = completed_checkpoints(out)
    return done[-1] if done else None


def save_training_state(accelerator, task, out: Path, step: int, keep: int) -> Path:
    """Every process saves its part; the main process marks it complete and removes all
    but the ``keep`` newest completed checkpoints."""
    task.sync(accelerator)
    folder = checkpoint_dir(out, step)
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (folder / COMPLETE).write_text(f"{step}\n")
        done = completed_checkpoints(out)
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return folder


def resume_point(out: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from; refuses to start over a run that has checkpoints."""
    latest = latest_checkpoint(out)
    if latest is not None and not resume:
        raise SpecdraftError(f"{out} already holds checkpoints; pass --resume to continue, or use another --out")
    return latest
