"""The ``specdraft`` command line, on the tiny random target (no chat template: --no-chat).

Most tests call ``main`` in-process (fast); two run ``python -m specdraft`` for real to
check exit codes and that user errors never show a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from specdraft.cli import main, parse_args
from specdraft.drafters import NoDrafter
from specdraft.engine import SpeculativeEngine
from specdraft.sampling import SamplingParams

LONG = "t15 t12 t7"  # greedy output runs to the length limit (a t2 loop lookup predicts)
SHORT = "t7 t13 t15 t3 t5 t11 t5 t5"  # greedy output ends with EOS after 6 tokens
RESULT_FIELDS = {"id", "text", "token_ids", "new_tokens", "steps", "tokens_per_step",
                 "tokens_per_second", "seconds", "stage_seconds"}


def generate(target_path, *extra: str) -> int:
    # float32 pinned: the references are float32, and --dtype auto would add its stderr line.
    return main(["generate", "--target", str(target_path), "--no-chat", "--max-new-tokens", "24", "--dtype", "float32",
                 *extra])


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def reference_ids(target, text: str, **params) -> list[int]:
    """What plain autoregressive decoding of the target produces."""
    engine = SpeculativeEngine(target, NoDrafter())
    result = engine.generate([target.encode_prompt(text, False)], SamplingParams(max_new_tokens=24, **params))
    return result[0].token_ids


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_one_error_line(rc: int, err: str) -> None:
    lines = err.strip().splitlines()
    assert rc != 0
    assert len(lines) == 1 and lines[0].startswith("specdraft: error:"), err
    assert "Traceback" not in err


# ---- successful runs ----------------------------------------------------------------------


def test_json_greedy_matches_plain_decoding(tiny_target_path, tiny_target, capsys):
    outputs = {}
    for drafter in ("none", "lookup"):
        assert generate(tiny_target_path, "--prompt", LONG, "--drafter", drafter, "--json") == 0
        out, _ = capsys.readouterr()
        [outputs[drafter]] = json_lines(out)  # exactly one line, nothing else on stdout
    got = outputs["lookup"]
    assert RESULT_FIELDS <= set(got)
    assert got["id"] == 0
    assert got["token_ids"] == outputs["none"]["token_ids"] == reference_ids(tiny_target, LONG)
    assert got["new_tokens"] == 24
    assert got["steps"] < outputs["none"]["steps"]  # lookup did accept drafted tokens


def test_prompts_file_batches_keep_input_order_and_ids(tiny_target_path, tiny_target, tmp_path, capsys):
    texts = {"a": SHORT, "b": LONG, "c": "t11 t5 t6 t4 t5"}
    path = write_prompts(tmp_path / "p.jsonl", [{"id": k, "prompt": v} for k, v in texts.items()])
    assert generate(tiny_target_path, "--prompts-file", str(path), "--batch-size", "2", "--json") == 0
    got = json_lines(capsys.readouterr().out)
    assert [g["id"] for g in got] == list(texts)
    for g in got:
        assert g["token_ids"] == reference_ids(tiny_target, texts[g["id"]])


def test_several_prompts_print_each_text_with_its_id(tiny_target_path, tiny_target, tmp_path, capsys):
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": SHORT}, {"prompt": LONG, "id": "x"}])
    assert generate(tiny_target_path, "--prompts-file", str(path)) == 0
    out, err = capsys.readouterr()
    decode = tiny_target.tokenizer.decode
    expected = [decode(reference_ids(tiny_target, t), skip_special_tokens=True) for t in (SHORT, LONG)]
    assert out == f"=== 0 ===\n{expected[0]}\n=== x ===\n{expected[1]}\n"
    # The default --drafter auto says what it picked: lookup, no head is shipped for this target.
    assert err.splitlines()[0] == "specdraft: drafter lookup (--drafter auto)"
    assert [line.split()[0] for line in err.splitlines()[1:]] == ["[0]", "[x]"]


def test_single_prompt_streams_text_to_stdout_and_stats_to_stderr(tiny_target_path, tiny_target, capsys):
    assert generate(tiny_target_path, "--prompt", LONG) == 0
    out, err = capsys.readouterr()
    assert out == tiny_target.tokenizer.decode(reference_ids(tiny_target, LONG), skip_special_tokens=True) + "\n"
    note, stats = err.splitlines()
    assert note == "specdraft: drafter lookup (--drafter auto)"
    assert "24 tokens" in stats and "tokens/step" in stats and "tokens/s" in stats and "accepted length:steps" in stats


def test_prompt_i_samples_with_seed_s_plus_i(tiny_target_path, tmp_path, capsys):
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": LONG}, {"prompt": LONG}])
    sampling = ["--temperature", "1", "--json", "--drafter", "lookup"]
    assert generate(tiny_target_path, "--prompts-file", str(path), "--seed", "7", "--batch-size", "2", *sampling) == 0
    batch = json_lines(capsys.readouterr().out)
    assert generate(tiny_target_path, "--prompt", LONG, "--seed", "8", *sampling) == 0
    [alone] = json_lines(capsys.readouterr().out)
    assert batch[1]["token_ids"] == alone["token_ids"]


def test_stop_string_ends_the_text(tiny_target_path, capsys):
    # SHORT's greedy text is "t8 t12 t4 t14 t13"
    assert generate(tiny_target_path, "--prompt", SHORT, "--stop", "t4", "--json") == 0
    [got] = json_lines(capsys.readouterr().out)
    assert got["text"] == "t8 t12 " and got["finish_reason"] == "stop"


def test_streamed_text_never_shows_the_start_of_a_stop_string(tiny_target_path, capsys):
    # "t8 t12" could begin the stop string "t12 t4": it must be held back, not printed and then cut.
    assert generate(tiny_target_path, "--prompt", SHORT, "--stop", "t12 t4") == 0
    assert capsys.readouterr().out == "t8 \n"


def test_help_documents_per_prompt_seeds(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    assert "S+i" in capsys.readouterr().out


# ---- bad input: one error line, exit 2, no traceback -------------------------------------

BAD_ARGS = {
    "max_new_tokens_zero": ["--max-new-tokens", "0"],
    "negative_temperature": ["--temperature", "-0.5"],
    "top_p_zero": ["--top-p", "0"],
    "top_p_above_one": ["--top-p", "1.5"],
    "negative_top_k": ["--top-k", "-1"],
    "beam_width_zero": ["--beam-width", "0"],
    "beam_length_zero": ["--beam-length", "0"],
    "gamma_zero": ["--gamma", "0"],
    "batch_size_zero": ["--batch-size", "0"],
    "unknown_drafter": ["--drafter", "no-such-kind"],
    "redrafter_missing_path": ["--drafter", "redrafter:/nonexistent/path"],
}


@pytest.mark.parametrize("extra", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_fail_with_one_line(tiny_target_path, extra, capsys):
    rc = generate(tiny_target_path, "--prompt", SHORT, *extra)
    assert_one_error_line(rc, capsys.readouterr().err)


def test_missing_model_path(capsys):
    rc = main(["generate", "--target", "/nonexistent/model", "--prompt", "hi"])
    assert_one_error_line(rc, capsys.readouterr().err)


def test_prompt_longer_than_context(tiny_target_path, capsys):
    rc = generate(tiny_target_path, "--prompt", " ".join(["t3"] * 130))
    err = capsys.readouterr().err
    assert_one_error_line(rc, err)
    assert "context" in err


def test_chat_without_template(tiny_target_path, capsys):
    rc = main(["generate", "--target", str(tiny_target_path), "--prompt", SHORT])
    assert_one_error_line(rc, capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tiny_target_path, capsys):
    rc = generate(tiny_target_path, "--prompt", SHORT, "--device", "cuda")
    assert_one_error_line(rc, capsys.readouterr().err)


@pytest.mark.parametrize("content", [None, "not json\n", '{"id": 1}\n', ""], ids=["missing", "not_json", "no_prompt", "empty"])
def test_bad_prompts_file(tiny_target_path, tmp_path, content, capsys):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    rc = generate(tiny_target_path, "--prompts-file", str(path))
    assert_one_error_line(rc, capsys.readouterr().err)


# ---- drafter checkpoints (the draft: and redrafter: loaders raise SpecdraftError) ---------


def save_redrafter(target, folder: Path) -> Path:
    """A randomly initialised ReDrafter head for ``target``, saved as a checkpoint."""
    from specdraft.heads.model import ReDrafterHead

    torch.manual_seed(0)
    return ReDrafterHead.for_target(target).save(folder)


@pytest.fixture(scope="module")
def redrafter(tiny_target, tmp_path_factory) -> Path:
    return save_redrafter(tiny_target, tmp_path_factory.mktemp("redrafter") / "r")


@pytest.fixture(scope="module")
def other_vocab_draft(tmp_path_factory) -> Path:
    """A draft model made for a 32-token vocabulary (the tiny target has 16)."""
    return make_tiny_llama(tmp_path_factory.mktemp("other") / "d", vocab_size=32)


@pytest.fixture(scope="module")
def other_hidden_redrafter(tmp_path_factory) -> Path:
    """A ReDrafter head made for a target of hidden size 48 (the tiny target has 32)."""
    from specdraft.models import load_target

    other = load_target(str(make_tiny_llama(tmp_path_factory.mktemp("wide") / "t", hidden_size=48)))
    return save_redrafter(other, tmp_path_factory.mktemp("wide") / "r")


def corrupt(folder: Path) -> Path:
    (folder / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 40)
    return folder


@pytest.fixture(scope="module")
def garbage_draft(tmp_path_factory) -> Path:
    """A draft model folder whose model.safetensors is not a safetensors file."""
    return corrupt(make_tiny_llama(tmp_path_factory.mktemp("garbage") / "d"))


@pytest.fixture(scope="module")
def garbage_redrafter(tiny_target, tmp_path_factory) -> Path:
    """A valid ReDrafter config next to a model.safetensors that is garbage."""
    return corrupt(save_redrafter(tiny_target, tmp_path_factory.mktemp("garbage") / "r"))


@pytest.fixture(scope="module")
def pickle_only(tmp_path_factory) -> Path:
    """A folder holding only a pytorch_model.bin (pickle weights are never loaded)."""
    folder = tmp_path_factory.mktemp("pickle") / "d"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    return folder


def test_redrafter_checkpoint_decodes_losslessly(tiny_target_path, tiny_target, redrafter, capsys):
    assert generate(tiny_target_path, "--prompt", LONG, "--drafter", f"redrafter:{redrafter}", "--json") == 0
    [got] = json_lines(capsys.readouterr().out)
    assert got["token_ids"] == reference_ids(tiny_target, LONG)


def test_int8_drafter_is_on_by_default_exact_and_says_only_when_asked_for_in_vain(tiny_target_path, tiny_target,
                                                                                 redrafter, capsys):
    """A float32 head runs in int8 unless --no-int8-drafter; either way the output is the target's."""
    from specdraft.cli.options import engine_spec

    assert engine_spec(parse_args(["generate", "--prompt", "x"])).int8_drafter
    assert not engine_spec(parse_args(["generate", "--prompt", "x", "--no-int8-drafter"])).int8_drafter
    reference = reference_ids(tiny_target, LONG)
    for flag in ([], ["--int8-drafter"], ["--no-int8-drafter"]):
        assert generate(tiny_target_path, "--prompt", LONG, "--drafter", f"redrafter:{redrafter}", *flag,
                        "--json") == 0
        out = capsys.readouterr()
        assert json_lines(out.out)[0]["token_ids"] == reference
        assert "int8" not in out.err  # quantised, or not asked for: nothing to say
    assert generate(tiny_target_path, "--prompt", LONG, "--drafter", "lookup", "--json") == 0
    assert "int8" not in capsys.readouterr().err  # the default says nothing where it does not apply
    assert generate(tiny_target_path, "--prompt", LONG, "--drafter", "lookup", "--int8-drafter", "--json") == 0
    assert "--int8-drafter: nothing of lookup runs in int8" in capsys.readouterr().err


