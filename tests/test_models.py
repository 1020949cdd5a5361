"""Targets beyond Llama: a second architecture (Gemma 3: sliding-window layers, logit
scaling, its own layer types) runs through the same engine without per-family code, and
greedy output stays identical to transformers' generate()."""

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
