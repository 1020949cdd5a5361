"""Statistical exactness of speculative sampling through the whole engine.

On a tiny random Llama with a 6-token vocabulary, thousands of rows decode the same
prompt in one batch (one seed per row). The law of each row's output (its first K = 4
tokens, or fewer when EOS ends it) is compared with the *exact* law, enumerated with the
plain Hugging Face model: p(t1 | prompt) p(t2 | prompt, t1) ..., each p after the same
temperature -> top-k -> top-p processing (``specdraft.sampling.target_probs``).

Statistic: a G-test (likelihood ratio, chi-square tail from torch.special.gammaincc);
outcomes with expected count < 5 are pooled into one bin, and an outcome of exact
probability 0 fails outright. Threshold: fail when p < ALPHA = 1e-3. With 20 exactness
cases below, an exact engine would fail some case with probability about 1.4% for a
random choice of seeds; the seeds are fixed, so a pass is reproducible (no flakiness) and
a failure is a real signal. The power tests show that known biases give p far below it.

Why also a deterministic "oracle beams" drafter besides random beams: candidates drawn
uniformly at random, independently of p, hide some wrong acceptance rules on average
(see test_acceptance.py), whereas candidates that are a fixed function of the history
(like a beam search's or a lookup table's) must be verified exactly for every history.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from drafters_for_tests import RandomBeamsDrafter, SampledChainDrafter
import specdraft.engine as engine
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.drafters.combined import CombinedDrafter
from specdraft.datastore import Datastore
from specdraft.drafters.redrafter import ReDrafter
from specdraft.drafters.retrieval import RetrievalDrafter
from specdraft.heads import ReDrafterHead
from specdraft.drafters.base import DraftContext, Drafter, Proposal
from specdraft.engine import SpeculativeEngine
from specdraft.models import load_target
from specdraft.sampling import SamplingParams, target_probs
from stats import g_test, naive_tree_sampling

from conftest import make_tiny_llama

V = 6
K = 4  # tokens per request: the first comes from prefill, the rest from one or more trees
ALPHA = 1e-3
PROMPT_A = [1, 2, 3, 4, 5, 2, 3]  # repeated n-grams, so lookup has candidates
PROMPT_B = [4, 4, 2, 5]
ANSWERS = [[3, 4, 5, 2, 3, 1], [2, 3, 4, 4, 1, 0], [5, 2, 3, 3, 4, 5, 1], [1, 2, 5, 5, 3]]  # a retrieval datastore


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: threads only add overhead
    path = make_tiny_llama(tmp_path_factory.mktemp("exact") / "tiny6", vocab_size=V, seed=1)
    yield load_target(str(path), dtype="float32")
    torch.set_num_threads(threads)


def knobs(params: SamplingParams, n: int):
    return (torch.full((n,), params.temperature), torch.full((n,), params.top_k, dtype=torch.long),
            torch.full((n,), params.top_p))


def exact_law(target, prompt: list[int], params: SamplingParams, depth: int = K):
    """(law, table): law maps every possible output (a tuple of <= depth tokens, ending at
    EOS unless ignore_eos) to its exact probability; table maps history (prompt + output
    so far) to p for the next token."""
    eos = target.eos_ids
    law: dict[tuple[int, ...], float] = {}
    table: dict[tuple[int, ...], torch.Tensor] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for d in range(depth):
        prefixes = list(frontier)
        ids = torch.tensor([prompt + list(pre) for pre in prefixes])
        with torch.no_grad():
            logits = target.model(ids).logits[:, -1].float()
        probs = target_probs(logits, *knobs(params, len(prefixes)))
        if params.top_p < 1:  # the top-p cut must not sit within float noise of a token
            scores = (logits / params.temperature).softmax(-1).sort(-1, descending=True).values
            before = scores.cumsum(-1) - scores
            assert (before - params.top_p).abs().min() > 1e-4, "top-p boundary too close to call"
        new: dict[tuple[int, ...], float] = {}
        for pre, row in zip(prefixes, probs):
            table[tuple(prompt) + pre] = row
            for tok, pt in enumerate(row.tolist()):
                if pt > 0:
                    seq, pr = pre + (tok,), frontier[pre] * pt
                    ended = d == depth - 1 or (tok in eos and not params.ignore_eos)
                    (law if ended else new)[seq] = pr
        frontier = new
    return law, table


class OracleBeamsDrafter(Drafter):
    """Deterministic candidates that a perfect beam search might propose, from the exact
    table: beam 0 follows the argmax, beam 1 starts with the second most likely token,
    beam 2 with the least likely one (often of probability 0), each continued by argmax.
    A fixed function of the history, so every history's candidates are verified exactly."""

    name = "oracle-beams"

    def __init__(self, table: dict, beam_length: int = 4):
        self.table, self.L = table, beam_length

    def _chain(self, history: tuple[int, ...], first: int) -> list[int]:
        out = [first]
        while len(out) < self.L - 1 and history + tuple(out) in self.table:
            out.append(int(self.table[history + tuple(out)].argmax()))
        return out

    def propose(self, ctx: DraftContext) -> Proposal:
        B, W, L = len(ctx.tokens), 3, self.L
        beams = ctx.g0[:, None, None].repeat(1, W, L)
        valid = torch.zeros(B, W, L, dtype=torch.bool)
        valid[:, :, 0] = True
        for b, hist in enumerate(ctx.tokens):
            history = tuple(hist.tolist())
            p = self.table.get(history)
            if p is None:
                continue
            order = p.argsort(descending=True, stable=True).tolist()
            for w, first in enumerate([order[0], order[1], order[-1]]):
                chain = self._chain(history, first)
                beams[b, w, 1: 1 + len(chain)] = torch.tensor(chain)
                valid[b, w, 1: 1 + len(chain)] = True
        return Proposal(beams=beams, valid=valid)


