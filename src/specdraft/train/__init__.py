"""Training drafters on a frozen target, through Hugging Face accelerate.

- ``common``: the loop (data plan, exact resumption, checkpoints, JSONL log, progress bar)
- ``examples``: training examples (ShareGPT / distill files) and position-level batches
- ``hidden_cache``: on-disk cache of the target's hidden states (safetensors shards)
- ``configs``: the trainers' configuration objects (``HeadTrainConfig``, ``DraftTrainConfig``)
- ``heads``: ``specdraft train redrafter`` (ReDrafter and Medusa heads)
- ``draft``: ``specdraft train draft`` (an independent draft model; a package, one module
  per concern)
- ``corpus``, ``fit``, ``fit_eval``: ``specdraft fit`` (the position corpus, the pipeline,
  its held-out scoring)

See docs/training.md.
"""

from .configs import DraftTrainConfig, HeadTrainConfig, LoopConfig
from .draft import run as train_draft
from .heads import run as train_head

__all__ = ["DraftTrainConfig", "HeadTrainConfig", "LoopConfig", "train_draft", "train_head"]
