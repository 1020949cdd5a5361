"""``common.train_loop``'s model-specific half for a draft model (``DraftTask``): the
micro-batches (the data's sequences, or with ``--on-policy`` their prompts continued by the
draft), the loss through ``DraftObjective``, and the log's fields."""

from __future__ import annotations

import torch

from ...data.chat import IGNORE
from ..common import HeldOut, TargetStatesTask
from ..examples import Example
from .batches import PositionBatch, collate_positions
from .objective import target_hidden



def prompt_of(example: Example) -> list[int]:
    """The tokens before the first trained token (the prompt of a response record, the
    first turn and the assistant header of a conversation)."""
    first = next((i for i, y in enumerate(example.labels) if y != IGNORE), len(example.labels))
    return example.input_ids[:first]


class DraftTask(TargetStatesTask):
    """``common.train_loop``'s model-specific half. With ``on_policy_tokens`` > 0 the
    trained sequences are the examples' prompts continued by the draft itself (sampled at
    temperature 1 with the global RNG, so checkpoints resume exactly), scored by the target."""

    def __init__(self, stage: str, examples, target, cache=None, *, accelerator=None, model=None,
                 held_out: HeldOut | None = None, on_policy_tokens: int = 0, seq_len: int | None = None):
        self.stage, self.examples, self.target, self.cache = stage, examples, target, cache
        self.on_policy_tokens, self.seq_len = on_policy_tokens, seq_len
        self.accelerator, self.model, self.held_out = accelerator, model, held_out
        self.bar_fields = ("loss", "accept" if stage == "finetune" else "acc1", "eval_accept")
        self.reset_totals()

    def micro_batch(self, indices: list[int]) -> PositionBatch:
        examples = [self.examples[i] for i in indices]
        if self.on_policy_tokens:
            examples = self.roll_out(examples)
        return collate_positions(examples)

    @torch.no_grad()
    def roll_out(self, examples: list[Example]) -> list[Example]:
        """Each example's prompt and the draft's own continuation (up to
        ``on_policy_tokens`` tokens, through its first EOS), labels on the continuation."""
        draft = self.accelerator.unwrap_model(self.model).draft
        device = self.target.device
        prompts = [prompt_of(e) or e.input_ids[:1] for e in examples]
        P = max(len(p) for p in prompts)
        pad = 0
        ids = torch.full((len(prompts), P), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding, as generation needs
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        eos = sorted(self.target.eos_ids)
        was_training = draft.training
        draft.eval()
        try:
            out = draft.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.on_policy_tokens,
                                 pad_token_id=pad, eos_token_id=eos or None)
        finally:
            draft.train(was_training)
        rolled = []
        for e, p, row in zip(examples, prompts, out[:, P:].tolist()):
            stop = next((i + 1 for i, t in enumerate(row) if t in self.target.eos_ids), len(row))
            new = row[:stop]
            seq, labels = (p + new), [IGNORE] * len(p) + new
            if self.seq_len:
                seq, labels = seq[: self.seq_len], labels[: self.seq_len]
            rolled.append(Example(key=f"{e.key}#policy", input_ids=seq, labels=labels))
        return rolled

    def counts(self, mb: PositionBatch) -> torch.Tensor:
        return torch.tensor([mb.rows.numel()])

    def num_tokens(self, mb: PositionBatch) -> int:
        return sum(mb.lengths)

    def loss(self, model, mb: PositionBatch, denom: torch.Tensor):
        device = self.target.device
        rows, cols = mb.rows.to(device), mb.cols.to(device)
        th = None
        if self.stage == "finetune":
            th = target_hidden(self.target, self.cache, mb, self._totals)[rows, cols]
        loss, stats = model(mb.input_ids.to(device), mb.attention_mask.to(device), rows, cols, mb.labels.to(device),
                            th, denom)
        return loss, self.with_totals(stats, mb.lengths)

    def log_fields(self, stats: torch.Tensor, seconds: float, num_processes: int) -> dict:
        loss, ce, tv, agree, n, target_s, target_tok, tokens = stats.tolist()
        n1 = max(n, 1.0)
        fields: dict = {"loss": round(loss / n1, 4), "ce": round(ce / n1, 4)}
        if self.stage == "finetune":
            fields.update(tv=round(tv / n1, 4), accept=round(1 - tv / n1, 4), greedy_accept=round(agree / n1, 4))
        else:
            fields["acc1"] = round(agree / n1, 4)
        fields["positions"] = int(n)
        if seconds > 0:
            fields["tokens_per_s"] = round(tokens / seconds, 1)  # all processes
        if target_s > 0:
            fields["target_tokens_per_s"] = round(target_tok / target_s, 1)  # per process
        if self.held_out is not None:
            fields.update(self.held_out.at_log())
        return fields
