"""Training losses: token-level distillation losses for draft models (Direct Alignment, BRIEF
section 5); the heads' cross-entropy is ``train.cross_entropy``.

Notation, per trained position t (a response token of the target is next):
p = p_t the target's next-token distribution (frozen, no gradient), q = q_θ the draft's,
both full-vocabulary softmaxes of the models' logits at the same temperature (1 by
default). A = {x : p(x) > q(x)} and r(x) = 1[x ∈ A]. ``sg[.]`` stops gradients.

    FKL     = KL(p ‖ q) = Σ_x p(x) (log p(x) − log q(x))          (mass-covering)
    RKL     = KL(q ‖ p) = Σ_x q(x) (log q(x) − log p(x))          (mode-seeking)
    TVD     = ½ Σ_x |p(x) − q(x)|                                  (1 − TVD = acceptance rate)

TVD as a policy gradient. Because Σ_x ∇q(x) = 0, where no x has p(x) = q(x):

    ∇TVD = ½ Σ_x sign(q − p) ∇q = −Σ_{x∈A} ∇q(x) = −E_{x~q}[ r(x) ∇log q(x) ]

so TVD is trained through the surrogate  S = −Σ_x sg[q(x) r(x)] log q(x),  whose
gradient is exactly the one above (tested against autograd's gradient of ½Σ|p − q|).

TVD++ treats r as a reward and normalises it, r̂ = (r − μ) / (σ + ε), as policy-gradient
methods do; the surrogate is S = −Σ_x sg[w(x)] log q(x) with weights w:

- ``exact`` (default): the expectation over the whole vocabulary, with μ and σ the mean and
  standard deviation of r under q at the position:  μ = q(A), σ = sqrt(q(A)(1 − q(A))),
  w(x) = q(x) (r(x) − μ) / (σ + ε). In an exact expectation any constant baseline cancels
  (Σ_x q(x) μ ∇log q(x) = μ Σ_x ∇q(x) = 0), so ∇S = ∇TVD / (σ + ε): TVD with each position
  reweighted by 1/σ_t. (Statistics pooled over the batch would make σ one constant for all
  positions: a global rescaling, which Adam undoes, i.e. plain TVD; hence this per-position
  form.) The reweighting amplifies positions where q puts little mass on A, where TVD's
  own gradient −∇q(A) vanishes (magnitude ∝ q(A) becomes ∝ sqrt(q(A))).
- ``sampled``: the estimator an RL implementation would use. K tokens x_1..x_K ~ q per
  position (``samples``), rewards r(x_k); μ and σ the mean and standard deviation of all
  the rewards sampled together (the positions of one micro-batch, or of one chunk of
  ``--loss-chunk`` positions);  S = −(1/K) Σ_k r̂(x_k) log q(x_k). Here the baseline does
  not cancel: it is the variance reduction.
- ``uniform``: like ``exact``, but μ and σ are the plain mean and standard deviation of r
  over the V vocabulary entries (f = |A| / V, μ = f, σ = sqrt(f(1 − f))): w(x) = q(x) (r(x)
  − f) / (σ + ε); the baseline cancels again, so ∇S = ∇TVD / (σ_V + ε).

ε = ``TVDPP_EPS`` (0.01 for the per-position statistics of ``exact`` and ``uniform``,
1e-6 for the pooled statistics of ``sampled``). When q = p every r is 0, so every loss
here and every gradient is 0.

All losses return one value per position: its forward value is the divergence (TVD for
TVD and TVD++: the number a run is judged by) and its gradient the estimator's
(``straight_through``). Sums over positions are the caller's.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

LOSSES = ("fkl", "rkl", "tvd", "tvdpp")
TVDPP_VARIANTS = ("exact", "sampled", "uniform")
TVDPP_EPS = {"exact": 1e-2, "uniform": 1e-2, "sampled": 1e-6}


def straight_through(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """A tensor whose value is ``value`` and whose gradient is ``surrogate``'s."""
    return value.detach() + (surrogate - surrogate.detach())


def forward_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_x p (log p − log q) per row; logp, logq (N, V) log-probabilities."""
    p = logp.exp()
    return (p * (logp - logq)).sum(-1)


def reverse_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(q ‖ p) = Σ_x q (log q − log p) per row."""
    q = logq.exp()
    return (q * (logq - logp)).sum(-1)


def total_variation(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """½ Σ_x |p − q| per row (no gradient through it here: see ``tvd``)."""
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def acceptance(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ_x min(p, q) = 1 − TV(p, q) per row: the probability that a token sampled from q is
    accepted by speculative sampling against p (BRIEF section 4)."""
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def tvd(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """TVD per row, trained through the policy-gradient surrogate −Σ sg[q r] log q."""
    p, q = logp.exp(), logq.exp()
    with torch.no_grad():
        weight = q * (p > q)
    surrogate = -(weight * logq).sum(-1)
    return straight_through(0.5 * (p - q).abs().sum(-1), surrogate)


def tvdpp(logp: torch.Tensor, logq: torch.Tensor, variant: str = "exact", samples: int = 4,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """TVD++ per row (value: TVD; gradient: the variant's normalised-reward estimator)."""
    p, q = logp.exp(), logq.exp()
    value = 0.5 * (p - q).abs().sum(-1)
    eps = TVDPP_EPS[variant]
    with torch.no_grad():
        q_d = q.detach()
        reward = (p > q_d).to(q.dtype)
        if variant in ("exact", "uniform"):
            if variant == "exact":
                mean = (q_d * reward).sum(-1, keepdim=True)  # q(A)
            else:
                mean = reward.mean(-1, keepdim=True)  # |A| / V
            std = (mean * (1 - mean)).clamp(min=0).sqrt()
            weight = q_d * (reward - mean) / (std + eps)
    if variant in ("exact", "uniform"):
        surrogate = -(weight * logq).sum(-1)
        return straight_through(value, surrogate)
    if variant != "sampled":
        raise ValueError(f"unknown TVD++ variant {variant!r}; choose one of {', '.join(TVDPP_VARIANTS)}")
    if samples < 1:
        raise ValueError(f"TVD++ needs >= 1 sample per position, got {samples}")
    with torch.no_grad():
        picks = torch.multinomial(q_d, samples, replacement=True, generator=generator)  # (N, K)
        r = reward.gather(-1, picks)
        normalised = (r - r.mean()) / (r.std(unbiased=False) + eps) if r.numel() > 1 else torch.zeros_like(r)
    surrogate = -(normalised * logq.gather(-1, picks)).mean(-1)
    return straight_through(value, surrogate)


def kd_loss(name: str, logp: torch.Tensor, logq: torch.Tensor, variant: str = "exact",
            samples: int = 4) -> torch.Tensor:
    """The per-row loss ``name`` (one of ``LOSSES``) of the draft's log-probs ``logq`` (with
    gradient) against the target's ``logp`` (N, V)."""
    if name == "fkl":
        return forward_kl(logp, logq)
    if name == "rkl":
        return reverse_kl(logp, logq)
    if name == "tvd":
        return tvd(logp, logq)
    if name == "tvdpp":
        return tvdpp(logp, logq, variant, samples)
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Float32 log-softmax of logits / temperature."""
    logits = logits.float()
    return F.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def iid_block_efficiency(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward when each of γ drafted tokens is accepted
    independently with probability α: τ = (1 − α^(γ+1)) / (1 − α) (γ + 1 at α = 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
