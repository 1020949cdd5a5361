"""A draft model's folder: the checks and loading behind ``--drafter draft:PATH``.

A folder holds a Hugging Face causal LM (config.json, model.safetensors; pickled weights
are never loaded), optionally its tokenizer (it must be the target's), ``specdraft.json``
(how it was made; ``"embeddings": "target"`` when it borrows the target's embeddings and
stores none) and ``draft_vocab.safetensors`` (a draft vocabulary, ``specdraft.vocab``).
Every failure is one ``SpecdraftError`` line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import WEIGHTS, read_config
from ..errors import SpecdraftError, first_line
from ..vocab import DraftVocab

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SPECDRAFT_FILE = "specdraft.json"  # how the draft was made; "embeddings": "target" if it borrows them
VOCAB_FILE = "draft_vocab.safetensors"  # d2t, t2d of a draft vocabulary (specdraft.vocab)
EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")  # absent when shared with the target


# ---- load-time checks (each failure is one SpecdraftError line) ---------------------------

def check_weights_file(folder: Path) -> None:
    """The folder must hold a readable model.safetensors (pickled weights are never loaded)."""
    from safetensors import SafetensorError, safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f"found {', '.join(others)}; " if others else ""
        raise SpecdraftError(f"draft model {folder} has no {WEIGHTS} ({found}only safetensors weights are loaded)")
    try:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecdraftError(f"{path} is not a valid safetensors file: {first_line(e)}") from None


def check_vocab_size(size: int, name: str, target) -> None:
    if size != target.vocab_size:
        raise SpecdraftError(f"draft model {name} has a vocabulary of {size} tokens, but target "
                             f"{target.name} has {target.vocab_size}; they must share a vocabulary")


def load_tokenizer(folder: Path):
    """The draft folder's tokenizer, or None if it has no tokenizer files."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = first_line(e)
        raise SpecdraftError(f"could not load the tokenizer of draft model {folder}: {first}") from None


def check_tokenizer(tokenizer, name: str, target) -> None:
    """The draft's token strings must map to the same ids as the target's."""
    mine, theirs = tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if mine == theirs:
        return
    moved = sorted((i, t) for t, i in mine.items() if theirs.get(t) != i)
    if moved:
        i, t = moved[0]
        where = f"id {theirs[t]}" if t in theirs else "absent"
        detail = (f"{len(moved)} of the draft's {len(mine)} tokens map to other ids "
                  f"(e.g. {t!r} is id {i} in the draft, {where} in the target)")
    else:
        extra = sorted(t for t in theirs if t not in mine)
        detail = f"the target has {len(extra)} tokens the draft lacks (e.g. {extra[0]!r})"
    raise SpecdraftError(f"draft model {name} has a different tokenizer from target {target.name}: {detail}")


def read_meta(folder: Path) -> dict:
    """The folder's ``specdraft.json`` (how the draft was made), or {}."""
    import json

    path = folder / SPECDRAFT_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SpecdraftError(f"{path} is not readable JSON: {first_line(e)}") from None


def load_draft_folder(path: str | Path, target, dtype: torch.dtype):
    """(model, tokenizer or None, config dict, DraftVocab or None) of a draft model folder,
    after every check (safetensors weights whole, the target's vocabulary and tokenizer),
    on the target's device in ``dtype``. A folder whose ``specdraft.json`` says
    ``"embeddings": "target"`` stores no embedding matrix: it borrows the target's (shared
    in memory when the dtypes agree, ``share_target_embeddings``)."""
    folder = Path(path).expanduser()
    cfg = read_config(folder)
    check_weights_file(folder)
    if "vocab_size" in cfg:  # fail fast, before reading the weights
        check_vocab_size(int(cfg["vocab_size"]), str(path), target)
    tokenizer = load_tokenizer(folder)
    if tokenizer is not None:
        check_tokenizer(tokenizer, str(path), target)
    borrowed = read_meta(folder).get("embeddings") == "target"
    model = load_borrowing(folder, target, dtype) if borrowed else load_model(folder, target, dtype)
    check_vocab_size(model.get_output_embeddings().weight.shape[0], str(path), target)
    return model, tokenizer, cfg, load_vocab(folder, target)


def load_model(folder: Path, target, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), use_safetensors=True, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        first = first_line(e)
        raise SpecdraftError(f"could not load draft model {folder}: {first}") from None
    model.to(target.device).eval()
    model.requires_grad_(False)
    return model


def load_borrowing(folder: Path, target, dtype: torch.dtype) -> torch.nn.Module:
    """A draft saved without its embedding matrices: built from its config, its own
    weights loaded strictly (only the embedding keys may be missing), then the target's
    output matrix put in place (``share_target_embeddings``)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        missing, unexpected = model.load_state_dict(load_file(str(folder / WEIGHTS)), strict=False)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise SpecdraftError(f"could not load draft model {folder}: {first_line(e)}") from None
    wrong = sorted(set(missing) - set(EMBEDDING_KEYS)) + sorted(unexpected)
    if wrong:
        raise SpecdraftError(f"draft model {folder} borrows the target's embeddings but its other weights do not "
                             f"fit its config ({len(wrong)} keys missing or unexpected, e.g. {wrong[0]})")
    model.to(target.device).eval()
    model.requires_grad_(False)
    share_target_embeddings(model, target)
    return model


def share_target_embeddings(model: torch.nn.Module, target) -> None:
    """Give the draft the target's embedding matrices: a tied draft takes the target's
    output matrix for both roles, an untied one the input and output matrices. The same
    storage when the dtypes agree (no memory), else a converted copy. The draft must have
    been made with those matrices (``train.draft.init_from_target`` at the target's hidden
    size), so this changes no value."""
    mine_in, mine_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = mine_in is mine_out
    sources = [(mine_in, target.head.weight)] if tied else [
        (mine_in, target.model.get_input_embeddings().weight), (mine_out, target.head.weight)]
    for mine, theirs in sources:
        if mine.shape != theirs.shape:
            raise SpecdraftError(f"a draft borrowing the target's embeddings needs their shape "
                                 f"{tuple(theirs.shape)}, has {tuple(mine.shape)}")
        mine.data = theirs.detach().to(mine.device, mine.dtype)  # the Parameter object stays (ties hold)
    model._specdraft_borrowed = True  # parameter counts leave the borrowed matrices out


def shared_parameters(model: torch.nn.Module) -> int:
    """How many of ``model``'s parameters are borrowed from another model (0 or the
    embedding matrix): marked by ``share_target_embeddings``."""
    if not getattr(model, "_specdraft_borrowed", False):
        return 0
    mine_in, mine_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return mine_in.numel() + (0 if mine_in is mine_out else mine_out.numel())


def load_vocab(folder: Path, target) -> DraftVocab | None:
    """The folder's draft vocabulary (``VOCAB_FILE``), or None."""
    path = folder / VOCAB_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        vocab = DraftVocab(int(tensors["d2t"].shape[0]), int(tensors["t2d"].shape[0]))
        vocab.load_state_dict(tensors)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise SpecdraftError(f"{path} is not a draft vocabulary: {first_line(e)}") from None
    if vocab.t2d.shape[0] != target.vocab_size or int(vocab.t2d.sum()) != vocab.size:
        raise SpecdraftError(f"{path} does not fit target {target.name}'s vocabulary of {target.vocab_size}")
    return vocab.to(target.device)


def save_vocab(vocab: DraftVocab, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in vocab.state_dict().items()}, str(folder / VOCAB_FILE))
