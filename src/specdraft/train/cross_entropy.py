"""The heads' training loss: Σ CE over the rows of (n, N) low-precision logits, in float32
math, without float32 copies of the logits.

    CE_r = logsumexp(x_r) − x_r[y_r]          for a row r with a label y_r ∈ [0, N)
    ∂CE_r / ∂x_r = softmax(x_r) − onehot(y_r)    (0 for a row without label, y_r < 0)

log_softmax + nll_loss on (n, N) bfloat16 logits materialise four float32 copies of the
logits (the cast, log q, nll's zero-filled gradient, the cast back): on a CPU those passes
over memory cost more than the output layer's matrix product. Two ways to avoid them, one
math (``rows_forward``, ``rows_gradient``):

- eager: chunks of ``CHUNK_ROWS`` rows (2 MB at N = 8192), each cast, reduced and
  differentiated while it sits in cache;
- compiled (``compiled=True``): the same two functions through ``torch.compile``, which
  fuses each into one loop per row over the whole batch. On this project's 2-core CPU,
  (1024, 8192) bfloat16 logits: forward + backward 35 ms eager, 15 ms compiled; the
  first call of a shape compiles (~10 s).
  Where compiling fails (no C++ compiler), it says so once and runs eager.

The gradient comes back in the logits' dtype, which is where the cast's own backward would
have put it. A row's rank is how many logits exceed its label's (0 = top-1 hit, < k = top-k
hit); a row without label gets rank N, never a hit.
"""

from __future__ import annotations

import sys

import torch

CHUNK_ROWS = 64
_compiled: dict = {}  # name -> the compiled function, or None once compiling has failed


def rows_forward(logits: torch.Tensor, labels: torch.Tensor):
    """(c, N) any float dtype, (c,) long -> (Σ CE over labelled rows: float32 scalar,
    logsumexp per row (c,) float32, rank per row (c,) long)."""
    x = logits.float()
    labelled = labels >= 0
    picked = x.gather(1, labels.clamp(min=0)[:, None])  # (c, 1) the label's logit
    lse = torch.logsumexp(x, dim=-1)
    total = torch.where(labelled, lse - picked[:, 0], 0.0).sum()
    rank = torch.where(labelled, (x > picked).sum(dim=-1), x.shape[1])  # entries strictly above the label
    return total, lse, rank


def rows_gradient(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor):
    """scale · ∂(Σ CE)/∂logits: (c, N) in the logits' dtype, softmax from the saved lse."""
    labelled = (labels >= 0).float()[:, None]  # (c, 1)
    softmax = torch.exp(logits.float() - lse[:, None])
    grad = softmax.scatter_add(1, labels.clamp(min=0)[:, None], -labelled)  # − onehot(y), none without label
    return (grad * (labelled * scale)).to(logits.dtype)


def _compiled_run(name: str, fn, *args):
    """fn(*args) through torch.compile (one graph per input shape); eager once compiling has failed."""
    if _compiled.get(name, True) is not None:
        if name not in _compiled:
            _compiled[name] = torch.compile(fn, dynamic=False)
        try:
            return _compiled[name](*args)
        except Exception as error:  # e.g. no C++ compiler for inductor: the eager math is the same
            _compiled[name] = None
            print(f"specdraft: compiled cross-entropy unavailable ({type(error).__name__}); running it eager",
                  file=sys.stderr)
    return fn(*args)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, compiled: bool):
        if compiled:
            total, lse, rank = _compiled_run("forward", rows_forward, logits, labels)
        else:
            parts = [rows_forward(logits[i:i + CHUNK_ROWS], labels[i:i + CHUNK_ROWS])
                     for i in range(0, logits.shape[0], CHUNK_ROWS)]
            total = torch.stack([p[0] for p in parts]).sum() if parts else logits.new_zeros((), dtype=torch.float32)
            lse = torch.cat([p[1] for p in parts]) if parts else logits.new_zeros(0, dtype=torch.float32)
            rank = torch.cat([p[2] for p in parts]) if parts else labels.new_zeros(0)
        ctx.compiled = compiled
        ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(rank)
        return total, rank

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_rank):
        logits, labels, lse = ctx.saved_tensors
        if ctx.compiled:
            return _compiled_run("gradient", rows_gradient, logits, labels, lse, grad_total), None, None
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            grad[rows] = rows_gradient(logits[rows], labels[rows], lse[rows], grad_total)
        return grad, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor,
                      compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, N) any float dtype, labels (n,) long in [0, N) or negative (IGNORE: the
    row has no label) -> (Σ CE over the labelled rows as a float32 scalar with its gradient,
    (n,) long rank of each label; N for a row without label). The value and gradient are
    ``F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE)``'s
    (tested, eager and compiled). Taking every row and skipping the unlabelled ones here,
    instead of selecting the labelled rows first, keeps the output layer's matrix product
    at one shape per batch."""
    return _CrossEntropySum.apply(logits, labels, compiled)
