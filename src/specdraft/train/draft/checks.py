"""The ``train draft`` options' checks, beyond what argparse checks: run before any model
is loaded, so a bad command fails in a moment with one line."""

from __future__ import annotations

from ...errors import SpecdraftError


def parse_layers(text: str | None) -> list[int] | None:
    """``--copy-layers I,J,...`` as layer indices (None when not given)."""
    if not text:
        return None
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdraftError(f"--copy-layers must be comma-separated layer indices, got {text!r}") from None
    if not layers or any(i < 0 for i in layers):
        raise SpecdraftError(f"--copy-layers needs layer indices >= 0, got {text!r}")
    return layers


def check_config(config) -> None:
    """Raise a SpecdraftError for the first option out of range or clashing with another."""
    for name in ("batch_size", "grad_accum", "epochs", "save_every", "log_every", "eval_examples", "gamma",
                 "loss_chunk", "tvdpp_samples"):
        if getattr(config, name) < 1:
            raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.seq_len < 2:
        raise SpecdraftError(f"--seq-len must be >= 2, got {config.seq_len}")
    if config.eval_every < 0:
        raise SpecdraftError(f"--eval-every must be >= 0, got {config.eval_every}")
    if (config.lr is not None and not config.lr > 0) or not 0 <= config.warmup < 1:
        raise SpecdraftError("need --lr > 0 and 0 <= --warmup < 1")
    if not config.temperature > 0:
        raise SpecdraftError(f"--temperature must be > 0, got {config.temperature}")
    if not 0 < config.max_fraction <= 1:
        raise SpecdraftError(f"--max-fraction must be in (0, 1], got {config.max_fraction}")
    if config.limit is not None and config.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {config.limit}")
    if config.heldout_fraction is not None and not 0 <= config.heldout_fraction < 1:
        raise SpecdraftError(f"--heldout-fraction must be in [0, 1), got {config.heldout_fraction}")
    shape_given = any(getattr(config, k) is not None for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"))
    if config.draft and (shape_given or config.init_from_target or config.copy_layers):
        raise SpecdraftError("--draft PATH continues an existing draft: its shape and weights are given; drop "
                             "--layers/--hidden/--heads/--kv-heads/--intermediate/--init-from-target/--copy-layers")
    if config.draft_vocab < 0:
        raise SpecdraftError(f"--draft-vocab must be >= 0, got {config.draft_vocab}")
    if config.embeddings == "target" and not config.draft and not (config.copy_layers or config.init_from_target):
        raise SpecdraftError("--embeddings target needs --copy-layers or --init-from-target (the draft starts "
                             "from the target's matrix)")
    if config.stage == "pretrain" and config.hidden_cache:
        raise SpecdraftError("--hidden-cache is for --stage finetune (pretraining never runs the target)")
    if config.on_policy and (config.stage != "finetune" or config.hidden_cache):
        raise SpecdraftError("--on-policy is for --stage finetune, without --hidden-cache (the sequences change "
                             "every step)")
    if config.data_offset < 0 or (config.data_offset and config.stage != "finetune"):
        raise SpecdraftError(f"data-offset must be >= 0 and is for --stage finetune, got {config.data_offset}")
    if config.on_policy_tokens < 1:
        raise SpecdraftError(f"--on-policy-tokens must be >= 1, got {config.on_policy_tokens}")
