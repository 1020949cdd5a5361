"""Export a ReDrafter checkpoint to the TensorRT-LLM ReDrafter drafter layout.

TensorRT-LLM (legacy ReDrafter path) reads the drafter in the reference's parameter
names, with a config of hidden_size, exit_dim, num_draft_layers, rnn, vocab_size:

    specdraft                                 TensorRT-LLM
    blocks.{l}.linear.weight (2d, 2d)    ->   lm_head.{l}.linear.weight
    blocks.{l}.linear.bias   (2d,)       ->   lm_head.{l}.linear.bias
    out.weight               (V, 2d)     ->   lm_head.{N}.weight          (head "own")
    LM.weight @ proj.weight  (V, 2d)     ->   lm_head.{N}.weight          (head "shared")
    rnn_u.weight (d, d), rnn_u.bias (d,) ->   rnn_u.weight, rnn_u.bias
    rnn_w.weight (d, d)                  ->   rnn_w.weight

    config: hidden_size = d, exit_dim = 2d, num_draft_layers = N, rnn = true, vocab_size = V

The layout has no "shared head": its output layer is one explicit 2d → V matrix. A
"shared" checkpoint is folded, V·z = LM·(P·z) with LM the target's LM head weight
(V, d) and P the projection (d, 2d), so the exported file holds a V×2d matrix the
specdraft checkpoint did not (e.g. 49152 × 1152 floats ≈ 226 MB in fp32 for SmolLM2,
against a 2.5 MB projection). Folding is exact only for a plain linear head: a target
with a final-logit softcap or an LM-head bias cannot be exported this way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import CONFIG, WEIGHTS, load_weights, read_config
from ..errors import SpecdraftError
from .config import ReDrafterConfig


def trtllm_state(config: ReDrafterConfig, state: dict[str, torch.Tensor],
                 lm_head_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rename (and for head "shared" fold) a specdraft ReDrafter state dict."""
    N = config.num_blocks
    out = {"rnn_w.weight": state["rnn_w.weight"], "rnn_u.weight": state["rnn_u.weight"],
           "rnn_u.bias": state["rnn_u.bias"]}
    for l in range(N):
        out[f"lm_head.{l}.linear.weight"] = state[f"blocks.{l}.linear.weight"]
        out[f"lm_head.{l}.linear.bias"] = state[f"blocks.{l}.linear.bias"]
    if config.head == "own":
        out[f"lm_head.{N}.weight"] = state["out.weight"]
    else:
        if lm_head_weight is None:
            raise SpecdraftError("exporting a shared-head ReDrafter needs the target's LM head weight")
        proj = state["proj.weight"]
        # Fold in float32 (then back to the head's dtype) so the product is not rounded twice.
        out[f"lm_head.{N}.weight"] = (lm_head_weight.float() @ proj.float()).to(proj.dtype)
    return out


def trtllm_config(config: ReDrafterConfig) -> dict:
    d = config.hidden_size
    return {"hidden_size": d, "exit_dim": 2 * d, "num_draft_layers": config.num_blocks, "rnn": True,
            "vocab_size": config.vocab_size}


def export_trtllm(checkpoint_dir: str | Path, out_dir: str | Path, target=None) -> Path:
    """Write ``out_dir``/model.safetensors + config.json in TensorRT-LLM's ReDrafter layout.

    ``target`` (a ``specdraft.models.Target``) is needed only for a "shared" head; when
    not given it is loaded from the name recorded in the checkpoint. Returns out_dir.
    """
    from safetensors.torch import save_file

    from .io import check_compatible, check_state, read_head_config
    from .model import ReDrafterHead

    config = read_head_config(checkpoint_dir, ReDrafterConfig)
    if config.draft_vocab:
        # The layout's output layer is exit_dim -> vocab_size with no bias and no id map:
        # widening ours with zero rows would give every other token logit 0, not -inf, and
        # change which tokens the head drafts. Refuse rather than export a different drafter.
        raise SpecdraftError(f"{checkpoint_dir} drafts over a draft vocabulary of {config.draft_vocab} tokens; "
                             "TensorRT-LLM's ReDrafter layout has no draft vocabulary (no id map, no bias to "
                             "mask the other tokens): export a head trained with --draft-vocab 0")
    beyond = [name for name, used in (("context attention (--context)", config.context),
                                      ("fused feature layers (--feature-layers)", config.feature_layers),
                                      ("h in its recurrence (--hidden-in-recurrence)", config.hidden_in_recurrence))
              if used]
    if beyond:
        # The layout's drafter reads the last hidden state alone, through the paper's recurrence.
        raise SpecdraftError(f"{checkpoint_dir} has {' and '.join(beyond)}, which TensorRT-LLM's ReDrafter layout "
                             "cannot hold: export a head of the paper's shape")
    state = load_weights(checkpoint_dir)
    with torch.device("meta"):  # shapes only: no memory, no random init
        check_state(ReDrafterHead(config, parts=None), state, checkpoint_dir)  # type: ignore[arg-type]
    lm_head_weight = None
    if config.head == "shared":
        target = target if target is not None else _load_recorded_target(checkpoint_dir)
        check_compatible(config, target, checkpoint_dir)
        lm_head_weight = _plain_lm_head_weight(target)
    tensors = trtllm_state(config, state, lm_head_weight)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS))
    with open(out / CONFIG, "w") as f:
        json.dump(trtllm_config(config), f, indent=2)
    return out


def _plain_lm_head_weight(target) -> torch.Tensor:
    """The target's LM head as a plain (V, d) matrix, refusing heads that are not linear."""
    if target.softcap:
        raise SpecdraftError(f"{target.name} applies a final-logit softcap, which a TensorRT-LLM "
                             "ReDrafter output layer cannot express; export a head 'own' drafter instead")
    if getattr(target.head, "bias", None) is not None:
        raise SpecdraftError(f"{target.name}'s LM head has a bias, which the TensorRT-LLM layout cannot hold")
    return target.head.weight.detach().cpu()


def _load_recorded_target(checkpoint_dir):
    from ..models import load_target

    name = read_config(checkpoint_dir).get("target", {}).get("name")
    if not name:
        raise SpecdraftError(f"{checkpoint_dir} has a shared head and records no target name: pass the target")
    return load_target(name)
