"""An independent draft model: a small causal LM sharing the target's tokenizer.

Each step the draft proposes, per row, beams (B, W, D+1) = [g0, d1..dD] with
D = min(gamma, budget - 1):

- Greedy rows: a beam search of width W over the draft's log-probs (W = 1: the argmax
  chain). Shared prefixes are deduplicated by the engine's tree packing.
- Sampling rows (``sample_drafts``, the default): W chains drawn from the draft's own
  q_j = sampling.target_probs(draft logits) at the row's temperature/top-k/top-p, with a
  per-row generator. The W first tokens are distinct, drawn one after another without
  replacement from q_1 (chain k reports q_1 without chains 0..k-1's tokens, renormalised);
  deeper, each chain draws d_j from q_j given its own path. The proposal reports q
  (B, W, D, V): one chain is verified by speculative sampling, several by recursive
  rejection without replacement (``acceptance.accept_chains_sampling``); both exact for any
  q. A beam is a poor proposal under sampling: accepted with probability p(x) for its token
  x, where a drawn token is accepted with sum_x min(p(x), q(x)).
  With ``sample_drafts`` False, sampling rows get the beams too (deterministic candidates,
  q None, recursive rejection: exact as well).

Draft KV cache (a ``CompactCache``; invariants per row b):
- slots [0, lengths[b]) hold the draft's keys/values of ``ids[b, :lengths[b]]``, which is
  always a prefix of the row's history (prompt + generated) and never includes g0 after a
  step: g0 is fed at the start of the next ``propose``, whose root logits draft d1.
- ``propose`` first *catches up*: it compares the cached ids with ``ctx.tokens``, forgets
  anything that differs (truncate) and feeds the missing tokens, ragged across rows, in
  one forward (the whole prompt + g0 at the first step; later the new g0, plus the last
  accepted draft when the whole chain was accepted). Then D - 1 forwards of W tokens
  each draft the tree; their keys/values are written past the committed slots at
  [width, width + (D-1)W) and not committed: the width is reset afterwards, so they
  count for nothing until ``observe``.
- ``observe`` commits the accepted drafts' entries from that region (one gather/scatter
  per layer) so they are not recomputed. Skipping ``observe`` is safe: the next catch-up
  would recompute them.

Metrics: ``num_parameters`` is N_draft; the memory-bound speed-up of a run with block
efficiency tau is ``memory_bound_speedup(tau, gamma, N_draft, N_target)`` =
tau / (1 + gamma * N_draft / N_target) (BRIEF section 5).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import fastpath
from ..cache import CompactCache
from ..errors import SpecdraftError
from ..models import Target, parameter_count  # re-exported: tests and users import it here
from ..sampling import draw_along, draw_distinct, knobs, offset_generator, target_probs
from ..vocab import DraftVocab
from .base import DraftContext, Drafter, Proposal, check_shapes
from .draft_folder import load_draft_folder, shared_parameters

DRAFT_SEED_OFFSET = 0x5EED_D7AF  # the draft's stream differs from the target's, same seed
DEFAULT_GAMMA = 4  # drafted tokens per step when neither --gamma nor the folder's config says


def memory_bound_speedup(tau: float, gamma: int, n_draft: int, n_target: int) -> float:
    """MBSU = tau / (1 + gamma * N_draft / N_target)."""
    return tau / (1 + gamma * n_draft / n_target)


class DraftModelDrafter(Drafter):
    """Draft with ``model`` (any HF causal LM with the target's vocabulary)."""

    name = "draft"
    acceptance_prior = 0.6

    def __init__(self, model: torch.nn.Module, gamma: int = DEFAULT_GAMMA, beam_width: int = 1,
                 tokenizer=None, name: str = "draft model", vocab: DraftVocab | None = None,
                 sample_drafts: bool = True):
        check_shapes(beam_width=beam_width, gamma=gamma)
        self.sample_drafts = sample_drafts  # False: sampling rows get the beam search's beams too
        self.draft = Target(model=model, tokenizer=tokenizer, name=name)
        self.gamma, self.W = gamma, min(beam_width, vocab.size if vocab is not None else self.draft.vocab_size)
        # Parameters the draft adds: embeddings shared with the target cost nothing.
        self.num_parameters = parameter_count(model) - shared_parameters(model)
        self.vocab = vocab
        # With a draft vocabulary only its N rows of the output layer are ever multiplied.
        self.rows = (model.get_output_embeddings().weight.detach()[vocab.ids()].clone()
                     if vocab is not None else None)
        self.cache: CompactCache | None = None
        self.ids: torch.Tensor | None = None  # (B, C) token ids of the cached slots
        self.generators: list = []
        self.pending: dict | None = None  # the last proposal's tree, until observe

    # ---- loading ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, target, gamma: int | None = None,
             beam_width: int | None = None) -> "DraftModelDrafter":
        """Load a draft model folder (``load_draft_folder``) as a draft for ``target``."""
        model, tokenizer, cfg, vocab = load_draft_folder(path, target, target.dtype)
        # Shapes not given fall back to what `specdraft sweep` recorded in the config.
        return cls(model, gamma=gamma or cfg.get("gamma") or DEFAULT_GAMMA, beam_width=beam_width or cfg.get("beam_width") or 1,
                   tokenizer=tokenizer if tokenizer is not None else target.tokenizer, name=str(path), vocab=vocab,
                   sample_drafts=cfg.get("sample_drafts", True))

    # ---- the drafter protocol -----------------------------------------------------------

    def start(self, ctx: DraftContext) -> None:
        """A fresh batch: empty cache, one generator per sampling row."""
        self.cache, self.ids, self.generators = self._fresh_state(ctx)
        self.pending = None

    def add_rows(self, ctx: DraftContext) -> None:
        """New rows join the batch with empty caches; the next propose feeds their prompts."""
        if self.cache is None:
            return self.start(ctx)
        cache, ids, generators = self._fresh_state(ctx)
        self.cache.extend(cache)
        width = max(self.ids.shape[1], ids.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1)  # noqa: E731
        self.ids = torch.cat([pad(self.ids), pad(ids)])
        self.generators = self.generators + generators
        self.pending = None

    def _fresh_state(self, ctx: DraftContext):
        B, device = len(ctx.tokens), ctx.g0.device
        longest = max(len(t) for t in ctx.tokens)
        capacity = longest + self.gamma * self.W + 64  # the buffers grow by doubling if needed
        cache = CompactCache(self.draft.num_layers, B, capacity, device).allocate(*self.draft.kv_shape, self.draft.dtype)
        ids = torch.full((B, capacity), -1, dtype=torch.long, device=device)
        generators = [None if p.greedy else
                      offset_generator(p.seed, DRAFT_SEED_OFFSET, device)
                      for p in ctx.params] if ctx.params else [None] * B
        return cache, ids, generators

    def max_depth(self, ctx=None) -> int:
        return self.gamma

    def may_sample_drafts(self) -> bool:
        return self.sample_drafts and self.gamma > 0

    def samples_drafts(self, ctx: DraftContext) -> bool:
        """Sampling rows and room to draft: their drafts drawn from q (``_draft_tree``)."""
        return self.may_sample_drafts() and int(ctx.budget.max()) > 1 and not bool(ctx.greedy.all())

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        if self.cache is None or self.cache.lengths.shape[0] != len(ctx.tokens):
            self.start(ctx)
        longest = max(len(t) for t in ctx.tokens)
        if longest > self.draft.max_context:
            raise SpecdraftError(f"a sequence of {longest} tokens exceeds the draft model's context "
                                 f"({self.draft.max_context}); use a draft with a longer context")
        depth = min(self.gamma, int(ctx.budget.max()) - 1, self.draft.max_context - longest)
        root_logits = self._catch_up(ctx.tokens)
        beams, q, slots, confidence, live = self._draft_tree(root_logits, ctx, max(depth, 0))
        # The tree's entries stay in the buffer past the width until observe commits some.
        self.cache.truncate(self.cache.lengths)
        self.pending = {"beams": beams, "slots": slots}
        steps = torch.arange(beams.shape[2], device=beams.device)
        valid = (steps[None, None, :] < ctx.budget[:, None, None]) & (live[:, :, None] | (steps == 0))
        return Proposal(beams=beams, valid=valid, q=q, confidence=confidence)

    @torch.no_grad()
    def observe(self, ctx: DraftContext, accepted: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """Commit the accepted drafts' cached entries (those the draft had fed)."""
        pending, self.pending = self.pending, None
        if pending is None or pending["slots"].shape[2] == 0:
            return
        beams, slots = pending["beams"], pending["slots"]
        B, W, L = beams.shape
        L = min(L, accepted.shape[1])
        rows = torch.arange(B, device=beams.device)
        beyond = torch.arange(L, device=beams.device)[None, None, :] >= n_accepted[:, None, None]
        match = ((beams[:, :, :L] == accepted[:, None, :L]) | beyond).all(dim=2)  # (B, W)
        beam = match.int().argmax(dim=1)
        fed = slots.shape[2]
        count = (n_accepted - 1).clamp(min=0, max=fed) * match.any(dim=1)
        start = self.cache.lengths.clone()
        self.cache.commit(slots[rows, beam], count)
        self._record(start, beams[rows, beam, 1: 1 + fed])

    def select_rows(self, keep: torch.Tensor) -> None:
        if self.cache is None:
            return
        self.cache.select_rows(keep)
        self.ids = self.ids.index_select(0, keep)
        self.generators = [self.generators[i] for i in keep.tolist()]
        self.pending = None

    def compile(self, backend: str = "inductor") -> bool:
        """Compile the draft's decoder stack (``Target.compile``). A small draft's forward is
        bound by per-op overhead, not by its weights: on the AVX2 EPYC (float32) the shipped
        draft's call at gamma = 1 fell from 11.0 to 8.2 ms (docs/draft_model.md)."""
        self.draft.compile(backend)
        self.compiled = True
        return True

    def warmed(self) -> None:
        self.draft.warmed()

    # ---- internals ----------------------------------------------------------------------

    def _catch_up(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        """Sync the cache with each row's history, g0 included; return (B, N) draft logits
        (``_logits``) after g0. Rows feed different numbers of tokens (right-padded, at least 1)."""
        cache, device = self.cache, self.ids.device
        B = len(tokens)
        sizes = [len(t) for t in tokens]
        T, M = torch.tensor(sizes, device=device), max(sizes)
        self._reserve(M)
        history = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True, padding_value=-1)
        cols = torch.arange(M, device=device)
        same = (self.ids[:, :M] == history) & (cols[None, :] < cache.lengths[:, None])
        # Keep the longest cached prefix that agrees with the history, minus g0 at least:
        # g0 must be fed now, its logits draft d1.
        keep = torch.minimum(same.to(torch.int8).cumprod(dim=1).sum(dim=1), T - 1)
        cache.truncate(keep)
        n_new = T - keep
        N = int(n_new.max())
        steps = torch.arange(N, device=device)
        real = steps[None, :] < n_new[:, None]
        new = history.gather(1, (keep[:, None] + steps).clamp(max=M - 1)).masked_fill(~real, 0)
        causal = steps[:, None] >= steps[None, :]
        # Padding queries see only themselves, so no attention row is empty.
        mask = (causal[None] & real[:, None, :]) | (torch.eye(N, dtype=torch.bool, device=device) & ~real[:, :, None])
        hidden = self.draft.forward(new, keep[:, None] + steps, cache.attention_mask(mask), cache)
        cache.commit(steps.expand(B, N), n_new)
        self._record(keep, new)
        return self._logits(hidden[torch.arange(B, device=device), n_new - 1])

    def _draft_tree(self, logits: torch.Tensor, ctx: DraftContext, depth: int):
        """Draft ``depth`` levels of W beams from the root logits (B, N) (``_logits``).

        Returns beams (B, W, depth+1) with g0 first; q (B, W, depth, V) (sampling rows' laws,
        ``_Draws``) or None; slots (B, W, depth-1): for each beam, the offsets (from the
        committed width) where its drafts d1..d_{depth-1} were cached; confidence (B, W,
        depth+1): the draft's probability of each token given its beam's earlier ones (g0:
        1); live (B, W): False for a sampling row's chain that found no token left to draw.
        """
        cache, W = self.cache, self.W
        B, device = logits.shape[0], logits.device
        g0 = ctx.g0[:, None, None].expand(B, W, 1)
        live = torch.ones(B, W, dtype=torch.bool, device=device)
        if depth == 0:
            return g0, None, torch.zeros(B, W, 0, dtype=torch.long, device=device), torch.ones(B, W, 1, device=device), live
        draws = _Draws.of(ctx, self.generators) if self.samples_drafts(ctx) else None
        base, width = cache.lengths.clone(), cache.width  # g0 sits at position base - 1
        tokens, parent, score, q_j, distinct = self._choose(logits[:, None], torch.zeros(B, 1, device=device), draws, 0)
        if distinct is not None:
            live[draws.rows] = distinct
        paths = self._to_target(tokens)[:, :, None]  # target ids: fed to the draft, verified
        confs = _token_probs(logits[:, None], tokens, parent)
        slots = torch.zeros(B, W, 0, dtype=torch.long, device=device)
        ancestry = torch.zeros(B, W, 0, dtype=torch.bool, device=device)
        past = (torch.arange(width, device=device)[None, :] < base[:, None])[:, None, :].expand(B, W, width)
        qs = [q_j]
        eye = torch.eye(W, dtype=torch.bool, device=device)[None].expand(B, W, W)
        for level in range(1, depth):  # feed level `level`, draft level + 1
            own = (level - 1) * W + torch.arange(W, device=device)
            ancestry = torch.cat([ancestry, eye], dim=2)  # each beam sees its path and itself
            cache.width = width + (level - 1) * W  # write this level after the earlier ones
            mask = torch.cat([past, ancestry], dim=2)[:, None]
            positions = (base + level - 1)[:, None].expand(B, W)
            # contiguous: a compiled draft (``compile``) specialises on strides
            hidden = self.draft.forward(paths[:, :, -1].contiguous(), positions.contiguous(), mask, cache)
            level_logits = self._logits(hidden)
            tokens, parent, score, q_j, _ = self._choose(level_logits, score, draws, level)
            slots = torch.cat([slots, own.expand(B, W)[:, :, None]], dim=2)
            slots, paths, ancestry, confs = (x.gather(1, parent[:, :, None].expand(-1, -1, x.shape[2]))
                                             for x in (slots, paths, ancestry, confs))
            paths = torch.cat([paths, self._to_target(tokens)[:, :, None]], dim=2)
            confs = torch.cat([confs, _token_probs(level_logits, tokens, parent)], dim=2)
            qs.append(q_j)
        cache.width = width
        q = self._widen(torch.stack(qs, dim=2)) if draws is not None else None  # (B, W, depth, V)
        confidence = torch.nn.functional.pad(confs, (1, 0), value=1.0)
        return torch.cat([g0, paths], dim=2), q, slots, confidence, live

    def _choose(self, logits: torch.Tensor, score: torch.Tensor, draws: "_Draws | None", level: int):
        """Level ``level``'s tokens (output ids) from draft logits (B, w, N) (w = 1 at the
        root, else W).

        Every row first takes a beam search's step (the top W of cumulative log-probs; W = 1:
        the argmax). Then the sampling rows (``draws``) replace theirs: at the root W distinct
        tokens drawn without replacement from q_1 (``sampling.draw_distinct``; one draw for
        W = 1), deeper one draw per chain from its own q_j (``sampling.draw_along``), each
        chain its own parent. Returns tokens (B, W), parent (B, W), score (B, W), q (B, W, N)
        (the sampling rows' laws; a point mass on the chosen token elsewhere, never read: greedy
        rows are verified greedily) or None, and at the root distinct (R, W) or None."""
        B, w, N = logits.shape
        W = self.W
        total = (score[:, :w, None] + logits.log_softmax(dim=-1)).flatten(1) if W > 1 else logits[:, 0]
        score, flat = total.topk(W, dim=1)
        tokens, parent = flat % N, flat // N
        if draws is None:
            return tokens, parent, score, None, None
        rows, drawing = draws.rows, draws.drawing(level)
        probs = target_probs(logits[rows], *draws.knobs)  # (R, w, N) the sampling rows' q
        distinct = None
        if level == 0 and W > 1:
            chosen, law, distinct = draw_distinct(logits[:, 0], probs[:, 0], rows, drawing, draws.generators, W)
        else:
            chosen, law = draw_along(logits, probs, rows, drawing, draws.generators), probs
        tokens[rows] = chosen[rows]
        parent[rows] = torch.arange(W, device=logits.device) if w > 1 else 0  # the root: one parent
        q = torch.nn.functional.one_hot(tokens, N).float()
        q[rows] = law
        return tokens, parent, score, q, distinct

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., N) float32 logits over the draft's N outputs: its draft
        vocabulary's ids (``_to_target`` maps them back), else the whole vocabulary (N = V).
        The beam search and the draws work over N; q is widened to V once (``_widen``)."""
        if self.vocab is None:
            return self.draft.logits(hidden)
        with fastpath.active():  # the target's fast layout; this drafter keeps the rows' packed copy
            return fastpath.linear(hidden, self.rows, holder=self).float()

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Output ids (any shape) -> target token ids."""
        return ids if self.vocab is None else self.vocab.to_target(ids)

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        """(..., N) -> (..., V): a distribution over V that is zero outside the draft vocabulary
        (acceptance stays exact: the target's tokens outside it are simply never proposed)."""
        if self.vocab is None:
            return q
        return q.new_zeros(*q.shape[:-1], self.draft.vocab_size).index_copy_(-1, self.vocab.ids(), q)

    def _reserve(self, columns: int) -> None:
        """Make ``ids`` at least ``columns`` wide."""
        if self.ids.shape[1] < columns:
            extra = max(columns, 2 * self.ids.shape[1]) - self.ids.shape[1]
            self.ids = torch.cat([self.ids, self.ids.new_full((self.ids.shape[0], extra), -1)], dim=1)

    def _record(self, start: torch.Tensor, tokens: torch.Tensor) -> None:
        """ids[b, start[b] + i] = tokens[b, i]; entries past a row's cache length are ignored
        by the catch-up comparison, so padding may be written too."""
        n = tokens.shape[1]
        if n == 0:
            return
        self._reserve(int(start.max()) + n)
        self.ids.scatter_(1, start[:, None] + torch.arange(n, device=start.device), tokens)


