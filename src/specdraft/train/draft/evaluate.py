"""Held-out evaluation: the draft scored against the target (cross-entropy, KL, the
acceptance rate α, the greedy acceptance, the block efficiency τ, the memory-bound speed-up
and the greedy τ of the engine's walk at γ = 1..gamma; the package docstring defines them)."""

from __future__ import annotations

import torch

from ..common import reduced_sums
from ..examples import Example
from ..losses import forward_kl, iid_block_efficiency, log_probs, total_variation
from ..walk import greedy_walk, labelled_spans, streaks
from .batches import collate_positions

EVAL_STATS = ("ce", "fkl", "tv", "agree", "count")


class Evaluator:
    """Scores the draft against the target on held-out sequences (see the package docstring).
    Each process takes every num_processes-th example; the sums are reduced."""

    def __init__(self, examples: list[Example], target, *, batch_size: int, chunk: int, gamma: int,
                 target_parameters: int, vocab=None):
        self.examples, self.target, self.vocab = examples, target, vocab
        self.batch_size, self.chunk, self.gamma = batch_size, chunk, gamma
        self.target_parameters = target_parameters

    @torch.no_grad()
    def sums(self, draft, rank: int = 0, world: int = 1) -> torch.Tensor:
        """EVAL_STATS sums, then (tokens, steps) of the greedy walk (``train.walk``) at
        γ = 1..gamma: r_t = how many of the draft's next guesses after x_{t+1} agree with
        the target's argmax in a row."""
        device = self.target.device
        totals = torch.zeros(len(EVAL_STATS), dtype=torch.float64)
        walks = torch.zeros(self.gamma, 2, dtype=torch.float64)
        mine = self.examples[rank::world]
        for start in range(0, len(mine), self.batch_size):
            examples = mine[start: start + self.batch_size]
            mb = collate_positions(examples)
            ids, mask = mb.input_ids.to(device), mb.attention_mask.to(device)
            th = self.target.base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            dh = draft.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            rows, cols, y = mb.rows.to(device), mb.cols.to(device), mb.labels.to(device)
            right = torch.zeros(mb.input_ids.shape, dtype=torch.bool)  # draft argmax = target argmax at (b, t)
            for s in range(0, len(rows), self.chunk):
                r, c, yy = rows[s: s + self.chunk], cols[s: s + self.chunk], y[s: s + self.chunk]
                logp = log_probs(self.target.logits(th[r, c]))
                logits = draft.get_output_embeddings()(dh[r, c].to(draft.dtype))
                fkl = forward_kl(logp, log_probs(logits))
                if self.vocab is not None:  # what the drafter proposes from: zero outside the vocabulary
                    ids = self.vocab.ids()
                    fkl = forward_kl(log_probs(logp[..., ids]), log_probs(logits[..., ids]))  # p renormalised there
                    logits = self.vocab.scatter(logits[..., ids])
                    yy = torch.where(self.vocab.t2d[yy], yy, -1)  # no CE term outside the vocabulary
                logq = log_probs(logits)
                agree = logp.argmax(-1) == logq.argmax(-1)
                right[r.cpu(), c.cpu()] = agree.cpu()
                ce = torch.where(yy >= 0, -logq.gather(-1, yy.clamp(min=0)[:, None])[:, 0], 0.0)
                totals += torch.tensor([ce.sum().item(), fkl.sum().item(),
                                        total_variation(logp, logq).sum().item(),
                                        agree.sum().item(), float(len(yy))],
                                       dtype=torch.float64)
            for b, example in enumerate(examples):
                # The step at t drafts from x_{t+1} on: its first guess is made at t + 1.
                runs = torch.cat([streaks(right[b])[1:], torch.zeros(1, dtype=torch.long)])
                for first, last in labelled_spans(example.labels):
                    for g in range(1, self.gamma + 1):
                        walks[g - 1] += torch.tensor(greedy_walk(runs, first, last, g), dtype=torch.float64)
        return torch.cat([totals, walks.flatten()])

    def __call__(self, accelerator, draft) -> dict:
        return self.fields(reduced_sums(accelerator, draft, lambda rank, world: self.sums(draft, rank, world)).tolist(),
                           draft)

    def fields(self, sums: list[float], draft) -> dict:
        from ...bench.metrics import mbsu
        from ...drafters.draft_folder import shared_parameters
        from ...models import parameter_count

        ce, fkl, tv, agree, n = sums[: len(EVAL_STATS)]
        walks = [sums[len(EVAL_STATS) + 2 * i: len(EVAL_STATS) + 2 * i + 2] for i in range(self.gamma)]
        if n <= 0:
            return {}
        alpha, greedy = 1.0 - tv / n, agree / n
        tau = iid_block_efficiency(alpha, self.gamma)
        return {"eval_ce": round(ce / n, 4), "eval_fkl": round(fkl / n, 4), "eval_tv": round(tv / n, 4),
                "eval_accept": round(alpha, 4), "eval_greedy_accept": round(greedy, 4),
                "eval_tau": round(tau, 4), "eval_tau_greedy": round(iid_block_efficiency(greedy, self.gamma), 4),
                "eval_mbsu": round(mbsu(tau, self.gamma, parameter_count(draft) - shared_parameters(draft), self.target_parameters), 4),
                "eval_positions": int(n),
                **{f"eval_tau_walk_g{g}": round(tokens / max(steps, 1.0), 4) for g, (tokens, steps) in enumerate(walks, 1)}}
