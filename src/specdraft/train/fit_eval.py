"""``specdraft fit``'s held-out scoring: per-depth top-1 accuracy and the engine-exact greedy
τ at W = 1 of a head on the held-out corpus (``CorpusEvaluator``), their one-line summary,
and OUT/curve.png, the plot of OUT/curve.jsonl against training positions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..data.chat import IGNORE
from ..vocab import DraftVocab
from .corpus import Corpus, to_device, to_output_space
from .walk import greedy_walk

CURVE = "curve.jsonl"  # OUT/curve.jsonl: one held-out score per evaluation, with its step and positions


class CorpusEvaluator:
    """Per-depth top-1 accuracy and the greedy τ of one beam of length L = 2..K+1 (W = 1),
    by replaying the engine's walk (``train.walk``) over a held-out corpus extracted from
    the target's own greedy answers: the engine's greedy τ on those prompts, up to the
    numerics of batched vs incremental forwards."""

    def __init__(self, corpus: Corpus, vocab: DraftVocab | None, K: int, device, batch: int = 4096,
                 window: int = 0):
        self.corpus, self.vocab, self.K, self.device, self.batch = corpus, vocab, K, device, batch
        self.window = window  # context attention's window (0: none)

    @torch.no_grad()
    def __call__(self, model) -> dict:
        was = model.training
        model.eval()
        try:
            return self.score(model)
        finally:
            model.train(was)

    def score(self, model) -> dict:
        K, corpus = self.K, self.corpus
        runs = [np.zeros(a["tokens"].shape[0], dtype=np.int64) for a in corpus.arrays]
        hits, count = np.zeros(K), np.zeros(K)
        for start in range(0, len(corpus), self.batch):
            mb = corpus.gather(np.arange(start, min(start + self.batch, len(corpus))), K, label="text",
                               window=self.window)
            labels = to_output_space(self.vocab, mb.labels).to(self.device)
            valid = mb.labels.to(self.device) != IGNORE  # OOV labels count as misses
            right = torch.zeros_like(valid)
            window = to_device(mb.window, self.device)
            features = None if mb.features is None else mb.features.to(self.device)
            for i, logits in model.depth_logits(mb.hidden.to(self.device), mb.inputs.to(self.device), window,
                                                features):
                right[:, i] = (logits.argmax(-1) == labels[:, i]) & valid[:, i]
            hits += right.sum(0).cpu().numpy()
            count += valid.sum(0).cpu().numpy()
            streak = right.long().cumprod(1).sum(1).cpu().numpy()
            for c in np.unique(mb.chunk.numpy()):
                rows = mb.chunk.numpy() == c
                runs[c][mb.t.numpy()[rows]] = streak[rows]
        out = {f"eval_acc1_{i}": round(float(hits[i] / max(count[i], 1)), 4) for i in range(K)}
        for depth in range(1, K + 1):
            tokens = steps = 0
            for c, a in enumerate(corpus.arrays):
                for first, last in answer_spans(np.asarray(a["answer"])):
                    n, s = greedy_walk(torch.from_numpy(runs[c]), first, last, depth)
                    tokens, steps = tokens + n, steps + s
            out[f"eval_tau_w1_l{depth + 1}"] = round(tokens / max(steps, 1), 4)
        out["eval_positions"] = int(count[0])
        return out


@torch.no_grad()
def without_replacement_rates(p: torch.Tensor, q: torch.Tensor, chains: int, generator: torch.Generator,
                              samples: int = 8) -> torch.Tensor:
    """(M, chains - 1): per row, the probability that one of c tokens drawn from q without
    replacement is accepted by recursive rejection against p, for c = 2..chains.

    p (M, N) the target's distribution over the draft vocabulary (its mass outside, 1 -
    sum, stays in the residuals: q is zero there), q (M, N) the draft's. Given the drawn
    tokens x_1..x_c the rate is exactly 1 - prod_k (1 - a_k), a_k = min(1, r_k(x_k) /
    q_k(x_k)) (q_k: q without x_1..x_{k-1}, renormalised; r_1 = p, r_{k+1} = norm(max(0,
    r_k - q_k))); the draws are ``samples`` per row by Gumbel-top-c (the law of drawing one
    after another), so the mean is unbiased."""
    M, N = q.shape
    u = torch.rand(M, samples, N, generator=generator, device=q.device).clamp_(min=1e-20)
    drawn = (q.log()[:, None] - (-u.log()).log()).topk(chains, dim=-1).indices  # (M, S, C) in draw order
    r, outside = p[:, None].expand(M, samples, N), (1 - p.sum(-1))[:, None].expand(M, samples)
    left = q[:, None].expand(M, samples, N).clone()  # q without the tokens drawn so far
    rejected, rates = torch.ones(M, samples, device=q.device), []
    for k in range(chains):
        x = drawn[:, :, k:k + 1]
        q_k = left / left.sum(-1, keepdim=True).clamp(min=1e-30)
        rejected = rejected * (1 - (r.gather(2, x) / q_k.gather(2, x).clamp(min=1e-30)).clamp(max=1)[..., 0])
        if k:
            rates.append(1 - rejected.mean(1))
        residual = (r - q_k).clamp(min=0)
        mass = (residual.sum(-1) + outside).clamp(min=1e-30)  # normalised with the mass outside
        r, outside = residual / mass[..., None], outside / mass
        left = left.scatter(2, x, 0.0)
    return torch.stack(rates, dim=1)


def sampled_acceptance(corpus: Corpus, model, target, vocab: DraftVocab | None, K: int, temperature: float = 1.0,
                       batch: int = 512, window: int = 0, chains: int = 1) -> dict:
    """How often a chain *drawn* from the head would be accepted, teacher forced on a
    held-out corpus (best extracted from the target's answers sampled at ``temperature``:
    the text an accepted chain follows).

    At each answer position t and depth i the head's q_i (its draft logits / T, softmax
    over its output vocabulary, zero outside) is accepted by speculative sampling with
    probability a_i(t) = sum_x min(p_i(x), q_i(x)), p_i the target's distribution at that
    slot (softmax of its logits / T over the whole vocabulary, from the stored state
    h_{t+1+i}). Returns the mean a_i per depth (``eval_accept_t{T}_{i}``) and a one-chain
    τ estimate per length L, 1 + mean_t sum_{k<L} prod_{i<k} a_i(t)
    (``eval_tau_t{T}_l{L}``; a depth without a label, past the answer's end, counts 0).
    With ``chains`` C > 1 also the rate at which one of c draws from q_i *without
    replacement* is accepted there, as the engine's chains are (recursive rejection,
    ``acceptance.accept_chains_sampling``): ``eval_accept_t{T}_c{c}_{i}`` for c = 2..C
    (``without_replacement_rates``, Monte Carlo over the draws, seeded).
    model: a ``train.heads.HeadObjective``; target: the ``models.Target``."""
    ids = None if vocab is None else vocab.ids().to(target.device)
    total, count, streaks, rows = np.zeros(K), np.zeros(K), np.zeros(K), 0
    several = np.zeros((max(chains - 1, 0), K))  # accepted with 2..C draws, summed per depth
    generator = torch.Generator(device=target.device).manual_seed(0)  # the draws of the C > 1 estimate
    was = model.training
    model.eval()
    try:
        for start in range(0, len(corpus), batch):
            mb = corpus.gather(np.arange(start, min(start + batch, len(corpus))), K, label="text", window=window,
                               soft=True)
            states, present = mb.soft
            valid = (mb.labels != IGNORE) & present  # a label, and the state whose logits give p there
            accept = torch.zeros(valid.shape)
            features = None if mb.features is None else mb.features.to(target.device)
            for i, logits in model.depth_logits(mb.hidden.to(target.device), mb.inputs.to(target.device),
                                                to_device(mb.window, target.device), features):
                q = (logits.float() / temperature).softmax(-1)
                p = (target.logits(states[:, i].to(target.device, target.dtype)).float() / temperature).softmax(-1)
                p = p if ids is None else p[:, ids]  # q is zero outside the draft vocabulary
                accept[:, i] = torch.minimum(p, q).sum(-1).cpu()
                if chains > 1:
                    rates = without_replacement_rates(p, q, chains, generator).cpu()  # (M, C - 1)
                    several[:, i] += rates[valid[:, i]].sum(0).double().numpy()
            accept = torch.where(valid, accept, torch.zeros_like(accept))
            total += accept.sum(0).numpy()
            count += valid.sum(0).numpy()
            streaks += accept.cumprod(1).sum(0).numpy()  # sum over rows of prod_{i<=k} a_i, per k
            rows += len(accept)
    finally:
        model.train(was)
    T = f"{temperature:g}"
    out = {f"eval_accept_t{T}_{i}": round(float(total[i] / max(count[i], 1)), 4) for i in range(K)}
    for L in range(2, K + 2):
        out[f"eval_tau_t{T}_l{L}"] = round(1 + float(streaks[:L - 1].sum() / max(rows, 1)), 4)
    for c in range(chains - 1):
        out.update({f"eval_accept_t{T}_c{c + 2}_{i}": round(float(several[c, i] / max(count[i], 1)), 4)
                    for i in range(K)})
    return out


def answer_spans(answer: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) of each maximal run of True."""
    edges = np.diff(np.concatenate([[0], answer.astype(np.int8), [0]]))
    return list(zip(np.nonzero(edges == 1)[0].tolist(), (np.nonzero(edges == -1)[0] - 1).tolist()))


