"""Sampling parameters and the target distribution they define.

The same function turns logits into the distribution p in autoregressive decoding and
at every node of a speculative tree, which is what makes speculative sampling exact:
p is always temperature -> top-k -> top-p -> softmax (the order of transformers'
warpers), per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import SpecdraftError


@dataclass
class SamplingParams:
    """Decoding settings of one request. temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        if self.max_new_tokens <= 0:
            raise SpecdraftError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecdraftError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecdraftError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):  # torch.Generator's range
            raise SpecdraftError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        # An empty stop string matches at once: generation would end after one token.
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SpecdraftError(f"stop strings must be non-empty, got {self.stop!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """A sampling request with a seed: its text must not depend on the batch it is
        decoded in, nor on timings (the engine and the adaptive policy keep its drafts'
        shape fixed for it)."""
        return not self.greedy and self.seed is not None


def knobs(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) tensors (B,) of rows' params: ``target_probs``'s arguments."""
    return (torch.tensor([p.temperature for p in params], device=device),
            torch.tensor([p.top_k for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device))


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Distribution p for sampling rows.

    logits: (B, ..., V) float; temperature (B,) > 0; top_k (B,) long (0 = off);
    top_p (B,) in (0, 1]. Returns float32 probabilities of the same shape.
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    scores = logits.float() / temperature.view(shape)
    V = scores.shape[-1]
    needs_filter = bool(((top_k > 0) & (top_k < V)).any() or (top_p < 1).any())
    if needs_filter:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=scores.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).view(shape)
        drop = rank >= k
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        # top-p keeps the smallest head whose mass reaches top_p: drop a token when the
        # mass strictly before it already reaches top_p (the first token always stays).
        # Rows with top_p == 1 skip this: their float32 running mass can round to 1 before
        # the tail, which would cut tokens a row without top-p must keep.
        probs_sorted = sorted_scores.softmax(dim=-1)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        p_cut = top_p.view(shape).float()
        drop = drop | ((mass_before >= p_cut) & (p_cut < 1))
        drop[..., 0] = False
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores.softmax(dim=-1)


SAMPLE_BLOCK = 256  # tokens per block of the two-level inverse CDF in ``sample``
SAMPLE_DIRECT_MAX = 16384  # rows at most this wide take one running sum instead (a draft vocabulary)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from probs (B, V) (non-negative weights, each row's sum > 0), each
    row with its own generator. Returns (B,) long.

    Inverse CDF: row b takes the first token whose running mass reaches (1 - u_b) * total_b,
    u_b uniform in [0, 1) (float64) from the row's generator. The threshold is > 0, so a
    zero-weight token is never the first to reach it. Sums are float64, so their rounding
    (~1e-16 of the total) is far below float32's in the weights themselves. One draw per row
    instead of torch.multinomial's one exponential draw per vocabulary entry (on this CPU 32
    rows of 49152 took 780 ms that way).

    Two levels over a wide row, because a float64 running sum over the whole vocabulary is a
    slow sequential scan (3.5 ms for 16 rows of 49152 here): block sums (a vectorised
    reduction), the running mass over the blocks, then a running sum inside the one block that
    holds the threshold. Rows of at most ``SAMPLE_DIRECT_MAX`` (a drafter's draft vocabulary)
    take the one running sum directly: over so few entries the scan costs less than the two
    levels' dozen small ops (one row of 8192 on the AVX512-BF16 EPYC: ~20 against ~100 us).
    The choice depends on the width alone, never on the batch, so a row draws the same token
    in any batch.
    """
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=g, device=probs.device)
                     for g in generators])  # float64: 2**-53 steps, not float32's 2**-24
    B, V = probs.shape
    if V <= SAMPLE_DIRECT_MAX:
        mass = probs.to(torch.float64).cumsum(dim=-1)  # (B, V) running mass
        # (1 - u) * total <= total, so the first token reaching it exists and has weight > 0.
        return torch.searchsorted(mass, ((1 - u) * mass[:, -1])[:, None]).squeeze(1).clamp_max(V - 1)
    pad = -V % SAMPLE_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).reshape(B, -1, SAMPLE_BLOCK)  # (B, nb, S)
    mass = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # (B, nb) running block mass
    threshold = (1 - u) * mass[:, -1]
    rows = torch.arange(B, device=probs.device)
    kb = torch.searchsorted(mass, threshold[:, None]).squeeze(1).clamp_max(mass.shape[1] - 1)
    before = torch.where(kb > 0, mass[rows, (kb - 1).clamp(min=0)], torch.zeros_like(threshold))
    inside = blocks[rows, kb].to(torch.float64)  # (B, S) the block holding the threshold
    ki = torch.searchsorted(inside.cumsum(dim=-1), (threshold - before)[:, None]).squeeze(1)
    # The block's own running sum can round a hair below its reduction-sum: then the last
    # token of positive weight in it, never a zero-weight one.
    last = SAMPLE_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(dim=-1)
    return (kb * SAMPLE_BLOCK + torch.minimum(ki, last)).clamp_max(V - 1)


def draw_distinct(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, drawing: list[int],
                  generators: list, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first drafted tokens of ``count`` chains: logits (B, N), probs (R, N) the sampling
    rows' (``rows``, batch indices) q_1. Rows listed in ``drawing`` (indices into ``rows``)
    draw ``count`` distinct tokens, one after another from q_1 with the tokens already drawn
    removed (Gumbel-top-k's law, by inverse CDF from the row's generator ``generators[i]``).

    Returns choice (B, count): the drawn tokens, the argmax where nothing was drawn; q (R,
    count, N): each chain's law given the earlier chains' tokens (what recursive rejection
    without replacement needs, ``acceptance.accept_chains_sampling``); distinct (R, count):
    which chains drew a token (False once a row's q_1 has no mass left, e.g. top-k = 1).

    Example: q_1 = [0.5, 0.3, 0.2], count 2, chain 0 draws token 1: chain 1's law is
    [0.5, 0, 0.2] / 0.7.

    Sequential draws keep each row's stream inverse-CDF draws (``sample``). A Gumbel-top-k
    draw (one topk over float64 keys q / E, E ~ Exp(1)) was measured too, 3 chains on this
    CPU: 0.38 against 0.65 ms over N = 8192, 1.98 against 1.12 ms over V = 49152 (the float64
    logs): not worth a second way to draw."""
    device = logits.device
    choice = logits.argmax(dim=-1)[:, None].repeat(1, count)
    drawn, laws = choice[rows], []
    distinct = torch.ones(len(rows), count, dtype=torch.bool, device=device)
    weights = probs.clone()  # q_1 with the drawn tokens zeroed
    for k in range(count):
        mass = weights.sum(dim=-1, keepdim=True)
        laws.append(weights / mass.clamp(min=torch.finfo(weights.dtype).tiny))
        left = mass[:, 0].gt(0).tolist()
        live = [i for i in drawing if left[i]]
        distinct[[i for i in range(len(rows)) if not left[i]], k] = False
        if live:
            x = sample(weights[live], [generators[i] for i in live])
            drawn[live, k] = x
            weights[live, x] = 0.0
    choice[rows] = drawn
    return choice, torch.stack(laws, dim=1), distinct


def draw_along(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, drawing: list[int],
               generators: list) -> torch.Tensor:
    """Each chain's next token: logits (B, c, N), probs (R, c, N) the sampling rows' q_j;
    rows listed in ``drawing`` (indices into ``rows``) draw y ~ q_j per chain, chain by chain
    within a row, from ``generators[i]``; the others take the argmax. Returns (B, c) ids."""
    c = logits.shape[1]
    choice = logits.argmax(dim=-1)  # (B, c)
    kept = [i * c + k for i in drawing for k in range(c)]
    if kept:
        drawn = choice[rows].flatten()
        drawn[kept] = sample(probs.flatten(0, 1)[kept], [generators[i // c] for i in kept])
        choice[rows] = drawn.view(-1, c)
    return choice


def offset_generator(seed: int | None, offset: int, device) -> torch.Generator:
    """A drafter's own generator for a request seeded ``seed``: seeded seed + ``offset``
    (mod 2**64, torch's range), so its draws differ from the target's; random if None."""
    return make_generator(None if seed is None else (seed + offset) % (1 << 64), device)


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