BAD_CHECKPOINTS = {  # id -> (drafter kind, fixture giving the folder, a word the error names)
    "draft_other_vocab": ("draft", "other_vocab_draft", "vocab"),
    "redrafter_other_hidden": ("redrafter", "other_hidden_redrafter", "hidden_size"),
    "draft_garbage_weights": ("draft", "garbage_draft", "safetensors"),
    "redrafter_garbage_weights": ("redrafter", "garbage_redrafter", "safetensors"),
    "draft_pickle_only": ("draft", "pickle_only", ""),
    "redrafter_pickle_only": ("redrafter", "pickle_only", ""),
}


@pytest.mark.parametrize("kind, fixture, word", BAD_CHECKPOINTS.values(), ids=BAD_CHECKPOINTS.keys())
def test_bad_checkpoint(tiny_target_path, kind, fixture, word, request, capsys):
    path = request.getfixturevalue(fixture)
    capsys.readouterr()  # drop what making the checkpoint printed
    rc = generate(tiny_target_path, "--prompt", SHORT, "--drafter", f"{kind}:{path}")
    err = capsys.readouterr().err
    assert_one_error_line(rc, err)
    assert word in err


def test_keyboard_interrupt_exits_130_quietly(tiny_target_path, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdraft.build.build_engine", interrupted)
    assert generate(tiny_target_path, "--prompt", SHORT) == 130
    assert "Traceback" not in capsys.readouterr().err


# ---- the real command ----------------------------------------------------------------------


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdraft", *args], capture_output=True, text=True, timeout=120)


def test_module_reports_bad_numbers_before_loading():
    proc = run_module("generate", "--target", "/nonexistent/model", "--prompt", "hi", "--top-p", "0")
    assert proc.returncode == 2
    assert_one_error_line(proc.returncode, proc.stderr)
    assert "top_p" in proc.stderr and proc.stdout == ""


def test_module_reports_bad_prompt_after_loading_without_noise(tiny_target_path):
    # The model loads first: its progress bars must not reach a piped stderr.
    proc = run_module("generate", "--target", str(tiny_target_path), "--no-chat", "--prompt", " ".join(["t3"] * 200))
    assert proc.returncode == 2
    assert_one_error_line(proc.returncode, proc.stderr)
    assert proc.stdout == ""


@pytest.mark.parametrize("argv, cls, required", [
    (["train", "redrafter"], "HeadTrainConfig", {}),
    (["train", "draft", "--stage", "pretrain"], "DraftTrainConfig", {"stage": "pretrain"}),
])
def test_trainer_configs_carry_every_option_with_the_cli_defaults(argv, cls, required):
    """The trainers take plain dataclasses: the CLI's defaults are the dataclass's (no copy
    drifts), and no option of the command is left out of its config."""
    import dataclasses

    from specdraft.train import configs

    config_cls = getattr(configs, cls)
    args = parse_args([*argv, "--out", "x"])
    assert config_cls.from_options(args) == config_cls(out="x", **required)
    names = {f.name for f in dataclasses.fields(config_cls)}
    assert set(vars(args)) - names == {"command", "command_line", "debug", "drafter_kind", "run"}


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_launched_rank_leaves_without_interpreter_teardown(world_size):
    """``console`` (the program's entry point): one rank of several (WORLD_SIZE > 1) exits
    with the command's code without the interpreter's teardown, where gloo's leftover threads
    raced it; a lone process exits normally (its atexit handlers run)."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('teardown', flush=True))\n"
              "sys.argv = ['specdraft', 'generate', '--temperature', '-1', '--prompt', 'x']\n"
              "from specdraft.cli import console\n"
              "console()\n")
    env = {**os.environ, "WORLD_SIZE": world_size}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "temperature must be >= 0" in proc.stderr
    assert ("teardown" in proc.stdout) == (world_size == "1")