class PointMassAsSampledDrafter(OracleBeamsDrafter):
    """The reference implementation's known bug, reproduced through the real engine: the
    drafter's candidate is deterministic (the argmax of its own distribution q), yet it
    reports q, so the engine verifies it with min(1, p/q) as if it had been sampled from q.
    q is a blurred copy of the target's p (a decent drafter)."""

    name = "point-mass-as-sampled"

    def propose(self, ctx: DraftContext) -> Proposal:
        B, L = len(ctx.tokens), self.L
        beams = ctx.g0[:, None].repeat(1, L)
        valid = torch.ones(B, L, dtype=torch.bool)
        q = torch.full((B, L - 1, V), 1.0 / V)
        for b, hist in enumerate(ctx.tokens):
            history = tuple(hist.tolist())
            for j in range(L - 1):
                p = self.table.get(history)
                if p is None:
                    valid[b, j + 1:] = False
                    break
                q[b, j] = 0.5 * p + 0.5 / V
                beams[b, j + 1] = int(q[b, j].argmax())
                history += (int(beams[b, j + 1]),)
        return Proposal(beams=beams[:, None], valid=valid[:, None], q=q[:, None])


def run_rows(target, drafter, prompts, params_list):
    with torch.no_grad():
        # Thousands of rows in one batch: no tree-token cap, or nothing would be drafted.
        results = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params_list)
    return [tuple(r.token_ids) for r in results], results


def sample_case(target, drafter_fn, params: SamplingParams, n: int, prompt=PROMPT_A):
    law, table = exact_law(target, prompt, params)
    outs, results = run_rows(target, drafter_fn(table), [prompt] * n,
                             [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(n)])
    res = g_test(Counter(outs), law)
    steps = sum(r.steps for r in results) / n
    return res, steps


T1 = dict(max_new_tokens=K, temperature=1.0, top_p=0.9, ignore_eos=True)
T07 = dict(max_new_tokens=K, temperature=0.7, top_p=0.9, ignore_eos=True)
TOPK = dict(max_new_tokens=K, temperature=1.0, top_k=3, ignore_eos=True)