def scheduled_scoring(config, held, vocab, accelerator, model, state, plan, resumed: bool, save):
    """Held-out scoring of a fit's head on the schedule -> (``common.HeldOut``,
    ``best.KeepBest``): each score a line of OUT/curve.jsonl, and OUT/best the head at its
    best τ at the trained depth (``save(name)`` writes it to OUT/name)."""
    from .best import KeepBest
    from .common import HeldOut, JsonLog

    evaluator = CorpusEvaluator(held, vocab, config.K, accelerator.device, window=config.context)
    curve = JsonLog(Path(config.out), state.step, accelerator.is_main_process, name=CURVE)

    def score() -> dict:
        found = evaluator(accelerator.unwrap_model(model))
        curve.write({"step": state.step, "positions": state.tokens, **found})
        return found

    keep_best = KeepBest(Path(config.out), f"eval_tau_w1_l{config.K + 1}", save, state, resumed,
                         accelerator.is_main_process)
    no_log = JsonLog(Path(config.out) / "train", state.step, False)  # the curve is the log
    return HeldOut(score, config.eval_every, state, plan.total_steps, no_log, keep_best), keep_best


def summarise(found: dict, K: int) -> str:
    accs = " / ".join(f"{found[f'eval_acc1_{i}']:.3f}" for i in range(K))
    return f"top-1 {accs} at depths 1-{K}, τ (W=1, L=2..{K + 1}) " + " / ".join(
        f"{found[f'eval_tau_w1_l{L}']:.3f}" for L in range(2, K + 2))


def write_curve_plot(out: Path) -> None:
    """OUT/curve.png: held-out τ and top-1 accuracy per depth against training positions."""
    path = out / CURVE
    if not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["positions"] for r in rows]
    for key in sorted(k for k in rows[0] if k.startswith("eval_tau_w1_l")):
        ax1.plot(x, [r[key] for r in rows], marker=".", label=f"L={key.rsplit('l', 1)[1]}")
    for key in sorted(k for k in rows[0] if k.startswith("eval_acc1_")):
        ax2.plot(x, [r[key] for r in rows], marker=".", label=f"depth {int(key.rsplit('_', 1)[1]) + 1}")
    ax1.set(xlabel="training positions", ylabel="held-out greedy τ (W=1)", title="τ")
    ax2.set(xlabel="training positions", ylabel="held-out top-1 accuracy", title="accuracy per depth")
    save_figure(fig, (ax1, ax2), out / "curve.png")


def save_figure(fig, axes, path: Path) -> None:
    """Grid and legend on each panel, then the figure to ``path`` (the fits' curve.png)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
