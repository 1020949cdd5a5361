"""Score token-only drafters (lookup, retrieval:PATH and their unions) on the target's own
greedy answers without running the target: the engine's greedy walk, replayed on the text.

At each step the drafter sees the prompt and the answer so far, ending with g0 (the token
the target chose last), and proposes its beams; the step accepts the longest prefix of a
beam that the answer continues with (what greedy verification keeps when the target's
choices are the recorded ones), then moves on by that many tokens plus the target's own.
τ = answer tokens / target forwards, prefill counted (the bench's τ). Exact
for a drafter whose candidates depend only on tokens, up to near-ties where the target's
tree verification would choose otherwise than the recorded plain decoding (bfloat16).

    .venv/bin/python scripts/score_lookup.py --data runs/mtbench-answers.jsonl \
        lookup lookup+retrieval:default lookup+retrieval:runs/fit-own4/datastore

Worked example: answer [a b c d e], a beam [a | b c x] at the first step (g0 = a) accepts
b c, the step adds them and d, the target's token after c (3 tokens); the next step starts
at g0 = d and adds e, the last.

Prints one JSON line per drafter: τ, forwards, tokens, the share of steps accepting ≥ k drafted
tokens, the mean tree verified per step, and ``verify_speedup``: plain decoding's verify time
over the drafter's, from this machine's cost model of the target (``specdraft.costmodel``) —
a fixed shape's bound before drafting time, to choose shapes worth a timed bench.
"""

import argparse
import json

import torch

from specdraft.costmodel import load_cost_model
from specdraft.data.chat import encode_prompt
from specdraft.drafters.base import DraftContext
from specdraft.drafters.combined import CombinedDrafter
from specdraft.drafters.registry import build_drafter, combined_parts
from specdraft.engine import SpeculativeEngine
from specdraft.models import load_target


def accepted(beams: torch.Tensor, valid: torch.Tensor, future: torch.Tensor) -> int:
    """Drafted tokens the longest-matching beam gets right: beams, valid (W, L) with g0 in
    column 0; ``future`` (F,) the answer's tokens after g0."""
    best = 0
    for w in range(beams.shape[0]):
        n = 0
        while n + 1 < beams.shape[1] and valid[w, n + 1] and n < len(future) and beams[w, n + 1] == future[n]:
            n += 1
        best = max(best, n)
    return best


def tree_tokens(beams: torch.Tensor, valid: torch.Tensor) -> int:
    """Tokens of the tree the beams (W, L) make once shared prefixes are merged, g0 included."""
    return len({tuple(beams[w, : j + 1].tolist()) for w in range(beams.shape[0]) for j in range(beams.shape[1])
                if valid[w, j]})


def walk(drafter, prompt: list[int], answer: list[int]) -> list[tuple[int, int, int]]:
    """Per step of the greedy walk over one answer: (tokens it adds, tree tokens verified,
    cached width). It adds its accepted drafted tokens and the target's next one, but no more
    than the answer has left (the engine stops at the answer's length, as at
    ``max_new_tokens``)."""
    ids = torch.tensor(prompt + answer, dtype=torch.long)
    start, end = len(prompt), len(prompt) + len(answer)
    per_step, i = [], start  # i: position of g0 (the answer's first token comes from prefill)
    while i < end - 1:
        g0 = ids[i: i + 1]
        budget = torch.tensor([end - 1 - i])  # tokens the answer has left: a beam holds no more (g0 included)
        ctx = DraftContext(tokens=[ids[: i + 1]], g0=g0, hidden=torch.zeros(1, 1), budget=budget,
                           greedy=torch.tensor([True]))
        proposal = SpeculativeEngine._clip(drafter.propose(ctx), budget)  # as the engine cuts it
        gained = accepted(proposal.beams[0], proposal.valid[0], ids[i + 1: end]) + 1  # <= budget: clipped
        per_step.append((gained, tree_tokens(proposal.beams[0], proposal.valid[0]), i))
        i += gained  # the accepted tokens and the target's own next one
    return per_step


def token_drafter(spec: str, target, beam_width: int | None, beam_length: int | None):
    """``spec``'s drafter, the given shape applied to every part (build_drafter leaves an
    untrained part of a union, as retrieval is, at its own shape)."""
    parts = [build_drafter(part, target, beam_width, beam_length) for part in combined_parts(spec)]
    return parts[0] if len(parts) == 1 else CombinedDrafter(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="lookup, retrieval:PATH, A+B (token-only drafters)")
    parser.add_argument("--data", required=True, help="a distill file of the target's greedy answers")
    parser.add_argument("--target", default="default")
    parser.add_argument("--beam-width", type=int, help="every part's (default: each drafter's own)")
    parser.add_argument("--beam-length", type=int, help="every part's, g0 included")
    args = parser.parse_args()
    target = load_target(args.target, dtype="auto")
    cost = load_cost_model(target)  # this machine's seconds per target forward (cached; else measured once)
    records = [json.loads(line) for line in open(args.data, encoding="utf-8")]
    records = [r for r in records if r.get("temperature", 0.0) == 0.0]
    prompts = [encode_prompt(target.tokenizer, r["prompt"]) for r in records]
    assert all(len(p) == r["prompt_tokens"] for p, r in zip(prompts, records)), "prompt encoding differs"
    for spec in args.drafters:
        drafter = token_drafter(spec, target, args.beam_width, args.beam_length)
        steps = [step for p, r in zip(prompts, records) for step in walk(drafter, p, r["response_ids"])]
        gained = [n for n, _, _ in steps]
        tokens = sum(len(r["response_ids"]) for r in records)
        forwards = len(steps) + len(records)  # each answer's prefill too, as the bench counts
        at_least = {f"acc>={k}": round(sum(n > k for n in gained) / len(steps), 3) for k in (1, 2, 3)}
        # Decode time against plain decoding's, from the verify cost alone (drafting is not in it).
        plain = sum(cost(1, width) for r in records for width in range(r["prompt_tokens"], r["prompt_tokens"]
                                                                          + len(r["response_ids"]) - 1))
        drafted = sum(cost(tree, width) for _, tree, width in steps)
        print(json.dumps({"drafter": spec, "tau": round(tokens / forwards, 3), "forwards": forwards,
                          "tokens": tokens, **at_least, "tree_tokens": round(sum(t for _, t, _ in steps) / len(steps), 2),
                          "verify_speedup": round(plain / drafted, 3), "answers": len(records)}), flush=True)


if __name__ == "__main__":
    main()
