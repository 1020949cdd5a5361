"""The speculative decoding loop: prefill -> draft -> verify -> accept -> update.

One ``SpeculativeEngine`` pairs a target with a drafter. A batch of ragged prompts runs
together; each row has its own sampling parameters, generator, stop conditions and
accepted lengths, and leaves the batch as soon as it finishes. Every stage is timed.

Token bookkeeping per row: ``generated`` holds every token the target has chosen. The
last of them, g0, is not yet in the KV cache: it is the root of the next step's tree.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import torch

from .acceptance import Acceptance, accept_greedy, accept_sampled, accept_tree_sampling
from .adaptive import AdaptivePolicy, finish_weights
from .drafters.base import DraftContext, Drafter, Proposal
from .errors import SpecdraftError
from .models import Target
from .plantrace import PlanTrace
from .prefill import prefill
from .recent import RecentStates
from .rows import STAGES, Batch, GenerationResult, Row, StageTimer, StepEvent  # noqa: F401 (STAGES: re-exported)
from .sampling import SamplingParams, knobs, make_generator, sample, target_probs
from .textstream import TextStream
from .tree import TreeBatch, children_confidence, pack_beams

class SpeculativeEngine:
    """Exact speculative decoding of ``target`` with candidates from ``drafter``."""

    def __init__(self, target: Target, drafter: Drafter, max_tree_tokens: int | None | str = "auto",
                 policy: AdaptivePolicy | None = None):
        """``max_tree_tokens``: the most tokens a verify step may hold over the whole batch;
        each row's beams are cut to depth ``max_tree_tokens // rows`` (at least g0 alone).
        Under load a tree costs more than it saves: on 2 CPU cores with lookup drafting,
        16 concurrent requests fell from 94.6 to 56.9 tokens/s without a cap and ran at
        86.9 (plain decoding's rate) with a cap of 8. "auto": 8 on CPU, no cap on GPUs,
        no cap with a policy (it weighs the tree's cost itself); None: no cap.

        ``policy``: adaptive drafting (``specdraft.adaptive``): each step drafts only as
        deep as pays, or not at all; None keeps the drafter's fixed shape."""
        self.target = target
        self.drafter = drafter
        self.policy = policy
        if policy is not None:
            drafter.fit_shape(policy.cost)  # a default shape may widen where the policy can prune it
        self.trace = PlanTrace(drafter=type(drafter).__name__)  # SPECDRAFT_PLAN_TRACE=FILE: one JSON line per step
        if max_tree_tokens == "auto":
            max_tree_tokens = 8 if target.device.type == "cpu" and policy is None else None
        self.max_tree_tokens = max_tree_tokens
        self.window = int(getattr(drafter, "context_window", 0))  # recent states the drafter reads (0: none)
        self.feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # target layers it reads

    # ---- public API -------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
        """Decode a batch of token-id prompts; results in input order."""
        results: list[GenerationResult | None] = [None] * len(prompts)
        for event in self.run(prompts, params):
            if event.result is not None:
                results[event.request_id] = event.result
        return results  # type: ignore[return-value]

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[str | GenerationResult]:
        """Text deltas of one request as they are accepted, then its GenerationResult.

        The deltas join to a prefix of the final text at every moment (``TextStream``:
        an incomplete UTF-8 sequence or a possible start of a stop string is held back)."""
        text = TextStream(self.target.tokenizer, params.stop)
        for event in self.run([prompt], params):
            delta = text.push(event.new_ids, event.result)
            if delta:
                yield delta
            if event.result is not None:
                yield event.result

    def run(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> Iterator[StepEvent]:
        """The decoding loop as a stream of per-request events (index = position in ``prompts``)."""
        if not prompts:
            return
        batch, events = self.start(prompts, params)
        batch.static = True  # nothing joins: the call lasts as long as its last row
        yield from events
        while batch.rows:
            yield from self.step(batch)

    def run_continuous(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                       max_rows: int) -> Iterator[StepEvent]:
        """Continuous batching over a known list (e.g. a distillation set): at most ``max_rows``
        rows decode together; between steps the next prompts, in list order, join as soon as
        a quarter of ``max_rows`` is free (or all that is left fits). Event ids are indices
        into ``prompts``. Joining in groups amortises a prefill and a cache copy; give the
        prompts sorted by length so that the rows in flight have similar widths."""
        if not prompts:
            return
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        group = max(1, max_rows // 4)
        batch, events = self.start(prompts[:max_rows], params_list[:max_rows])
        yield from events
        queued = min(max_rows, len(prompts))
        while batch.rows or queued < len(prompts):
            free = min(max_rows - len(batch.rows), len(prompts) - queued)
            if free >= group or (free and queued + free == len(prompts)) or not batch.rows:
                ids = list(range(queued, queued + free))
                queued += free
                yield from self.admit(batch, [prompts[i] for i in ids], [params_list[i] for i in ids], ids)
            if batch.rows:
                yield from self.step(batch)

    def start(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              ids: list[int] | None = None) -> tuple[Batch, list[StepEvent]]:
        """Prefill ``prompts`` into a new batch; events carry ``ids`` (default 0..n-1)."""
        batch, events = self._prefill_batch(prompts, params, ids)
        self.drafter.start(batch.ctx)
        self._drop_finished(batch)
        return batch, events

    def admit(self, batch: Batch, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              ids: list[int]) -> list[StepEvent]:
        """Continuous batching: prefill new requests and let them join ``batch`` between steps."""
        new, events = self._prefill_batch(prompts, params, ids)
        self._drop_finished(new, tell_drafter=False)  # e.g. max_new_tokens=1: done at prefill
        if not new.rows:
            return events
        batch.steady = False  # the drafter's next call feeds the new rows' prompts
        if not batch.rows:
            self.drafter.start(new.ctx)
            batch.rows, batch.cache, batch.hidden, batch.ctx = new.rows, new.cache, new.hidden, new.ctx
            batch.recent, batch.features = new.recent, new.features
        else:
            batch.cache.extend(new.cache)
            batch.rows = batch.rows + new.rows
            batch.hidden = torch.cat([batch.hidden, new.hidden])
            if batch.recent is not None:
                batch.recent.extend(new.recent)
            if batch.features is not None:
                batch.features = torch.cat([batch.features, new.features])
            self.drafter.add_rows(new.ctx)
            batch.ctx = self._context(batch)
        for stage, secs in new.timer.seconds.items():
            batch.timer.seconds[stage] += secs
        return events

    def _prefill_batch(self, prompts, params, ids) -> tuple[Batch, list[StepEvent]]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        rows = self._make_rows(prompts, params_list, ids if ids is not None else list(range(len(prompts))))
        device = self.target.device
        # Slots: prompt + new tokens + tree slack, never beyond the context (rows stop there:
        # Row.extend; drafts are cut to it), so a huge max_new_tokens cannot size a huge cache.
        capacity = min(max(len(p) for p in prompts) + max(p.max_new_tokens for p in params_list),
                       self.target.max_context) + 64
        batch = Batch(rows=rows, cache=None, hidden=None, ctx=None, timer=StageTimer(device))
        with batch.timer("prefill"):
            tail, features, batch.cache = prefill(self.target, [r.prompt for r in rows], capacity,
                                                  self.feature_layers)
            batch.hidden = tail[:, -1]
            batch.features = None if features is None else features[:, -1]
            if self.window:
                counts = torch.tensor([min(2, len(r.prompt)) for r in rows], device=device)
                batch.recent = RecentStates.start(tail, counts, self.window)
            first = self._choose(rows, self.target.logits(batch.hidden))
        for row in rows:
            row.steps += 1
            row.hist[1] += 1
        events = self._append(batch, [[t] for t in first.tolist()])
        batch.ctx = self._context(batch)
        return batch, events

    def step(self, batch: Batch) -> list[StepEvent]:
        """One draft -> verify -> accept -> update round for every row of ``batch``.

        A step planned without drafting (by the policy, or because no row may hold a drafted
        token: ``_plan``), and one whose proposal holds no drafted token, runs as
        ``_plain_step``: no tree packing, and in the first case no drafter call."""
        target, timer, cache, ctx = self.target, batch.timer, batch.cache, batch.ctx
        stats = [r.adapt for r in batch.rows] if self.policy is not None else None
        step_start, width = time.perf_counter(), cache.width  # the policy learns what steps really cost
        weights = finish_weights(self._remaining(batch.rows)) if stats is not None and batch.static else None
        depth, ctx = self._plan(batch, ctx, stats, weights)
        if depth == 0:
            batch.steady = False  # the drafter's next call catches up on this step's token
            return self._plain_step(batch, proposed=False, started=step_start)
        with timer("draft"):
            started = time.perf_counter()
            proposal = self._clip(self.drafter.propose(ctx), ctx.budget)
            drafting = time.perf_counter() - started
            if stats is not None:
                proposal = self._adapt(proposal, batch, ctx, depth, drafting, weights)
        if self._plain(proposal):
            events = self._plain_step(batch, proposed=True, started=step_start + drafting)
            self._judge_look(stats, None, step_start, width)
            return events
        with timer("verify"):
            tree = pack_beams(proposal.beams, proposal.valid)
            positions = cache.lengths[:, None] + tree.depth
            tree_hidden, tree_features = self._forward(tree.tokens, positions, cache.attention_mask(tree.mask), cache)
            tree_logits = target.logits(tree_hidden)
        with timer("accept"):
            acc = self._accept(batch.rows, tree, proposal, tree_logits)
        with timer("update"):
            cache.commit(acc.path, acc.n)
            path_tokens = tree.tokens.gather(1, acc.path)
            self.drafter.observe(ctx, path_tokens, acc.n)
            self._keep_states(batch, tree_hidden, tree_features, acc)
            # Drafted depth offered per row: the longest valid beam, g0 not counted.
            offered = (proposal.valid.any(dim=1).sum(dim=-1) - 1).tolist()
            if stats is not None:
                predicted = None if proposal.confidence is None else \
                    children_confidence(tree.owner, tree.valid, proposal.confidence, acc.beam)
                self.policy.observe(stats, offered, (acc.n - 1).tolist(), predicted, off=False)
            sizes = tree.real.sum(dim=1).tolist()
            gained = []
            for row, path, n, nxt, depth, size in zip(batch.rows, path_tokens.tolist(), acc.n.tolist(),
                                                      acc.next_token.tolist(), offered, sizes):
                row.steps += 1
                row.hist[n] += 1
                row.drafted[depth] += 1
                row.tree_tokens += size
                gained.append(path[1:n] + [nxt])
            events = self._append(batch, gained)
            batch.ctx = self._context(batch)
            self._drop_finished(batch)
        if stats is not None:
            self.policy.observe_step(True, len(stats), tree.tokens.numel(), width, time.perf_counter() - step_start - drafting)
            self._judge_look(stats, acc.n, step_start, width)
        return events

    def _plan(self, batch: Batch, ctx: DraftContext, stats, weights) -> tuple[int | None, DraftContext]:
        """How deep this step drafts, and the context to draft with: 0 for a plain step (the
        policy's choice, or no row may hold a drafted token: the tree-token cap over many rows
        or one token left each, where a drafter call could only propose g0); with a policy its
        depth, the budget cut to it; without one None (the drafter's own shape)."""
        if stats is None:
            return (0 if int(ctx.budget.max()) <= 1 else None), ctx
        depth = self.policy.plan(stats, ctx.budget, batch.cache.width, weights, reach=self.drafter.max_depth(ctx))
        self.trace(self.policy, stats, depth, batch.cache.width)
        if depth:
            ctx = replace(ctx, budget=ctx.budget.clamp(max=self.policy.call_depth(depth) + 1))
        return depth, ctx

    @staticmethod
    def _keep_states(batch: Batch, tree_hidden: torch.Tensor, tree_features: torch.Tensor | None,
                     acc: Acceptance) -> None:
        """After verification: the target's state at each row's last accepted token (and its
        feature-layer states, its recent states) for the next step's drafter."""
        every = torch.arange(len(batch.rows), device=tree_hidden.device)
        batch.hidden = tree_hidden[every, acc.last]
        if tree_features is not None:
            batch.features = tree_features[every, acc.last]
        if batch.recent is not None:  # every accepted token's state, g0's first
            batch.recent.push(tree_hidden.gather(1, acc.path[:, :, None].expand(-1, -1, tree_hidden.shape[-1])), acc.n)

    def _judge_look(self, stats, n_accepted: torch.Tensor | None, step_start: float, width: int) -> None:
        """Tell the policy what a look step (drafted although the rates said off) gained:
        n_accepted (B,) tokens per row, g0 included (None: the step ran plain). Read only on
        look steps (a host sync)."""
        if stats is not None and self.policy.looking:
            gained = 0 if n_accepted is None else int(n_accepted.sum()) - len(stats)
            self.policy.observe_look(stats, gained, time.perf_counter() - step_start, width)

    def _adapt(self, proposal: Proposal, batch: Batch, ctx: DraftContext, depth: int,
               seconds: float, weights: list[float] | None) -> Proposal:
        """Cut the proposal to what the policy finds worth verifying (valid mask only)."""
        stats = [r.adapt for r in batch.rows]
        self.policy.draft_time.record(self.policy.call_depth(depth), seconds, steady=batch.steady)  # DraftTimer.catch_up
        batch.steady = True
        self.policy.observe_offers(stats, proposal.valid[:, :, 1:].any(dim=2).any(dim=1).tolist())
        # Sampled drafts (q) must not be cut by their own drawn tokens' confidences.
        use_conf = ctx.greedy | (proposal.q is None)
        valid = self.policy.choose(proposal, stats, use_conf, batch.cache.width, seconds, self.policy.must_verify, weights)
        return replace(proposal, valid=valid)

    @staticmethod
    def _plain(proposal: Proposal) -> bool:
        """Whether a proposal without drafted tokens may run as ``_plain_step`` (g0 alone, no tree):
        always; verifying g0 alone draws from p (argmax if greedy) exactly as the plain step does."""
        return not bool(proposal.valid[:, :, 1:].any())

    def _plain_step(self, batch: Batch, proposed: bool, started: float | None = None) -> list[StepEvent]:
        """One autoregressive step for every row: the cheapest step there is (g0 alone,
        no tree). ``proposed``: the drafter was called this step (it observes the outcome);
        ``started``: when the step began, drafting excluded (for the policy's step costs)."""
        target, timer, cache, rows = self.target, batch.timer, batch.cache, batch.rows
        B, device, width = len(rows), target.device, cache.width
        with timer("verify"):
            g0 = batch.ctx.g0[:, None]
            mask = cache.attention_mask(torch.ones(B, 1, 1, dtype=torch.bool, device=device))
            hidden, features = self._forward(g0, cache.lengths[:, None], mask, cache)
            hidden = hidden[:, 0]
            logits = target.logits(hidden)
        with timer("accept"):
            chosen = self._choose(rows, logits)
        with timer("update"):
            ones = torch.ones(B, dtype=torch.long, device=device)
            cache.commit(torch.zeros(B, 1, dtype=torch.long, device=device), ones)
            if proposed:
                self.drafter.observe(batch.ctx, g0, ones)
            batch.hidden = hidden
            if features is not None:
                batch.features = features[:, 0]
            if batch.recent is not None:
                batch.recent.push(hidden[:, None], ones)
            if self.policy is not None:
                self.policy.observe([r.adapt for r in rows], [0] * B, [0] * B, None, off=not proposed)
            for row in rows:
                row.steps += 1
                row.hist[1] += 1
                row.drafted[0] += 1
                row.tree_tokens += 1
            events = self._append(batch, [[t] for t in chosen.tolist()])
            batch.ctx = self._context(batch)
            self._drop_finished(batch)
        if self.policy is not None and started is not None:
            self.policy.observe_step(False, B, B, width, time.perf_counter() - started)
        return events

    def cancel(self, batch: Batch, ids: set[int]) -> None:
        """Drop the rows whose ids are in ``ids`` (e.g. a client went away); no events."""
        for row in batch.rows:
            if row.request_id in ids:
                row.finish_reason = "cancelled"
        self._drop_finished(batch)

    # ---- stages -----------------------------------------------------------------------

    def _make_rows(self, prompts, params_list, ids) -> list[Row]:
        rows = []
        for i, prompt, p in zip(ids, prompts, params_list):
            p.validate()
            if not prompt:
                raise SpecdraftError("empty prompt")
            if len(prompt) >= self.target.max_context:
                raise SpecdraftError(
                    f"prompt has {len(prompt)} tokens; the target's context is {self.target.max_context}")
            gen = None if p.greedy else make_generator(p.seed, self.target.device)
            adapt = self.policy.new_row(self.drafter, p) if self.policy is not None else None
            rows.append(Row(request_id=i, prompt=list(prompt), params=p, generator=gen, adapt=adapt))
        return rows

    def _forward(self, tokens, positions, mask, cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``Target.forward``'s hidden states (B, N, d) and, for a drafter with feature
        layers, the target's states after them (B, N, n, d); else None."""
        return self.target.forward_features(tokens, positions, mask, cache, self.feature_layers)

    def _choose(self, rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
        """The target's own token from logits (B, V): argmax or a sample from p."""
        choice = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = target_probs(logits[idx], *self._knobs([rows[i] for i in sampled], logits.device))
            choice[idx] = sample(probs, [rows[i].generator for i in sampled])
        return choice

    @staticmethod
    def _knobs(rows: list[Row], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return knobs([r.params for r in rows], device)

    def _remaining(self, rows: list[Row]) -> list[int]:
        """Tokens each row may still generate (its own limit, or the target's context)."""
        return [min(r.params.max_new_tokens - len(r.generated),
                    self.target.max_context - len(r.prompt) - len(r.generated)) for r in rows]

    def _context(self, batch: Batch) -> DraftContext:
        rows, device = batch.rows, self.target.device
        # A beam may hold no more tokens than the row may still generate or fit in its
        # context, nor more than its share of the step's tree-token cap.
        share = max(1, self.max_tree_tokens // max(len(rows), 1)) if self.max_tree_tokens else 1 << 30
        left = self._remaining(rows)
        ctx = DraftContext(
            tokens=[torch.tensor(r.prompt + r.generated, device=device) for r in rows],
            g0=torch.tensor([r.generated[-1] if r.generated else 0 for r in rows], device=device),
            hidden=batch.hidden,
            recent=batch.recent,
            features=batch.features,
            budget=torch.tensor([n if r.params.seeded else min(n, share) for r, n in zip(rows, left)],
                                device=device).clamp(min=1),
            greedy=torch.tensor([r.params.greedy for r in rows], device=device),
            request_ids=[r.request_id for r in rows],
            params=[r.params for r in rows])
        # Sampled drafts: how far a seeded row's chain is verified changes its text, and the
        # share depends on the batch, so seeded rows are spared it. Deterministic drafts
        # need no such care (a row then draws one token per token it gains): they keep it.
        if share < max(left, default=0) and any(r.params.seeded for r in rows) and not self.drafter.samples_drafts(ctx):
            ctx.budget = ctx.budget.clamp(max=share)
        return ctx

    @staticmethod
    def _clip(proposal: Proposal, budget: torch.Tensor) -> Proposal:
        """Drop candidate tokens beyond a row's budget (see ``_context``)."""
        depth = torch.arange(proposal.beams.shape[2], device=budget.device)
        valid = proposal.valid & (depth[None, None, :] < budget[:, None, None])
        return replace(proposal, valid=valid)

    def _accept(self, rows: list[Row], tree: TreeBatch, proposal: Proposal, logits: torch.Tensor) -> Acceptance:
        """Greedy rows by longest match, sampling rows by rejection (``acceptance``); a batch
        of one kind skips the other's pass and the row selection."""
        sampling = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampling:
            return accept_greedy(tree, proposal.beams, logits)
        every = len(sampling) == len(rows)
        idx = torch.tensor(sampling, device=logits.device)

        def pick(t: torch.Tensor) -> torch.Tensor:  # the sampling rows of a batch tensor
            return t if every else t[idx]

        sub_rows = [rows[i] for i in sampling]
        sub_tree = tree if every else tree.select(idx)
        probs = target_probs(pick(logits), *self._knobs(sub_rows, logits.device))
        gens = [r.generator for r in sub_rows]
        if proposal.q is not None:
            sampled = accept_sampled(sub_tree, pick(proposal.beams), probs, pick(proposal.q), gens)
        else:
            sampled = accept_tree_sampling(sub_tree, pick(proposal.beams), probs, gens)
        if every:
            return sampled
        acc = accept_greedy(tree, proposal.beams, logits)
        for name in ("path", "n", "next_token", "beam"):
            getattr(acc, name)[idx] = getattr(sampled, name)
        return acc

    def _append(self, batch: Batch, gained: list[list[int]]) -> list[StepEvent]:
        """Add each row's new tokens, applying its stop conditions; return the events."""
        events, decode = [], self.target.tokenizer.decode
        for row, new in zip(batch.rows, gained):
            kept = row.extend(new, self.target.eos_ids, self.target.max_context, decode)
            result = row.result(batch.timer, decode) if row.finish_reason else None
            events.append(StepEvent(request_id=row.request_id, new_ids=kept, result=result))
        return events

    def _drop_finished(self, batch: Batch, tell_drafter: bool = True) -> None:
        alive = [i for i, r in enumerate(batch.rows) if r.finish_reason is None]
        if len(alive) == len(batch.rows):
            return
        keep = torch.tensor(alive, dtype=torch.long, device=self.target.device)
        batch.cache.select_rows(keep)
        if tell_drafter:
            self.drafter.select_rows(keep)
        batch.rows = [batch.rows[i] for i in alive]
        batch.hidden = batch.hidden[keep]
        if batch.recent is not None:
            batch.recent.select(keep)
        if batch.features is not None:
            batch.features = batch.features[keep]
        batch.ctx = self._context(batch)

