"""The training losses (train.losses): the distillation losses' values against torch's own,
TVD's policy-gradient surrogate against autograd, TVD++'s variants, zero at q = p; the
heads' chunked cross-entropy against torch's."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from specdraft.train.losses import (LOSSES, TVDPP_EPS, TVDPP_VARIANTS, acceptance, forward_kl,
                                    iid_block_efficiency, kd_loss, reverse_kl, total_variation, tvd, tvdpp)


def logits_pair(N=6, V=11, seed=0, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    zp = torch.randn(N, V, generator=g, dtype=torch.float64) * sharp
    zq = torch.randn(N, V, generator=g, dtype=torch.float64) * sharp
    return zp, zq


def grad_of(fn, zq):
    z = zq.clone().requires_grad_(True)
    fn(z).backward()
    return z.grad


def test_kl_divergences_match_torch_kl_div():
    zp, zq = logits_pair()
    logp = F.log_softmax(zp, -1)
    fkl = lambda z: forward_kl(logp, F.log_softmax(z, -1)).sum()  # noqa: E731
    ref = lambda z: F.kl_div(F.log_softmax(z, -1), logp, log_target=True, reduction="sum")  # noqa: E731
    torch.testing.assert_close(fkl(zq), ref(zq))
    torch.testing.assert_close(grad_of(fkl, zq), grad_of(ref, zq))
    rkl = lambda z: reverse_kl(logp, F.log_softmax(z, -1)).sum()  # noqa: E731
    ref = lambda z: F.kl_div(logp, F.log_softmax(z, -1), log_target=True, reduction="sum")  # noqa: E731
    torch.testing.assert_close(rkl(zq), ref(zq))
    torch.testing.assert_close(grad_of(rkl, zq), grad_of(ref, zq))
    # kd_loss dispatches to the same functions
    logq = F.log_softmax(zq, -1)
    torch.testing.assert_close(kd_loss("fkl", logp, logq), forward_kl(logp, logq))
    torch.testing.assert_close(kd_loss("rkl", logp, logq), reverse_kl(logp, logq))


def test_tvd_surrogate_gradient_is_the_gradient_of_half_l1():
    zp, zq = logits_pair(N=8, V=13, seed=1)
    logp = F.log_softmax(zp, -1)
    exact = lambda z: 0.5 * (logp.exp() - F.softmax(z, -1)).abs().sum()  # noqa: E731
    surrogate = lambda z: tvd(logp, F.log_softmax(z, -1)).sum()  # noqa: E731
    torch.testing.assert_close(surrogate(zq), exact(zq))  # the value is TVD itself
    torch.testing.assert_close(grad_of(surrogate, zq), grad_of(exact, zq))
    # ... which is the policy gradient -E_q[r ∇log q], r = 1[p > q]
    q = F.softmax(zq, -1)
    r = (logp.exp() > q).double()
    pg = lambda z: -((q * r).detach() * F.log_softmax(z, -1)).sum()  # noqa: E731
    torch.testing.assert_close(grad_of(pg, zq), grad_of(exact, zq))
    torch.testing.assert_close(acceptance(logp, F.log_softmax(zq, -1)),
                               1 - total_variation(logp, F.log_softmax(zq, -1)))


@pytest.mark.parametrize("variant", ["exact", "uniform"])
def test_tvdpp_exact_variants_rescale_each_positions_tvd_gradient(variant):
    """In an exact expectation the baseline cancels: the gradient of row t is TVD's / (σ_t + ε)."""
    zp, zq = logits_pair(N=5, V=9, seed=2)
    logp = F.log_softmax(zp, -1)
    q, p = F.softmax(zq, -1), logp.exp()
    A = (p > q).double()
    mean = (q * A).sum(-1) if variant == "exact" else A.mean(-1)
    std = (mean * (1 - mean)).sqrt()
    plus = grad_of(lambda z: tvdpp(logp, F.log_softmax(z, -1), variant).sum(), zq)
    base = grad_of(lambda z: tvd(logp, F.log_softmax(z, -1)).sum(), zq)
    torch.testing.assert_close(plus, base / (std + TVDPP_EPS[variant])[:, None])
    value = tvdpp(logp, F.log_softmax(zq, -1), variant)
    torch.testing.assert_close(value, total_variation(logp, F.log_softmax(zq, -1)))


def test_tvdpp_sampled_estimates_the_normalised_gradient():
    """Many samples of one row: the sampled estimator approaches the exact variant's
    gradient (pooled statistics of one row ≈ that row's μ, σ under q)."""
    zp, zq = logits_pair(N=1, V=7, seed=3, sharp=1.5)
    logp = F.log_softmax(zp, -1)
    g = torch.Generator().manual_seed(0)
    sampled = grad_of(lambda z: tvdpp(logp, F.log_softmax(z, -1), "sampled", samples=200_000, generator=g).sum(), zq)
    q, p = F.softmax(zq, -1), logp.exp()
    mean = (q * (p > q)).sum(-1)
    std = (mean * (1 - mean)).sqrt()
    base = grad_of(lambda z: tvd(logp, F.log_softmax(z, -1)).sum(), zq)
    torch.testing.assert_close(sampled, base / std[:, None], atol=0.02, rtol=0.05)


@pytest.mark.parametrize("name, variant", [(n, "exact") for n in LOSSES] + [("tvdpp", v) for v in TVDPP_VARIANTS])
def test_every_loss_and_gradient_is_zero_at_q_equal_p(name, variant):
    z = logits_pair(N=4, V=10, seed=4)[0]
    logp = F.log_softmax(z, -1)
    zq = z.clone().requires_grad_(True)
    loss = kd_loss(name, logp, F.log_softmax(zq, -1), variant, samples=8).sum()
    loss.backward()
    assert abs(loss.item()) < 1e-12
    assert zq.grad.abs().max().item() < 1e-12
    # and it is positive elsewhere
    other = kd_loss(name, logp, F.log_softmax(logits_pair(N=4, V=10, seed=5)[1], -1), variant, samples=8)
    assert (other > 0).all()


def test_iid_block_efficiency():
    assert iid_block_efficiency(0.0, 4) == 1.0
    assert iid_block_efficiency(1.0, 4) == 5.0
    assert iid_block_efficiency(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
