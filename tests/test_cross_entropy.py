"""The heads' chunked / compiled cross-entropy (``train.cross_entropy``) against torch's."""

import pytest
import torch
from torch.nn import functional as F

from specdraft.train import cross_entropy
from specdraft.train.cross_entropy import cross_entropy_sum


def check_against_torch(logits: torch.Tensor, labels: torch.Tensor, compiled: bool, scale: float = 0.5):
    """Value, gradient (in the logits' dtype) and ranks against F.cross_entropy in float32."""
    mine = logits.clone().requires_grad_()
    ce, rank = cross_entropy_sum(mine, labels, compiled=compiled)
    (ce * scale).backward()
    ref = logits.float().requires_grad_()
    expected = F.cross_entropy(ref, labels, reduction="sum", ignore_index=-100)
    (expected * scale).backward()
    assert ce.dtype == torch.float32 and mine.grad.dtype == logits.dtype
    torch.testing.assert_close(ce, expected, rtol=1e-5, atol=1e-4)
    tol = 1e-6 if logits.dtype == torch.float32 else 4e-3  # bf16: the reference gradient rounded to it
    torch.testing.assert_close(mine.grad.float(), ref.grad, rtol=0, atol=tol)
    ignored = labels < 0
    picked = logits.float().gather(1, labels.clamp(min=0)[:, None])
    above = (logits.float() > picked).sum(-1)
    assert torch.equal(rank[~ignored], above[~ignored])
    assert torch.equal(rank == 0, (logits.float().argmax(-1) == labels) & ~ignored)  # rank 0 = top-1 hit
    assert torch.all(rank[ignored] == logits.shape[1]) and torch.all(mine.grad[ignored] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 63, 64, 200])
def test_chunked_cross_entropy_is_torch_cross_entropy(dtype, rows):
    """Rows on both sides of a chunk boundary; value, gradient, ranks."""
    torch.manual_seed(rows)
    check_against_torch((torch.randn(rows, 300) * 4).to(dtype), torch.randint(0, 300, (rows,)), compiled=False)


@pytest.mark.parametrize("compiled", [False, True])
def test_unlabelled_rows_add_nothing(compiled):
    """Rows labelled IGNORE (-100), one at a chunk boundary: no term, zero gradient, rank N
    (never a hit). Compiled: the same numbers through torch.compile."""
    torch.manual_seed(0)
    labels = torch.randint(0, 300, (150,))
    labels[::3] = -100
    labels[64] = -100
    check_against_torch((torch.randn(150, 300) * 4).to(torch.bfloat16), labels, compiled=compiled)


def test_compiled_falls_back_to_eager_when_compiling_fails(monkeypatch, capsys):
    """A machine without a working compiler still trains: one message, then the eager math."""
    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("no compiler")
        return run

    monkeypatch.setattr(cross_entropy, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(1)
    labels = torch.randint(0, 50, (20,))
    check_against_torch(torch.randn(20, 50), labels, compiled=True)
    assert capsys.readouterr().err.count("running it eager") == 2  # forward and gradient, once each
    assert cross_entropy._compiled == {"forward": None, "gradient": None}