def _token_probs(logits: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """(B, W, 1) draft probability (temperature 1) of each chosen token under its parent's
    logits (B, w, N): adaptive drafting's confidence (never used for acceptance)."""
    logits = logits.float()
    V = logits.shape[-1]
    # exp(chosen logit - its row's logsumexp): only the chosen entries are gathered, never a
    # whole (B, W, V) copy of the parents' rows (a third of a small draft's call otherwise).
    chosen = logits.flatten(1).gather(1, parent * V + tokens)  # (B, W)
    return (chosen - logits.logsumexp(dim=-1).gather(1, parent)).exp()[:, :, None]


class _Draws:
    """A step's sampling rows: batch indices ``rows`` (R,), their sampling ``knobs``, their
    generators and budgets. A row draws only the tokens its own budget keeps, so its stream
    never depends on how deep the other rows of the batch let the tree go."""

    def __init__(self, rows: torch.Tensor, knobs_, generators: list, budget: list[int]):
        self.rows, self.knobs, self.generators, self.budget = rows, knobs_, generators, budget

    @classmethod
    def of(cls, ctx: DraftContext, generators: list) -> "_Draws":
        rows = (~ctx.greedy).nonzero().flatten()
        index = rows.tolist()
        return cls(rows, knobs([ctx.params[b] for b in index], rows.device), [generators[b] for b in index],
                   ctx.budget[rows].tolist())

    def drawing(self, level: int) -> list[int]:
        """Indices into ``rows`` of the rows whose budget keeps level ``level``'s token."""
        return [i for i, b in enumerate(self.budget) if b > level + 1]
