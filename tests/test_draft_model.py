"""The independent draft-model drafter: lossless greedy decoding, exact sampling, a draft
KV cache that stays in step with the target, and one-line load errors. Tiny random
models only (fast)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer

from specdraft.drafters import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter, memory_bound_speedup
from specdraft.drafters.lookup import LookupDrafter
from specdraft.drafters.registry import build_drafter
from specdraft.engine import SpeculativeEngine
from specdraft.errors import SpecdraftError
from specdraft.models import load_target
from specdraft.sampling import SamplingParams, target_probs

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


def _noisy_copy(src, dst, vocab_size, scale, seed):
    """A draft that is the target with Gaussian noise (scale x each matrix's std) added to
    its weight matrices: its drafts are accepted sometimes, at every depth."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    model.save_pretrained(dst)
    make_tiny_tokenizer(vocab_size).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A vocab-16 target and drafts: "small" (independent, random: nearly always rejected),
    "noisy" (partly right), "perfect" (the target's own folder); and the folder root."""
    root = tmp_path_factory.mktemp("draft_model")
    target_path = make_tiny_llama(root / "target", vocab_size=16, seed=0)
    drafts = {"small": make_tiny_llama(root / "small", vocab_size=16, seed=1, **SMALL),
              "noisy": _noisy_copy(target_path, root / "noisy", 16, scale=0.6, seed=4),
              "perfect": target_path}
    return load_target(str(target_path)), drafts, root


def _prompts(lengths, seed=0, vocab=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(target, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---- 1. greedy: token-for-token the target's own output ---------------------------------

@pytest.mark.parametrize("which,beam_width", [("small", 1), ("noisy", 1), ("perfect", 1), ("noisy", 3)])
def test_greedy_matches_autoregressive(tiny, which, beam_width):
    target, drafts, _ = tiny
    drafter = DraftModelDrafter.load(drafts[which], target, gamma=4, beam_width=beam_width)
    prompts = _prompts([3, 9, 5, 6])
    # Rows leave at different steps: different lengths, and EOS (t0) where the model says
    # so (row 1 stops after 4 tokens); row 3 ignores EOS and runs on.
    params = [SamplingParams(max_new_tokens=m, ignore_eos=i == 3) for i, m in enumerate((40, 13, 27, 40))]
    base = SpeculativeEngine(target, NoDrafter()).generate(prompts, params)
    spec = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)
    for prompt, p, b, s in zip(prompts, params, base, spec):
        assert s.token_ids == b.token_ids
        assert s.finish_reason == b.finish_reason
        hf = _hf_greedy(target, prompt, p.max_new_tokens)  # stops at EOS even for row 3
        assert s.token_ids[: len(hf)] == hf and (p.ignore_eos or len(hf) == len(s.token_ids))
    if which == "noisy":  # partial acceptance really happened, at several depths
        gains = {k for r in spec for k in r.accepted_hist}
        assert len(gains) >= 3, gains
    alone = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts[:1], params[0])  # batch 1
    assert alone[0].token_ids == base[0].token_ids


def test_mixed_batch_is_reproducible(tiny):
    """Greedy and sampling rows share a batch: greedy rows keep the target's output, and
    sampling rows repeat exactly for the same seeds (per-row generators)."""
    target, drafts, _ = tiny
    prompts = _prompts([5, 2, 8, 4], seed=2)
    params = [SamplingParams(max_new_tokens=24, temperature=t, top_p=0.9, seed=10 + i, ignore_eos=True)
              for i, t in enumerate((0.0, 0.8, 0.0, 1.0))]
    base = SpeculativeEngine(target, NoDrafter()).generate(prompts, params)
    runs = [SpeculativeEngine(target, DraftModelDrafter.load(drafts["noisy"], target, gamma=3), max_tree_tokens=None).generate(prompts, params)
            for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    for i in (0, 2):
        assert runs[0][i].token_ids == base[i].token_ids


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A target whose attention depends strongly on position (large init): with the
    default init attention is nearly uniform and a wrong position id goes unnoticed."""
    path = make_tiny_llama(tmp_path_factory.mktemp("sharp") / "target", vocab_size=16, seed=0,
                           initializer_range=0.4)
    return load_target(str(path)), path


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_perfect_draft_accepts_everything(sharp, temperature):
    """The target as its own draft must accept all gamma drafts + 1 per step: any cache slip
    (a wrong position, a stale or missing entry, a bad mask) shows up as a rejection.
    Under sampling q equals p up to float rounding, so the chain is accepted as well."""
    target, path = sharp
    gamma = 4
    drafter = DraftModelDrafter.load(path, target, gamma=gamma)
    prompts = _prompts([4, 11, 7], seed=1)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True, temperature=temperature, top_p=0.9, seed=i)
              for i, m in enumerate((41, 21, 31))]
    results = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate(prompts, params)
    for r in results:
        tau = (r.new_tokens - 1) / (r.steps - 1)  # per verification step, the prefill left out
        assert tau == gamma + 1, r.accepted_hist
    # The parameter count feeds MBSU: a perfect draft the size of its target halves tau/(1+gamma).
    n = drafter.num_parameters
    assert n == sum(p.numel() for p in target.model.parameters())
    assert memory_bound_speedup(5.0, gamma, n, n) == pytest.approx(1.0)


def test_registry_builds_draft(tiny):
    target, drafts, root = tiny
    drafter = build_drafter(f"draft:{drafts['small']}", target, gamma=3)
    assert isinstance(drafter, DraftModelDrafter) and drafter.gamma == 3 and drafter.W == 1
    assert drafter.num_parameters < sum(p.numel() for p in target.model.parameters())
    # A folder without tokenizer files is checked by vocabulary size only.
    bare = root / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(drafts["small"] / name, bare / name)
    assert DraftModelDrafter.load(bare, target, beam_width=2).W == 2


# ---- 2. sampling: the output distribution is exactly the target's ----------------------

def _exact_joint(target, prompt, n_tokens, params):
    """P(x1..xn | prompt) for every sequence (V^n,), from the target's full-sequence
    conditionals passed through the same temperature/top-p as the engine."""
    V = target.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * (n_tokens - 1)).view(-1, n_tokens - 1)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.model(ids).logits[:, len(prompt) - 1:].float()  # (S, n, V)
    S = len(seqs)
    knobs = [torch.full((S,), params.temperature), torch.zeros(S, dtype=torch.long),
             torch.full((S,), params.top_p)]
    p = target_probs(logits, *knobs)  # (S, n, V): p(x_{j+1} | prompt, seq[:j])
    # joint[s, x] = prod_j p_j(seq_j) * p_{n-1}(x), with seq the first n-1 tokens.
    head = p[:, :-1].gather(2, seqs[:, :, None])[:, :, 0].prod(dim=1)
    return (head[:, None] * p[:, -1]).flatten()


def _chi_square(counts, expected):
    """Pearson statistic and p-value, cells with expected count < 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target cannot produce"
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))
    return stat, df, pvalue


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):
    """A vocab-6 target and a noisy copy of it as the draft (accepted often, not always:
    both acceptance and the residual distribution are exercised)."""
    root = tmp_path_factory.mktemp("draft_model6")
    target_path = make_tiny_llama(root / "target", vocab_size=6, seed=3)
    return load_target(str(target_path)), _noisy_copy(target_path, root / "draft", 6, scale=0.5, seed=4)


