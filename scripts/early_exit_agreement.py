"""How much of the target do its first k layers know? For each k, the target's first k
layers + its final norm + its LM head (early exit, no training) against the full target's
greedy choice, at the answer positions of held-out ShareGPT conversations (teacher-forced).

    .venv/bin/python scripts/early_exit_agreement.py [--target default] [--conversations 30]

Prints one line per k: the share of positions where the two argmaxes agree.
"""

import argparse

import torch

from specdraft.data.chat import IGNORE, encode_conversation
from specdraft.data.sharegpt import load_conversations
from specdraft.models import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--max-length", type=int, default=384)
    args = parser.parse_args()
    target = load_target(args.target, dtype="float32")
    convs, _ = load_conversations(None, "heldout", args.conversations)
    layers = target.num_layers
    hits, n = torch.zeros(layers + 1), 0
    with torch.no_grad():
        for conv in convs:
            enc = encode_conversation(target.tokenizer, conv.messages, max_length=args.max_length)
            if enc is None:
                continue
            pos = (torch.tensor(enc.labels[1:]) != IGNORE).nonzero()[:, 0]  # positions predicting an answer token
            states = target.base(torch.tensor([enc.input_ids]), output_hidden_states=True).hidden_states
            full = target.logits(states[-1][0, pos]).argmax(-1)  # the last entry is already normed
            for k in range(1, layers):
                exit_k = target.logits(target.base.norm(states[k][0, pos])).argmax(-1)
                hits[k] += (exit_k == full).sum()
            n += len(pos)
    print(f"{n} answer positions of {len(convs)} held-out conversations")
    for k in range(1, layers):
        print(f"first {k:2d} layers: {hits[k] / n:.3f}")


if __name__ == "__main__":
    main()