CASES = {
    "autoregressive T=1 top-p": (lambda t: NoDrafter(), T1),
    "random beams T=0.7 top-p": (lambda t: RandomBeamsDrafter(V, beam_width=3, beam_length=4), T07),
    "random beams T=1 top-k": (lambda t: RandomBeamsDrafter(V, beam_width=3, beam_length=4, seed=1), TOPK),
    "oracle beams T=1 top-p": (lambda t: OracleBeamsDrafter(t), T1),
    "oracle beams T=0.7 top-p": (lambda t: OracleBeamsDrafter(t), T07),
    "oracle beams T=1 top-k": (lambda t: OracleBeamsDrafter(t), TOPK),
    "lookup T=1 top-p with EOS": (lambda t: LookupDrafter(beam_width=2, beam_length=4), {**T1, "ignore_eos": False}),
    "lookup+oracle beams T=1 top-p": (lambda t: CombinedDrafter([LookupDrafter(beam_width=2, beam_length=3),
                                                                  OracleBeamsDrafter(t)]), T1),
    # A datastore of other "answers": candidates from its trie, deterministic (beam 2 is the
    # second most frequent first token).
    "retrieval T=1 top-p": (lambda t: RetrievalDrafter(Datastore.from_answers(ANSWERS, V), beam_width=2), T1),
    "sampled chain T=0.7 top-p": (lambda t: SampledChainDrafter(V, beam_length=4), T07),
    "sampled chain T=1 top-k": (lambda t: SampledChainDrafter(V, beam_length=4, seed=1), TOPK),
    # Several chains drawn independently, verified by recursive rejection with i.i.d. drafts.
    "3 sampled chains T=1 top-p": (lambda t: SampledChainDrafter(V, beam_length=4, seed=2, chains=3), T1),
    "2 sampled chains T=0.7 top-k": (lambda t: SampledChainDrafter(V, beam_length=4, seed=3, chains=2),
                                     {**TOPK, "temperature": 0.7}),
    # ...and with their first tokens drawn without replacement, each with its conditional q.
    "3 chains without replacement T=1 top-p": (lambda t: SampledChainDrafter(V, beam_length=4, seed=4, chains=3,
                                                                               sharpness=4.0, distinct=True), T1),
    "2 chains without replacement T=1 top-k": (lambda t: SampledChainDrafter(V, beam_length=4, seed=5, chains=2,
                                                                               distinct=True), TOPK),
}
N_ROWS = 6000


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_exact_law(target, case):
    drafter_fn, params = CASES[case]
    res, steps = sample_case(target, drafter_fn, SamplingParams(**params), N_ROWS)
    print(f"{case}: {res} steps/row={steps:.2f}")
    assert res.p_value > ALPHA, f"{case}: {res}"
    if not case.startswith("autoregressive"):
        assert steps < K, "drafts were never accepted: the case tests nothing"


@pytest.mark.parametrize("draft_vocab", [None, [0, 2, 3, 5]], ids=["full-vocab", "draft-vocab-4-of-6"])
@pytest.mark.parametrize("chains", [0, 1, 2, 3], ids=["beams", "sampled-chain", "2-sampled-chains",
                                                  "3-sampled-chains-branching-once"])
def test_redrafter_beam_search_sampling_matches_exact_law(target, draft_vocab, chains):
    """A ReDrafter head's beam search (random weights: a fixed, history-dependent proposal
    over this 6-token vocabulary, often right; W = 3) verified by recursive rejection, and
    its sampled chains (drafts drawn from the head's q: one by speculative sampling,
    several, their first tokens distinct, by recursive rejection without replacement; with
    C = 3 and top-p q_1 often has fewer than 3 tokens); also with a draft vocabulary that leaves
    out tokens the target samples (1 and 4): the law must not change, only how often
    drafts are accepted."""
    from specdraft.vocab import DraftVocab

    torch.manual_seed(0)
    vocab = None
    if draft_vocab is not None:
        vocab = DraftVocab(len(draft_vocab), int(target.vocab_size))
        vocab.set_ids(torch.tensor(draft_vocab))
    head = ReDrafterHead.for_target(target, head="own", draft_vocab=vocab).eval().requires_grad_(False)
    head.config.sample_branch_length = 2 if chains == 3 else 0  # chains 2 and 3: one token each
    # The sampled chain is longer than the beams (sample_length), as the shipped head's is.
    shape = dict(beam_length=2, sample_length=4, sample_chains=chains) if chains else dict(beam_length=4)
    res, steps = sample_case(target, lambda t: ReDrafter(head, beam_width=3, sample_drafts=chains > 0, **shape),
                             SamplingParams(**T1), N_ROWS)
    print(f"redrafter chains={chains} T=1 top-p: {res} steps/row={steps:.2f}")
    assert res.p_value > ALPHA, str(res)
    assert steps < K, "drafts were never accepted: the case tests nothing"


def test_int8_redrafter_sampled_chain_matches_exact_law(target):
    """The head's linears in int8 (``--int8-drafter``) change its q, not the law: its
    sampled chain reports the q its drafts were drawn from, over a draft vocabulary that
    leaves out tokens the target samples."""
    from specdraft.vocab import DraftVocab

    torch.manual_seed(0)
    vocab = DraftVocab(4, int(target.vocab_size))
    vocab.set_ids(torch.tensor([0, 2, 3, 5]))
    head = ReDrafterHead.for_target(target, head="own", draft_vocab=vocab).eval().requires_grad_(False)
    drafter = ReDrafter(head, beam_width=1, beam_length=4)
    assert drafter.quantize()
    res, steps = sample_case(target, lambda t: drafter, SamplingParams(**T1), N_ROWS)
    print(f"int8 redrafter sampled chain T=1 top-p: {res} steps/row={steps:.2f}")
    assert res.p_value > ALPHA, str(res)
    assert steps < K, "drafts were never accepted: the case tests nothing"