@pytest.mark.parametrize("temperature,beam_width,sample_drafts", [(0.7, 1, True), (1.0, 1, True), (1.0, 2, True),
                                                                  (1.0, 3, True), (1.0, 2, False)])
def test_sampling_matches_target_distribution(tiny6, temperature, beam_width, sample_drafts):
    """Joint law of the first 4 sampled tokens vs the exact one, enumerated (6^4 cells).

    Sample size: 4000 rows (seeds 0..3999) in one batch. Cells with expected count < 5
    are pooled, so Pearson's statistic is close to chi-square(df) under exactness
    (df ~ 65-100 here); we fail at p < 1e-3 (statistic above ~107 for df 66, ~148 for
    df 99): an exact sampler fails one configuration in 1000, and as the seeds are fixed
    the outcome is deterministic. Power: a bias of total variation e adds at least
    n * (2e)^2 to the expected statistic (Cauchy-Schwarz: sum d^2/p >= (sum |d|)^2), i.e.
    >= 80 for e = 0.07, which pushes it past the threshold. Drawing drafts from q^2 while
    reporting q gave statistics of 258 (T=0.7) and 224 (T=1.0). The draft's own law (a
    sampler that kept every draft) would add thousands, checked below.
    """
    target, draft_path = tiny6
    n_rows, n_tokens, prompt = 4000, 4, [1, 2, 3]
    params = [SamplingParams(max_new_tokens=n_tokens, temperature=temperature, top_p=0.9, seed=i,
                             ignore_eos=True) for i in range(n_rows)]
    drafter = DraftModelDrafter.load(draft_path, target, gamma=3, beam_width=beam_width)
    drafter.sample_drafts = sample_drafts  # W chains drawn from q, or the beam search's W beams
    # Thousands of rows in one batch: no tree-token cap, or nothing would be drafted.
    results = SpeculativeEngine(target, drafter, max_tree_tokens=None).generate([prompt] * n_rows, params)
    V = target.vocab_size
    index = torch.tensor([sum(t * V ** (n_tokens - 1 - j) for j, t in enumerate(r.token_ids))
                          for r in results])
    counts = torch.bincount(index, minlength=V ** n_tokens).double()
    exact = _exact_joint(target, prompt, n_tokens, params[0]).double()
    stat, df, pvalue = _chi_square(counts, n_rows * exact)
    steps = sum(r.steps for r in results)
    print(f"T={temperature} W={beam_width} sampled={sample_drafts}: chi2={stat:.1f} df={df} p={pvalue:.3f} "
          f"target steps per row {steps / n_rows:.2f}")
    assert pvalue > 1e-3, (stat, df, pvalue)
    # Speculation really happened: fewer target steps than tokens, yet not all accepted.
    assert n_rows * 2 < steps < n_rows * n_tokens

    # Power check: the draft's own joint law is clearly rejected at this sample size.
    draft = load_target(str(draft_path))
    q = _exact_joint(draft, prompt, n_tokens, params[0]).double()
    support = exact > 0
    noncentral = n_rows * float(((q[support] - exact[support]) ** 2 / exact[support]).sum())
    print(f"  draft law: expected excess statistic {noncentral:.0f}")
    assert noncentral > 10 * df


