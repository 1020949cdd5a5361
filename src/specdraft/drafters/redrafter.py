"""The ``redrafter:PATH`` drafter: beam search over a recurrent draft head.

Each step: h (the target's hidden state whose logits chose g0) and g0 go through the
ReDrafter head's beam search; its W beams of L tokens (g0 included, so L - 1 drafted
tokens) are verified together by the engine's dynamic tree attention. Candidates are
deterministic (no q): under sampling the engine's recursive rejection keeps the output
distributed exactly as the target's. A head with context attention reads each row's latest
target states from the engine (``ctx.recent``) and replaces h by a_t before the search.

Sampled chains (``sample_drafts``, at any W): for rows that sample, a beam is a poor
proposal, accepted with probability p(x) for its token x, where a token *drawn* from the
head's own distribution q (at the row's temperature / top-k / top-p) is accepted with
probability sum_x min(p(x), q(x)) (speculative sampling; the engine's chain acceptance,
exact for any q). So whenever a batch holds a sampling row, every row gets one chain of
``sample_L`` tokens (the checkpoint's sample_length, else L: a drawn token's acceptance
differs from a beam's, and so does the depth that pays; the shipped head draws 4 where its
beams hold 3): sampling rows walk the recurrence drawing y_j ~ q_j and report q; greedy rows
take the argmax, as a beam search of one would. With the checkpoint's sample_chains C > 1
each sampling row draws C chains whose first drafted tokens are distinct, drawn without
replacement from q_1 (the engine tries a second chain's token where the first was rejected:
``acceptance.accept_chains_sampling``); greedy rows keep one.
A batch of greedy rows only gets the W beams
(W = 2 beams of 3 tokens against one chain: greedy τ 1.83 against 1.64 on MT-Bench, bf16;
at T = 1 2 x 3 beams gave τ 1.33, a sampled chain of 3 1.51). The only state kept between
steps is each sampling request's generator.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import fastpath, int8
from ..heads.beam_search import redrafter_beam_search
from ..heads.compiled import CompiledHead
from ..heads.model import ReDrafterHead
from ..sampling import draw_along, draw_distinct, knobs, offset_generator, target_probs
from .base import DraftContext, Drafter, Proposal, check_shapes

DRAFT_SEED_OFFSET = 0x5EED_4EAD  # the head's stream differs from the target's, same seed
# A checkpoint's one beam becomes two under adaptive drafting where verifying the second
# beam's L - 1 tokens costs at most this much more than the chain (``ReDrafter.fit_shape``).
# SmolLM2, MT-Bench, batch 1: on the Xeon with AMX in bfloat16 (5 tree tokens 1.07x 3) two
# beams of 3 drafted τ 2.15 against 2.00 with lookup, 1.62x against 1.59x plain decoding;
# in float32 (1.48x) 1.36x against 1.39x, and fixed 1.12x against 1.29x.
WIDE_COST = 1.15
# ...and only for steps of at most this many rows. On the AVX512-BF16 EPYC (2026-12-03,
# bfloat16, MT-Bench 20 x 128, adaptive) two beams at 4 rows ran the head at 1.05x plain
# decoding against 1.15x with one, though the cost model put 4 x 5 tree tokens at 1.08x 4 x 3.
WIDE_MAX_ROWS = 1


def beam_shape(config, beam_width: int | None, beam_length: int | None) -> tuple[int, int]:
    """(W, L): the arguments where given, else the checkpoint's recorded defaults."""
    W = config.beam_width if beam_width is None else beam_width
    L = config.beam_length if beam_length is None else beam_length
    check_shapes(W, L)
    return W, L


def chains_of(t: torch.Tensor, C: int) -> torch.Tensor:
    """t (B, c, ...) with c 1 or C -> (B, C, ...): chain 0 repeated where only it was walked."""
    return t if t.shape[1] == C else t[:, :1].expand(t.shape[0], C, *t.shape[2:])


def chosen_q(logits: torch.Tensor, probs: torch.Tensor, choice: torch.Tensor, rows: torch.Tensor,
             greedy: torch.Tensor) -> torch.Tensor:
    """(B, C) the marginal q_j of each chain's drawn / chosen token ``choice`` (B, C):
    sampling rows ``rows`` from their q_j ``probs`` (R, c, N), greedy rows from the softmax
    of ``logits`` (B, c, N); c is 1 where the chains share their state (depth 1)."""
    width = choice.shape[1]
    conf = torch.ones(choice.shape, device=choice.device)
    conf[rows] = probs.expand(-1, width, -1).gather(2, choice[rows, :, None])[:, :, 0]
    if len(greedy):  # a softmax only for the rows that need it, not the whole batch
        conf[greedy] = logits[greedy].softmax(dim=-1).expand(-1, width, -1).gather(2, choice[greedy, :, None])[:, :, 0]
    return conf