@pytest.mark.parametrize("beam_width,sample_drafts", [(1, True), (2, False), (3, True)],
                         ids=["sampled-chain", "beam-search", "3-chains-without-replacement"])
def test_draft_model_with_a_draft_vocabulary_matches_exact_law(target, tmp_path, beam_width, sample_drafts):
    """An independent draft model whose draft vocabulary leaves out tokens the target samples
    (1 and 4): a sampled chain reports q (zero outside the vocabulary) for speculative
    sampling; three chains, their first tokens drawn without replacement (top-p often leaves
    fewer than three: then the extra chains are dropped), for recursive rejection without
    replacement; a beam search gives deterministic candidates for recursive rejection."""
    from specdraft.drafters.draft_model import DraftModelDrafter
    from specdraft.vocab import DraftVocab

    draft = load_target(str(make_tiny_llama(tmp_path / "draft6", vocab_size=V, seed=2)), dtype="float32").model
    vocab = DraftVocab(4, V)
    vocab.set_ids(torch.tensor([0, 2, 3, 5]))
    drafter_fn = lambda t: DraftModelDrafter(draft, gamma=3, beam_width=beam_width, vocab=vocab,  # noqa: E731
                                             sample_drafts=sample_drafts)
    res, steps = sample_case(target, drafter_fn, SamplingParams(**T1), N_ROWS)
    print(f"draft model, draft vocabulary, W={beam_width} sampled={sample_drafts}: {res} steps/row={steps:.2f}")
    assert res.p_value > ALPHA, res
    assert steps < K, "drafts were never accepted: the case tests nothing"


def test_mixed_batch_ragged_prompts_and_greedy_rows(target):
    """One batch mixing prompts of different lengths, sampling settings and greedy rows:
    each population must follow its own exact law; greedy rows match plain argmax."""
    pa, pb = SamplingParams(**T1), SamplingParams(**{**TOPK, "temperature": 0.7})
    law_a, table_a = exact_law(target, PROMPT_A, pa)
    law_b, table_b = exact_law(target, PROMPT_B, pb)
    greedy = SamplingParams(max_new_tokens=K, ignore_eos=True)
    kinds = [(PROMPT_A, pa), (PROMPT_B, pb), (PROMPT_A, greedy)]
    n = 3 * 4000
    prompts = [kinds[i % 3][0] for i in range(n)]
    params = [SamplingParams(**{**kinds[i % 3][1].__dict__, "seed": i}) for i in range(n)]
    outs, _ = run_rows(target, OracleBeamsDrafter({**table_a, **table_b}), prompts, params)
    res_a = g_test(Counter(outs[0::3]), law_a)
    res_b = g_test(Counter(outs[1::3]), law_b)
    print(f"mixed A: {res_a}\nmixed B: {res_b}")
    assert res_a.p_value > ALPHA, str(res_a)
    assert res_b.p_value > ALPHA, str(res_b)
    ar, _ = run_rows(target, NoDrafter(), [PROMPT_A], [greedy])
    assert set(outs[2::3]) == set(ar)


def test_power_point_mass_treated_as_sampled_is_detected(target):
    """The reference's sampling bug is flagged by the same statistic at the same size."""
    res, _ = sample_case(target, lambda t: PointMassAsSampledDrafter(t), SamplingParams(**T1), N_ROWS)
    print(f"point mass treated as sampled: {res}")
    assert res.p_value < ALPHA, str(res)