def test_sampling_rows_draw_chains_without_replacement(tiny):
    """W = 3 at T > 0: a sampling row's three first tokens are distinct, each reported with
    q_1 minus the earlier chains' tokens (renormalised); each chain's next token's q is the
    draft's own given that chain's path; a greedy row in the same batch keeps the beam
    search's beams, as does every row with ``sample_drafts`` False (q None)."""
    from specdraft.drafters.base import DraftContext

    target, drafts, _ = tiny
    prompt, V = [3, 5, 7, 2], 16
    ctx = DraftContext(tokens=[torch.tensor(prompt + [g]) for g in (4, 6)], g0=torch.tensor([4, 6]),
                       hidden=torch.zeros(2, 1), budget=torch.full((2,), 8), greedy=torch.tensor([False, True]),
                       request_ids=[0, 1], params=[SamplingParams(temperature=1.5, seed=3), SamplingParams()])
    drafter = DraftModelDrafter.load(drafts["noisy"], target, gamma=2, beam_width=3)
    drafter.start(ctx)
    chains = drafter.propose(ctx)
    assert chains.beams.shape == (2, 3, 3) and chains.q.shape == (2, 3, 2, V) and chains.valid.all()
    first, q = chains.beams[0, :, 1], chains.q[0]
    assert len(set(first.tolist())) == 3
    left = q[0, 0].clone()
    for k in range(1, 3):
        left[first[k - 1]] = 0.0
        assert torch.allclose(q[k, 0], left / left.sum()) and q[k, 0, first[:k]].eq(0).all()
    model = drafter.draft.model
    knobs_ = (torch.tensor([1.5]), torch.tensor([0]), torch.tensor([1.0]))
    with torch.no_grad():
        root = model(torch.tensor([prompt + [4]])).logits[:, -1]
        assert torch.allclose(q[0, 0], target_probs(root, *knobs_)[0], atol=1e-5)
        for k in range(3):  # chain k's q_2: the draft's law after its own first token
            logits = model(torch.tensor([prompt + [4, int(first[k])]])).logits[:, -1]
            assert torch.allclose(q[k, 1], target_probs(logits, *knobs_)[0], atol=1e-5)
            assert q[k, 1, chains.beams[0, k, 2]] > 0
    beams = DraftModelDrafter.load(drafts["noisy"], target, gamma=2, beam_width=3)
    beams.sample_drafts = False
    beams.start(ctx)
    deterministic = beams.propose(ctx)
    assert deterministic.q is None and torch.equal(deterministic.beams[1], chains.beams[1])
    one_token = SamplingParams(temperature=1.0, top_k=1, seed=3)  # q_1 holds one token: one live chain
    ctx.params[0] = one_token
    drafter.start(ctx)
    single = drafter.propose(ctx)
    assert single.valid[0, 0].all() and not single.valid[0, 1:, 1:].any() and single.valid[0, 1:, 0].all()


# ---- 3. load errors: one line each, naming what is wrong ---------------------------------

