"""Adversarial drafters for exactness tests: they never change what the engine outputs,
only how much of their proposal is accepted, so they drive every acceptance path."""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, Drafter, Proposal


class RandomBeamsDrafter(Drafter):
    """W beams of L tokens after g0, deterministic candidates, mostly wrong.

    With ``oracle`` (row id -> the full expected token sequence, prompt included), each
    beam copies the true continuation up to a random depth and is random after it, so
    acceptance stops at every possible depth and different beams win. Without an oracle
    beams are random tokens (useful with a tiny vocabulary, where they are often right).
    Beams also get random valid lengths, and duplicates occur (they must be deduplicated).
    """

    name = "random-beams"

    def __init__(self, vocab_size: int, beam_width: int = 4, beam_length: int = 5, seed: int = 0,
                 oracle: dict[int, list[int]] | None = None):
        self.V, self.W, self.L = vocab_size, beam_width, beam_length
        self.gen = torch.Generator().manual_seed(seed)
        self.oracle = oracle or {}

    def _truth(self, row_id: int, history: torch.Tensor) -> list[int] | None:
        ref = self.oracle.get(row_id)
        T = history.shape[0]
        if ref is None or len(ref) < T or ref[:T] != history.tolist():
            return None
        return ref[T: T + self.L - 1]

    def propose(self, ctx: DraftContext) -> Proposal:
        B = len(ctx.tokens)
        beams = torch.randint(0, self.V, (B, self.W, self.L), generator=self.gen)
        beams[:, :, 0] = ctx.g0.cpu()[:, None]
        lengths = torch.randint(1, self.L + 1, (B, self.W), generator=self.gen)
        for b, history in enumerate(ctx.tokens):
            truth = self._truth(ctx.request_ids[b], history.cpu())
            if truth:
                for w in range(self.W):
                    keep = int(torch.randint(0, len(truth) + 1, (1,), generator=self.gen))
                    beams[b, w, 1: 1 + keep] = torch.tensor(truth[:keep])
            if self.W > 1:  # an exact duplicate beam, which packing must merge
                beams[b, -1] = beams[b, 0]
                lengths[b, -1] = lengths[b, 0]
        valid = torch.arange(self.L)[None, None, :] < lengths[:, :, None]
        return Proposal(beams=beams.to(ctx.g0.device), valid=valid.to(ctx.g0.device))


class SampledChainDrafter(Drafter):
    """``chains`` chains of L-1 drafted tokens each, sampled from an arbitrary (random,
    seeded) q, drawn afresh for every chain and depth (so chains that share a prefix need
    not share q: the multi-chain rule must be exact for independent drafts of any laws).

    q is unrelated to the target, so many drafts are rejected; exactness must not depend
    on q being good. Reports q so the engine uses speculative sampling.
    """

    name = "sampled-chain"

    def __init__(self, vocab_size: int, beam_length: int = 4, seed: int = 0, sharpness: float = 2.0,
                 chains: int = 1, distinct: bool = False, report_marginal: bool = False):
        self.V, self.L, self.C = vocab_size, beam_length, chains
        self.gen = torch.Generator().manual_seed(seed)
        self.sharpness = sharpness
        # distinct: the chains' first tokens drawn without replacement from one q (chain k's
        # reported q: that q without the tokens of chains < k, renormalised);
        # report_marginal: ...but report the shared q itself (wrong: for the power test)
        self.distinct, self.report_marginal = distinct, report_marginal

    def propose(self, ctx: DraftContext) -> Proposal:
        B, C, D = len(ctx.tokens), self.C, self.L - 1
        q = (torch.randn(B, C, D, self.V, generator=self.gen) * self.sharpness).softmax(-1)
        drafts = torch.multinomial(q.view(-1, self.V), 1, generator=self.gen).view(B, C, D)
        if self.distinct:
            first = q[:, 0, 0]  # (B, V) the one law of every chain's first token
            drafts[:, :, 0] = torch.multinomial(first, C, replacement=False, generator=self.gen)
            left = first.clone()
            for k in range(C):
                q[:, k, 0] = first if self.report_marginal else left / left.sum(-1, keepdim=True)
                left[torch.arange(B), drafts[:, k, 0]] = 0.0
        beams = torch.cat([ctx.g0.cpu()[:, None, None].expand(B, C, 1), drafts], dim=2)
        valid = torch.ones_like(beams, dtype=torch.bool)
        dev = ctx.g0.device
        return Proposal(beams=beams.to(dev), valid=valid.to(dev), q=q.to(dev))


def greedy_answer_file(target, prompts: list[list[dict]], path, new_tokens: int = 24):
    """A distill-format JSONL of the target's greedy answers to ``prompts`` (chat messages),
    ``new_tokens`` each (EOS ignored: the tiny random targets stop early otherwise), and
    the answers' records."""
    import json

    from specdraft import SamplingParams, SpeculativeEngine
    from specdraft.data.chat import encode_prompt
    from specdraft.drafters import NoDrafter

    engine = SpeculativeEngine(target, NoDrafter())
    records = []
    for n, messages in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, messages)
        out = engine.generate([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))[0]
        records.append({"kind": "response", "prompt_id": f"p{n}", "prompt": messages, "response_ids": out.token_ids,
                        "temperature": 0.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def engine_forwards(target, drafter, records: list[dict], examples) -> int:
    """Target forwards the engine takes to write each record's answer again (greedy, EOS
    ignored, prompt = the example's tokens before the answer), asserting the same tokens."""
    from specdraft import SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine(target, drafter, max_tree_tokens=None)
    steps = 0
    for r, e in zip(records, examples):
        prompt = e.input_ids[: len(e.input_ids) - len(r["response_ids"])]
        result = engine.generate([prompt], SamplingParams(max_new_tokens=len(r["response_ids"]), ignore_eos=True))[0]
        assert result.token_ids == r["response_ids"]
        steps += result.steps
    return steps