def test_greedy_speculative_equals_autoregressive(target):
    prompts = [PROMPT_A, PROMPT_B, [5], [2, 2, 2, 2, 2, 3, 1]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar, _ = run_rows(target, NoDrafter(), prompts, params)
    table = {}
    for p in prompts:
        table.update(exact_law(target, p, SamplingParams(max_new_tokens=3, temperature=1.0), depth=3)[1])
    for drafter in [RandomBeamsDrafter(V, beam_width=3, beam_length=4), LookupDrafter(beam_width=2, beam_length=5),
                    SampledChainDrafter(V, beam_length=4), OracleBeamsDrafter(table),
                    RetrievalDrafter(Datastore.from_answers(ANSWERS, V), beam_width=2, beam_length=5),
                    CombinedDrafter([LookupDrafter(beam_width=1, beam_length=3),
                                     RandomBeamsDrafter(V, beam_width=2, beam_length=5, seed=3)])]:
        spec, results = run_rows(target, drafter, prompts, params)
        assert spec == ar, drafter.name
    # With EOS honoured too (t0 is EOS).
    params = SamplingParams(max_new_tokens=24)
    ar, _ = run_rows(target, NoDrafter(), prompts, params)
    spec, _ = run_rows(target, RandomBeamsDrafter(V, beam_width=3, beam_length=4), prompts, params)
    assert spec == ar


def test_power_unnormalised_recursive_rejection_is_detected(target, monkeypatch):
    """A subtle bug in the deterministic-candidate rule (child k accepted with p(c_k)
    instead of p(c_k) / mass left; see stats.naive_tree_sampling) run through
    the engine is flagged with oracle beams. (With uniformly random beams this bug is
    exact on average and no statistic can see it: hence the oracle cases.)"""
    monkeypatch.setattr(engine, "accept_tree_sampling", functools.partial(naive_tree_sampling, renormalise=False))
    res, _ = sample_case(target, lambda t: OracleBeamsDrafter(t), SamplingParams(**T1), 3000)
    print(f"unnormalised recursive rejection (engine): {res}")
    assert res.p_value < ALPHA, str(res)


def test_power_multi_chain_without_residual_is_detected(target, monkeypatch):
    """Several sampled chains tried against p itself instead of the residual left by the
    earlier rejections (norm(max(0, p - q))): accepts too much, and the test sees it."""
    import specdraft.acceptance as acceptance

    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    res, _ = sample_case(target, lambda t: SampledChainDrafter(V, beam_length=4, seed=2, chains=3),
                         SamplingParams(**T1), 3000)
    print(f"multi-chain without the residual (engine): {res}")
    assert res.p_value < ALPHA, str(res)


def test_power_chains_without_replacement_tried_with_the_shared_q_is_detected(target):
    """Chains whose first tokens are drawn without replacement but reported with the
    shared q (not q without the earlier chains' tokens): the later trials under-accept
    and subtract the wrong residual, and the test sees it (a sharp q: the first draw takes
    much of its mass, so the two laws differ most)."""
    res, _ = sample_case(target, lambda t: SampledChainDrafter(V, beam_length=4, seed=4, chains=3, distinct=True,
                                                               sharpness=4.0, report_marginal=True),
                         SamplingParams(**T1), N_ROWS)
    print(f"chains without replacement, marginal q reported (engine): {res}")
    assert res.p_value < ALPHA, str(res)


def test_target_probs_matches_transformers_warpers():
    """Both sides of every exactness test use target_probs, so check it independently:
    per row, temperature -> top-k -> top-p -> softmax as transformers' own warpers do."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    gen = torch.Generator().manual_seed(0)
    B, Vb = 300, 40
    logits = torch.randn(B, Vb, generator=gen) * 3
    temperature = torch.rand(B, generator=gen) * 1.5 + 0.1
    top_k = torch.randint(0, Vb + 5, (B,), generator=gen) * (torch.rand(B, generator=gen) < 0.6)
    # top_p < 1 on every row: top_p = 1 is covered by the next test.
    top_p = torch.where(torch.rand(B, generator=gen) < 0.7, torch.rand(B, generator=gen), torch.full((B,), 0.999))
    top_p = top_p.clamp(min=0.01)
    got = target_probs(logits, temperature, top_k, top_p)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for b in range(B):
        scores = TemperatureLogitsWarper(float(temperature[b]))(ids, logits[b: b + 1].clone())
        if 0 < top_k[b] < Vb:
            scores = TopKLogitsWarper(int(top_k[b]))(ids, scores)
        if top_p[b] < 1:
            scores = TopPLogitsWarper(float(top_p[b]))(ids, scores)
        want = scores.softmax(-1)[0]
        assert torch.equal(got[b] > 0, want > 0), b
        assert torch.allclose(got[b], want, atol=1e-6), b


def test_top_p_one_is_a_no_op_whatever_the_batch():
    """A request's p must not depend on the requests batched with it. With top_p = 1 (off)
    nothing may be dropped, even when a co-batched row uses top-p or top-k."""
    logits = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.full((2,), 0.5)
    alone = target_probs(logits[:1], temperature[:1], torch.zeros(1, dtype=torch.long), torch.ones(1))[0]
    batched = target_probs(logits, temperature, torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.9]))[0]
    assert torch.equal(alone > 0, batched > 0), f"{int(((alone > 0) & (batched == 0)).sum())} tokens dropped"
    assert torch.allclose(alone, batched, atol=1e-9)