def beam_confidence(result) -> torch.Tensor:
    """(B, W, L) per-token probabilities of a beam search's tokens (g0: 1)."""
    probs = result.token_logprobs.float().exp()
    return torch.nn.functional.pad(probs, (1, 0), value=1.0)


class ReDrafter(Drafter):
    name = "redrafter"
    acceptance_prior = 0.5

    def __init__(self, head: ReDrafterHead, beam_width: int | None = None, beam_length: int | None = None,
                 sample_drafts: bool = True, sample_length: int | None = None, sample_chains: int | None = None,
                 sample_branch_length: int | None = None):
        self.head = head
        fastpath.small_batch_linear(head)  # its few-row linears, like the target's (CPU)
        self.W, self.L = beam_shape(head.config, beam_width, beam_length)
        # The sampled chain's L: given, else a given beam length (one shape for both), else
        # the checkpoint's sample_length (0: its beam length).
        self.sample_L = sample_length or (self.L if beam_length is not None else head.config.sample_length or self.L)
        check_shapes(1, self.sample_L)
        self.sample_C = sample_chains or head.config.sample_chains  # chains a sampling row draws
        # ...the chains after the first this long (g0 counted), never longer than the first
        self.branch_L = min(sample_branch_length or head.config.sample_branch_length or self.sample_L, self.sample_L)
        self.width_given = beam_width is not None  # fit_shape keeps a width the user chose
        self.widened = False  # fit_shape made W = 2: then one beam on steps above WIDE_MAX_ROWS rows
        self.context_window = head.config.context
        self.feature_layers = tuple(head.config.feature_layers)
        self.sample_drafts = sample_drafts
        self.generators: dict[int, torch.Generator] = {}  # request id -> the head's draws
        self.compiled_head: CompiledHead | None = None  # its torch.compile'd calls (``compile``)

    @classmethod
    def load(cls, path, target, beam_width: int | None = None, beam_length: int | None = None) -> "ReDrafter":
        """A drafter from a checkpoint folder; W and L default to the checkpoint's
        beam_width / beam_length (W=4, L=5 unless it records others), the sampled chain's
        L to its sample_length (else L)."""
        return cls(ReDrafterHead.load(path, target), beam_width, beam_length)

    def quantize(self) -> bool:
        """The head's residual blocks and output layer (its own, or its projection and the
        target's draft-vocabulary rows) in int8, on CPU in float32 only; the recurrence, the
        feature fusion and context attention stay float32 (small, or read the target's
        states, whose outlier channels a per-call activation scale would flatten)."""
        head = self.head
        if self.int8 or not int8.available() or head.dtype != torch.float32 or head.rnn_w.weight.device.type != "cpu":
            return False
        if head.config.head == "shared" and head.draft_vocab is None:
            return False  # its output is the target's whole LM head: not the drafter's to copy
        names = [f"blocks.{i}.linear" for i in range(len(head.blocks))]
        int8.quantize_linears(head, names + (["out"] if head.config.head == "own" else ["proj"]))
        if head.config.head == "shared":
            head.parts = replace(head.parts, rows_logits=head.parts.int8_rows(head.draft_vocab.ids()))
        self.int8 = True
        return True

    def start(self, ctx: DraftContext) -> None:
        self.generators = {}  # a new batch: its request ids start again

    def fit_shape(self, cost) -> None:
        """One beam by default becomes two where the second beam is nearly free to verify
        here (``WIDE_COST``), for steps of at most ``WIDE_MAX_ROWS`` rows; the policy then
        keeps only the nodes that pay."""
        if self.W == 1 and self.L > 1 and not self.width_given:
            chain, wide = cost(self.L), cost(2 * self.L - 1)
            if wide <= WIDE_COST * chain:
                self.W, self.widened = 2, True

    def width(self, rows: int) -> int:
        """Beams drafted for a batch of ``rows`` (``fit_shape`` widens small batches only)."""
        return 1 if self.widened and rows > WIDE_MAX_ROWS else self.W

    def may_sample_drafts(self) -> bool:
        return self.sample_drafts and self.sample_L > 1

    def samples_drafts(self, ctx: DraftContext) -> bool:
        return self.may_sample_drafts() and int(ctx.budget.max()) > 1 and not bool(ctx.greedy.all())

    def max_depth(self, ctx: DraftContext | None = None) -> int:
        if ctx is None:
            return max(self.L, self.sample_L if self.may_sample_drafts() else 1) - 1
        return (self.sample_L if self.samples_drafts(ctx) else self.L) - 1

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Proposal:
        if self.samples_drafts(ctx):
            # No row may use more than its budget: drafting deeper would only be clipped away.
            L = min(self.sample_L, int(ctx.budget.max()))
            with fastpath.active():
                return self.sampled_chains(self.root_states(ctx), ctx, L)
        return self.propose_deterministic(ctx)

    @torch.no_grad()
    def propose_deterministic(self, ctx: DraftContext) -> Proposal:
        """The beam search's W beams (greedy rows and sampling rows alike)."""
        L, W = min(self.L, int(ctx.budget.max())), self.width(ctx.g0.shape[0])
        with fastpath.active():
            if self.compiled_head is not None:
                result = self.compiled_head.search(ctx.hidden, ctx.features, ctx.g0, W, L)
            else:
                result = redrafter_beam_search(self.head, self.root_states(ctx), ctx.g0, W, L)
        return Proposal(beams=result.beams, valid=result.valid, confidence=beam_confidence(result))

    def compile(self, backend: str = "inductor") -> bool:
        """The beam search (feature fusion included) through torch.compile (``heads.compiled``);
        sampled chains stay eager. Not for int8 heads (fbgemm's quantised ops do not trace) nor
        context attention (it reads the engine's recent states)."""
        if self.compiled_head is None and not (self.int8 or self.context_window):
            self.compiled_head = CompiledHead(self.head, bool(self.feature_layers), backend)
            self.compiled = True
        return self.compiled_head is not None

    def warmed(self) -> None:
        """Compile the search's remaining shapes at batch 1 and 2 (``CompiledHead.warm``); from
        now on a shape not compiled yet runs eager."""
        if self.compiled_head is not None:
            self.compiled_head.warm({rows: self.width(rows) for rows in (1, 2)}, self.L)
            self.compiled_head.warmed()

    def sampled_chains(self, hidden: torch.Tensor, ctx: DraftContext, L: int) -> Proposal:
        """C = ``sample_C`` chains of L tokens per row (B, C, L), g0 first. Sampling rows draw
        the chains' first drafted tokens *without replacement* from q_1 (chain k's from q_1
        with the tokens of chains 0..k-1 removed, renormalised: that conditional law is the q
        reported for it, what recursive rejection without replacement needs,
        ``acceptance.accept_chains_sampling``), then y_j ~ q_j along each chain. Chains after
        the first stop at ``branch_L`` (the recurrence walks them no further; past it they
        repeat chain 0's tokens, marked invalid, as is a chain whose row's q_1 had fewer
        than C tokens). Greedy rows take argmax q_j (chain 0 only: the others are invalid).
        q (B, C, L - 1, V) float32 is the law each drafted token was drawn from, over the
        target's vocabulary (zero outside a draft vocabulary; a point mass on the argmax for
        greedy rows, which are verified greedily and never read it).

        Example: C = 3, branch_L = 2, L = 4: a row's tree is g0 -> {a, b, c} (distinct), a ->
        y_2 -> y_3; the head walks one chain past depth 1, as with C = 1.

        Each depth works over the head's N outputs (softmax, top-k / top-p, the draw) and
        q is widened to V once at the end: the same distribution as one over V with -inf
        outside (draft ids are in target-id order, so even the inverse-CDF draw visits the
        tokens in the same order), at a sixth of the work per depth for N = 8192 of 49152.
        A row's draws go depth by depth, chain by chain, from its own generator."""
        head, vocab, B, C = self.head, self.head.draft_vocab, hidden.shape[0], self.sample_C
        device = hidden.device
        rows, greedy = (~ctx.greedy).nonzero().flatten(), ctx.greedy.nonzero().flatten()
        row_knobs = knobs([ctx.params[b] for b in rows.tolist()], device)
        generators = self.row_generators(ctx, rows.tolist())
        h = hidden[:, None, :]
        bias = head.recurrence_bias(h)
        state = head.step(head.initial_state((B, 1), device=device), ctx.g0[:, None], bias)  # s_1, every chain's
        tokens, q_rows, confidence = [ctx.g0[:, None]], [], [torch.ones(B, 1, device=device)]
        # A row draws only the tokens its own budget keeps, so its stream never depends on
        # how deep the other rows of the batch let the chains go.
        budget = ctx.budget[rows].tolist()
        distinct = torch.ones(len(rows), C, dtype=torch.bool, device=device)
        for j in range(L - 1):
            logits = head.draft_logits(h, state)  # (B, c, N) float32 over the head's outputs
            probs = target_probs(logits[rows], *row_knobs)  # (R, c, N) the sampling rows' q_j
            drawing = [i for i, b in enumerate(budget) if b > j + 1]
            if j == 0 and C > 1:  # c = 1 here: every chain's s_1 is the same
                choice, law, distinct = draw_distinct(logits[:, 0], probs[:, 0], rows, drawing, generators, C)
            else:
                choice, law = draw_along(logits, probs, rows, drawing, generators), probs
            token = choice if vocab is None else vocab.to_target(choice)
            tokens.append(token), q_rows.append(law), confidence.append(chosen_q(logits, probs, choice, rows, greedy))
            width = C if j + 2 < self.branch_L else 1  # chains still drawing at the next depth
            if j + 1 < L - 1:
                state = head.step(state.expand(-1, max(width, state.shape[1]), -1)[:, :width], token[:, :width], bias)
        beams = torch.stack([chains_of(t, C) for t in tokens], dim=2)  # (B, C, L)
        valid = torch.ones_like(beams, dtype=torch.bool)
        valid[greedy, 1:] = False  # a greedy row's chains are all its argmax chain
        valid[:, 1:, self.branch_L:] = False
        valid[rows, 1:] &= distinct[:, 1:, None]  # no token left to draw for that chain
        valid[:, :, 0] = True
        q = torch.stack([chains_of(t, C) for t in q_rows], dim=2)  # (R, C, L - 1, N)
        return Proposal(beams=beams, valid=valid, q=self.chain_q(beams[:, :, 1:], rows, q),
                        confidence=torch.stack([chains_of(t, C) for t in confidence], dim=2))

    def chain_q(self, drafted: torch.Tensor, rows: torch.Tensor, q_rows: torch.Tensor) -> torch.Tensor:
        """(B, C, L - 1, V) float32 from the sampling rows' q over the head's outputs
        ``q_rows`` (R, C, L - 1, N): those rows' q widened (zero outside a draft vocabulary),
        a point mass on the drafted token (``drafted`` (B, C, L - 1), target ids) elsewhere."""
        V, vocab = int(self.head.config.vocab_size), self.head.draft_vocab
        wide = q_rows if vocab is None else q_rows.new_zeros(*q_rows.shape[:3], V).index_copy_(3, vocab.ids(), q_rows)
        if len(rows) == drafted.shape[0]:  # every row samples (rows = 0 .. B - 1): no point masses
            return wide
        q = torch.nn.functional.one_hot(drafted, V).float()
        q[rows] = wide
        return q

    def row_generators(self, ctx: DraftContext, rows: list[int]) -> list[torch.Generator]:
        """The generators of sampling rows ``rows`` (batch indices), one per request, made at
        its first sampled draft from its seed (+ ``DRAFT_SEED_OFFSET``); requests no longer in
        the batch are forgotten."""
        live = set(ctx.request_ids) if ctx.request_ids else None
        if live is not None:
            self.generators = {r: g for r, g in self.generators.items() if r in live}
        out = []
        for b in rows:
            key = ctx.request_ids[b] if ctx.request_ids else b
            if key not in self.generators:
                self.generators[key] = offset_generator(ctx.params[b].seed, DRAFT_SEED_OFFSET, ctx.g0.device)
            out.append(self.generators[key])
        return out

    def root_states(self, ctx: DraftContext) -> torch.Tensor:
        """(B, d) what the head starts from: h, fused with the target's states after its
        feature layers (``ctx.features``) if the head reads them, then with context attention
        a_t over the row's latest states paired with the tokens after them (its last C
        tokens, g0 last)."""
        hidden = self.head.fuse_features(ctx.hidden, ctx.features) if self.feature_layers else ctx.hidden
        if not self.context_window:
            return hidden
        recent, C = ctx.recent, ctx.recent.window
        after = torch.stack([torch.nn.functional.pad(t[-C:], (C - min(C, len(t)), 0)) for t in ctx.tokens])
        return self.head.contextualize_recent(hidden, recent.states, after, recent.lengths)
