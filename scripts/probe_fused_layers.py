"""Does the head draft better from several of the target's layers than from its last? (issue 12)

EAGLE-3 found that a drafter fed a fusion of low, middle and high layer states predicts
further ahead than one fed only the top state, which is specialised to the next token.
This probe trains two ReDrafter heads (shared output layer, draft vocabulary of a finished
fit run, K = 2 depths) on the same positions, batches and schedule, from scratch:

    paper:  the head on h_t (the target's last state, after its final norm)
    fused:  the head on F · [rms(s^a_t) ; rms(s^b_t) ; rms(s^c_t) ; h_t]   F: 4d -> d,
            starting at [0 0 0 I] (= the paper's head); s^l = the residual stream after
            layer l, rms = RMS normalisation without weights

and prints held-out top-1 at depths 1 and 2 (labels: the target's own answer tokens; out
of vocabulary counts as a miss) as training goes.

    .venv/bin/python scripts/probe_fused_layers.py --vocab runs/fit-r7/vocab.json \
        --heldout runs/fit-r4/heldout.jsonl --offset 6528 --conversations 400 --layers 3,15,27
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from specdraft.data.chat import IGNORE
from specdraft.heads import ReDrafterHead
from specdraft.models import load_target
from specdraft.train.corpus import to_output_space
from specdraft.train.examples import load_examples
from specdraft.train.heads import HeadObjective
from specdraft.vocab import DraftVocab

K = 2


@torch.no_grad()
def positions(target, examples, layers: list[int], label: str):
    """feats (P, len(layers) + 1, d) bf16, inputs (P, K), labels (P, K) target ids."""
    feats, inputs, labels = [], [], []
    for i in range(len(examples)):
        ex = examples[i]
        ids = torch.tensor([ex.input_ids])
        out = target.base(input_ids=ids, output_hidden_states=True)
        final = out.last_hidden_state[0]
        answer = torch.tensor([y != IGNORE for y in ex.labels])
        T = len(ex.input_ids)
        t = (answer[2:]).nonzero().flatten()  # trained: slot t + 2 is an answer token
        greedy = target.logits(final).argmax(-1)  # greedy[u] predicts x_{u+1}
        x = ids[0]
        stack = [F.rms_norm(out.hidden_states[layer][0].float(), (final.shape[-1],)) for layer in layers]
        feats.append(torch.stack([s[t] for s in stack] + [final[t].float()], dim=1).to(torch.bfloat16))
        inp = torch.zeros(len(t), K, dtype=torch.long)
        lab = torch.full((len(t), K), IGNORE, dtype=torch.long)
        ok = torch.ones(len(t), dtype=torch.bool)
        for k in range(K):
            u = (t + 1 + k).clamp(max=T - 1)
            v = (t + 2 + k).clamp(max=T - 1)
            inp[:, k] = x[u]
            ok &= (t + 2 + k < T) & answer[v]
            y = greedy[u] if label == "greedy" else x[v]
            lab[:, k] = torch.where(ok, y, torch.full_like(y, IGNORE))
        inputs.append(inp)
        labels.append(lab)
    return torch.cat(feats), torch.cat(inputs), torch.cat(labels)


class Fused(torch.nn.Module):
    def __init__(self, head, n: int):
        super().__init__()
        d = head.config.hidden_size
        self.head, self.n = head, n
        self.fuse = torch.nn.Linear((n + 1) * d, d, bias=False)
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, n * d:] = torch.eye(d)

    def root(self, feats):
        return self.fuse(feats.flatten(1).to(self.fuse.weight.dtype))


def top1(objective, root, inputs, labels, vocab):
    y = to_output_space(vocab, labels)
    valid = labels != IGNORE
    hits = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i, logits in objective.depth_logits(root, inputs):
            hits.append((logits[valid[:, i]].argmax(-1) == y[valid[:, i], i]).float().mean().item())
    return hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--offset", type=int, default=6528)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--layers", default="3,15,27")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args()
    torch.manual_seed(0)
    target = load_target("default", dtype="bfloat16")
    layers = [int(x) for x in args.layers.split(",")]
    vocab = DraftVocab(8192, int(target.vocab_size))
    vocab.set_ids(torch.tensor(json.loads(open(args.vocab).read())["ids"]))
    start = time.time()
    train = load_examples("sharegpt", target.tokenizer, seq_len=1024, K=K, eos_ids=target.eos_ids).skip(args.offset)
    train = [train[i] for i in range(args.conversations)]
    held = load_examples(args.heldout, target.tokenizer, seq_len=1024, K=K, eos_ids=target.eos_ids)
    feats, inputs, labels = positions(target, train, layers, "greedy")
    h_feats, h_inputs, h_labels = positions(target, [held[i] for i in range(len(held))], layers, "text")
    print(f"extracted {len(feats)} train / {len(h_feats)} held-out positions in {time.time() - start:.0f} s", flush=True)
    models = {}
    for name in ("paper", "fused"):
        torch.manual_seed(0)
        head = ReDrafterHead.for_target(target, head="shared", draft_vocab=vocab).float()
        with torch.no_grad():
            head.proj.weight.zero_()
        fused = Fused(head, len(layers))
        objective = HeadObjective(head, K)
        params = list(objective.parameters()) + (list(fused.fuse.parameters()) if name == "fused" else [])
        models[name] = (objective, fused, torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0))
    steps = args.epochs * (len(feats) // args.batch)
    order = torch.cat([torch.randperm(len(feats)) for _ in range(args.epochs)])
    for step in range(steps + 1):
        if step % args.eval_every == 0 or step == steps:
            line = {"step": step, "positions": step * args.batch}
            for name, (objective, fused, _) in models.items():
                root = h_feats[:, -1] if name == "paper" else fused.root(h_feats)
                line[name] = [round(x, 4) for x in top1(objective, root, h_inputs, h_labels, vocab)]
            print(json.dumps(line), flush=True)
        if step == steps:
            break
        lr = args.lr * min(1.0, (step + 1) / (0.05 * steps)) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = order[step * args.batch:(step + 1) * args.batch]
        y = to_output_space(vocab, labels[idx])
        denom = (y != IGNORE).sum(0).float().clamp(min=1)
        for name, (objective, fused, opt) in models.items():
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16):
                root = feats[idx, -1] if name == "paper" else fused.root(feats[idx])
                loss, _ = objective(root, inputs[idx], y, None, denom)
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
