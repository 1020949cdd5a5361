"""``specdraft train draft``: an independent draft model for a target, by Direct Alignment
(Goel et al. 2024; BRIEF section 5): pretraining, then knowledge-distillation fine-tuning
on the target's own responses (``specdraft distill``).

The draft is a transformers ``LlamaForCausalLM`` with the target's tokenizer and
vocabulary, saved as a plain Hugging Face folder (config.json, model.safetensors,
tokenizer files, generation_config.json) plus ``specdraft.json`` (the target, the shape
and every training stage). It loads unchanged as ``--drafter draft:PATH``, as
transformers' ``assistant_model``, or in vLLM.

Stages (``--stage``):

- ``pretrain``: next-token cross-entropy on packed fixed-length sequences of plain text
  (``--text`` files/folders/globs, ``--data sharegpt`` conversations, ``--dataset`` a
  Hugging Face dataset). The target is loaded for its tokenizer, the initialisation and
  the held-out acceptance estimate only.
- ``finetune``: token-level distillation, ``--loss fkl|rkl|tvd|tvdpp`` (``train.losses``)
  between the frozen target's and the draft's full next-token distributions, at the
  positions whose next token is a response (assistant) token of a ``specdraft distill``
  file (or ShareGPT). The target's distributions come from its last hidden states, run on
  the fly or read from ``--hidden-cache`` (d floats per token instead of V), through its
  own LM head. ``--on-policy``: the data's prompts continued by the draft itself each
  step instead of the target's responses (DistillSpec), scored by the target.

Both run on ``train.common``'s loop (accelerate: one CPU to many GPUs, exact resumption,
checkpoints, JSONL log). Every ``--eval-every`` steps (and before the first and after the
last) the draft is scored against the target on held-out sequences: cross-entropy, KL,
the acceptance rate α = mean of 1 − TV(p, q) at temperature 1 (the per-token acceptance
probability of speculative sampling), the greedy acceptance (argmax agreement), the
i.i.d. block efficiency τ = (1 − α^(γ+1)) / (1 − α) at ``--gamma``, the memory-bound
speed-up τ / (1 + γ N_draft / N_target) (``bench.metrics.mbsu``), and the greedy τ at
γ = 1..gamma from the engine's walk replayed over the held-out answers (``train.walk``:
the engine's own greedy τ when they are the target's greedy answers).

Default size (docs/draft_model.md): 4 layers (the paper's drafter), the widest hidden
size that is a multiple of the target's head dimension, at most min(target hidden, 1024),
such that the draft has at most ``--max-fraction`` (10%) of the target's parameters;
embeddings tied if the target's are. SmolLM2-135M (134.5M): hidden 192, 3 heads / 1 KV
head, MLP 512, tied: 11.0M (8.2%; its 49152 × 192 embedding is 9.4M of it). Llama-2-7B:
hidden 1024, 8 heads, MLP 2816, untied: 116M (1.7%), the paper's 115M drafter.

Modules: ``shape`` (the target's facts, the draft's shape and its default), ``model``
(building, initialising, loading, borrowing embeddings), ``export`` (the saved folder),
``data`` (each stage's data, the draft vocabulary), ``batches`` (trained positions),
``objective`` (the loss), ``evaluate`` (held-out scores), ``task`` (the loop's
model-specific half), ``checks`` (the options) and ``command`` (``run``).
"""

from __future__ import annotations

from .batches import PositionBatch, collate_positions
from .checks import check_config, parse_layers
from .command import DEFAULT_LR, EVAL_LOG, STAGES, BuiltDraft, run
from .data import PackedSet, answer_vocabulary, eval_examples_from, finetune_data, pretrain_data
from .evaluate import EVAL_STATS, Evaluator
from .export import save_draft, standalone_draft
from .model import borrow_embeddings, build_draft, calibrate_output_scale, embedding_basis, init_from_target, load_draft
from .objective import STATS, DraftObjective, target_hidden
from .shape import (DEFAULT_LAYERS, MAX_DEFAULT_HIDDEN, DraftShape, TargetFacts, choose_shape, complete_shape,
                    draft_config, shape_of)
from ..common import TOTALS
from .task import DraftTask, prompt_of

__all__ = [
    "BuiltDraft", "DEFAULT_LAYERS", "DEFAULT_LR", "DraftObjective", "DraftShape", "DraftTask", "EVAL_LOG",
    "EVAL_STATS", "Evaluator", "MAX_DEFAULT_HIDDEN", "PackedSet", "PositionBatch", "STAGES", "STATS", "TOTALS",
    "TargetFacts", "answer_vocabulary", "borrow_embeddings", "build_draft", "calibrate_output_scale", "check_config",
    "choose_shape", "collate_positions", "complete_shape", "draft_config", "embedding_basis", "eval_examples_from",
    "finetune_data", "init_from_target", "load_draft", "parse_layers", "pretrain_data", "prompt_of", "run",
    "save_draft", "shape_of", "standalone_draft", "target_hidden",
]
