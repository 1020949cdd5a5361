"""The draft model itself: a fresh float32 LlamaForCausalLM (``build_draft``), initialised
from the target's embeddings and layers (``init_from_target``), a saved draft folder loaded
back for training (``load_draft``), and the target's embedding matrices borrowed
(``borrow_embeddings``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import SpecdraftError, first_line
from .shape import DraftShape, TargetFacts, draft_config


def embedding_basis(weights: torch.Tensor, d: int) -> torch.Tensor:
    """(D, d): the top-d right singular vectors of ``weights`` (N, D), i.e. the d-dimensional
    subspace that keeps most of the rows' energy (eigenvectors of WᵀW, in float64)."""
    w = weights.double()
    _, vectors = torch.linalg.eigh(w.T @ w)  # ascending eigenvalues
    basis = vectors[:, -d:].flip(-1)
    signs = torch.where(basis.sum(0) < 0, -1.0, 1.0).to(basis.dtype)  # a fixed sign per vector
    return (basis * signs).float()


@torch.no_grad()
def calibrate_output_scale(draft, rows: int = 256) -> float:
    """Set the draft's final norm weight to one constant c such that, with the residual
    stream equal to a token's input embedding (the freshly initialised draft, whose random
    layers add little), the logits have standard deviation 1 over the vocabulary (averaged
    over ``rows`` evenly spaced tokens). The target's vocabulary matrix with a unit norm
    weight gives large, confident and wrong first predictions (SmolLM2: CE ≈ 28 nats
    instead of ln V ≈ 10.8); at std 1 the start is near uniform yet keeps the target's
    token similarities. Returns c."""
    E = draft.get_input_embeddings().weight.float()
    H = draft.get_output_embeddings().weight.float()
    ids = torch.linspace(0, E.shape[0] - 1, min(rows, E.shape[0])).round().long()
    x = E[ids]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm with weight 1
    spread = (h @ H.T).std(dim=-1).mean().item()
    scale = 1.0 / spread if spread > 0 else 1.0
    draft.base_model.norm.weight.fill_(scale)
    return scale


@torch.no_grad()
def init_from_target(draft, target, facts: TargetFacts, copy_layers: list[int] | None = None) -> None:
    """Copy the target's embeddings (and LM head if untied) into ``draft``: exactly when the
    hidden sizes match, else projected onto the top-d subspace of the target's vocabulary
    matrices (E·P, P from ``embedding_basis``), so E_d E_dᵀ ≈ E Eᵀ. With ``copy_layers``,
    copy those target layers into the draft's layers 0, 1, ... and the target's final norm;
    without, scale the final norm for near-uniform first predictions
    (``calibrate_output_scale``)."""
    d = draft.config.hidden_size
    E = target.model.get_input_embeddings().weight.detach().float().cpu()
    H = target.head.weight.detach().float().cpu()
    if d == facts.hidden:
        project = lambda w: w  # noqa: E731
    else:
        basis = embedding_basis(E if facts.tied else torch.cat([E, H]), d)
        project = lambda w: w @ basis  # noqa: E731
    tied = draft.get_input_embeddings().weight.data_ptr() == draft.get_output_embeddings().weight.data_ptr()
    if tied:
        # One matrix for both roles: the target's output side, which the draft must imitate.
        draft.get_input_embeddings().weight.copy_(project(H))
    else:
        draft.get_input_embeddings().weight.copy_(project(E))
        draft.get_output_embeddings().weight.copy_(project(H))
    norm = getattr(target.base, "norm", None)
    if copy_layers and d == facts.hidden and norm is not None and getattr(norm, "weight", None) is not None:
        draft.base_model.norm.weight.copy_(norm.weight.detach().float())
    else:
        calibrate_output_scale(draft)
    source = getattr(target.base, "layers", None)
    for i, j in enumerate(copy_layers or []):
        if source is None or not 0 <= j < len(source):
            raise SpecdraftError(f"--copy-layers: the target has no layer {j} ({len(source or [])} layers)")
        try:
            draft.base_model.layers[i].load_state_dict(source[j].state_dict())
        except RuntimeError as e:
            raise SpecdraftError(f"--copy-layers: target layer {j} does not fit a Llama draft layer "
                                 f"({first_line(e)})") from None


def build_draft(target, shape: DraftShape, *, from_target: bool = False, copy_layers: list[int] | None = None,
                seed: int = 0):
    """A fresh float32 LlamaForCausalLM draft (random init with ``seed``, then optionally
    the target's embeddings / layers), on the CPU."""
    import copy

    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target, shape)).float()
    generation = getattr(target.model, "generation_config", None)
    if generation is not None:
        draft.generation_config = copy.deepcopy(generation)
    if from_target or copy_layers:
        init_from_target(draft, target, TargetFacts.of(target), copy_layers)
    return draft


def load_draft(path: str, target):
    """A draft model folder (e.g. the pretrain stage's OUT/final) as a float32 model, after
    the same checks as ``--drafter draft:PATH`` (``drafters.draft_folder.load_draft_folder``);
    and its ``specdraft.json`` (or {})."""
    from ...drafters.draft_folder import load_draft_folder, read_meta

    draft, _, _, _ = load_draft_folder(path, target, torch.float32)
    draft.requires_grad_(True)  # loaded frozen, for drafting; borrowed matrices are frozen again by run
    return draft, read_meta(Path(path).expanduser())


def borrow_embeddings(draft, target, facts: TargetFacts) -> None:
    """Make the draft's embedding matrices the target's (frozen; left out of saved weights):
    the draft then trains and stores only its own layers and norms."""
    from ...drafters.draft_folder import share_target_embeddings

    if draft.config.hidden_size != facts.hidden:
        raise SpecdraftError(f"--embeddings target needs the target's hidden size ({facts.hidden}), "
                             f"the draft has {draft.config.hidden_size}")
    share_target_embeddings(draft, target)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