def _bad_folder(root, name, target_path):
    folder = root / name
    folder.mkdir()
    shutil.copy(target_path / "config.json", folder / "config.json")
    return folder


def test_load_errors(tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, drafts, root = tiny
    target_path = drafts["perfect"]

    def error(path):
        with pytest.raises(SpecdraftError) as e:
            DraftModelDrafter.load(path, target)
        message = str(e.value)
        assert "\n" not in message
        return message

    assert "not found" in error(root / "missing")

    bin_only = _bad_folder(root, "bin_only", target_path)
    (bin_only / "pytorch_model.bin").write_bytes(b"pickle")
    msg = error(bin_only)
    assert "pytorch_model.bin" in msg and "only safetensors" in msg

    corrupt = _bad_folder(root, "corrupt", target_path)
    (corrupt / "model.safetensors").write_bytes(b"\x13garbage bytes, not a header" * 10)
    assert "not a valid safetensors file" in error(corrupt)

    wide = make_tiny_llama(root / "vocab20", vocab_size=20, seed=2, **SMALL)
    msg = error(wide)
    assert "20" in msg and "16" in msg and str(wide) in msg and target.name in msg

    # Same vocabulary size, different token strings.
    renamed = make_tiny_llama(root / "renamed", vocab_size=16, seed=2, **SMALL)
    vocab = {f"w{i}": i for i in range(16)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0", unk_token="w1").save_pretrained(renamed)
    msg = error(renamed)
    assert "different tokenizer" in msg and str(renamed) in msg and target.name in msg

    with pytest.raises(SpecdraftError, match="gamma"):
        DraftModelDrafter(target.model, gamma=0)


@pytest.mark.parametrize("make", [lambda: LookupDrafter(beam_width=0), lambda: LookupDrafter(beam_length=0),
                                  lambda: LookupDrafter(beam_length=True), lambda: LookupDrafter(beam_width=10 ** 30)],
                         ids=["width", "length", "bool", "huge"])
def test_lookup_shapes_fail_with_the_shared_one_line_error(make):
    # Every drafter runs the one check_shapes: lookup once raised a bare ValueError (a traceback),
    # and a width beyond 2**63 an overflow inside torch (found by the CLI argument fuzzer).
    with pytest.raises(SpecdraftError, match="must be an integer from 1 to"):
        make()


# ---- 3. --compile-drafter: the same guarantees through torch.compile ---------------------

def test_compiled_draft_is_exact_and_warm(tmp_path):
    """The draft's forward through torch.compile keeps every guarantee: the target as its
    own draft is still accepted in full at batch 1 and 3 (a slip of the compiled forward in
    the cache, the positions or the masks shows as a rejection), greedy and sampled; and
    after ``warm_up`` new batch sizes and prompt lengths compile nothing more (a recompile
    mid-serving would stall requests for seconds). One layer and the aot_eager backend
    (graph capture, guards and recompiles as with inductor, without generating and building
    C++ kernels, a minute or two here); inductor itself is checked on the shipped draft by
    ``specdraft bench`` (outputs compared with plain decoding, docs/draft_model.md)."""
    from specdraft.build import warm_up

    path = make_tiny_llama(tmp_path / "one", vocab_size=16, seed=0, initializer_range=0.4, num_hidden_layers=1)
    target = load_target(str(path))
    gamma = 3
    drafter = DraftModelDrafter.load(path, target, gamma=gamma)
    assert drafter.compile(backend="aot_eager")
    engine = SpeculativeEngine(target, drafter, max_tree_tokens=None)
    warm_up(engine)
    assert drafter.draft.stance == "eager_on_recompile"  # what serving runs under: never a stall
    drafter.draft.stance = "fail_on_recompile"  # here: prove that warm_up left nothing to compile
    for n_rows, temperature in ((3, 0.0), (1, 1.0), (4, 1.0)):
        prompts = _prompts([4, 11, 7, 20][:n_rows], seed=n_rows)
        params = [SamplingParams(max_new_tokens=17 + 4 * i, ignore_eos=True, temperature=temperature, top_p=0.9,
                                 seed=i) for i in range(n_rows)]
        for r in engine.generate(prompts, params):
            assert (r.new_tokens - 1) / (r.steps - 1) == gamma + 1, r.accepted_hist
    base = SpeculativeEngine(target, NoDrafter()).generate(_prompts([6, 3], seed=9), SamplingParams(max_new_tokens=30))
    spec = engine.generate(_prompts([6, 3], seed=9), SamplingParams(max_new_tokens=30))
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
