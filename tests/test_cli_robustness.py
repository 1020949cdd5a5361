"""The command line's error boundary (issue 17): every argument is checked before any work
starts, and every failure is one ``specdraft: error:`` line with exit code 2 (1 for a bug,
whose traceback shows only with --debug or SPECDRAFT_DEBUG=1).

Regression tests for each failure found, and a property-based test (hypothesis) that
builds argument vectors for every subcommand from its own parser and asserts "exit 0 or
2, no traceback". Work past the checks is stubbed (except ``generate``, which runs for
real on the tiny target), so the hunt stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft.cli import build_parser, main


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_target_path) -> dict[str, Path]:
    """Inputs an unfriendly user would pass: a binary file, a folder, a plain file, a model
    folder whose weights are cut in half, a good prompts file."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01binary\x80")
    (d / "folder").mkdir()
    (d / "plain-file").write_text("x")
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": "t3 t4"}) + "\n")
    trunc = d / "truncated-model"
    shutil.copytree(tiny_target_path, trunc)
    weights = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return {"binary": d / "binary.jsonl", "dir": d / "folder", "file": d / "plain-file",
            "prompts": d / "prompts.jsonl", "truncated": trunc, "model": Path(tiny_target_path),
            "missing": d / "no-such-thing", "root": d}


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors, and the stubs below
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def assert_one_line(rc: int, err: str, *words: str, code: int = 2) -> None:
    lines = err.strip().splitlines()
    assert rc == code, err
    # one error line, the last (notes printed while loading, e.g. the dtype chosen, may precede it)
    assert lines and lines[-1].startswith("specdraft: error:"), err
    assert sum(line.startswith("specdraft: error:") for line in lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


def commands(f: dict, **extra) -> dict[str, list]:
    """The start of a valid command line of each subcommand that does work."""
    m = f["model"]
    return {
        "generate": ["generate", "--target", m, "--no-chat", "--prompt", "t3", "--max-new-tokens", "4"],
        "distill": ["distill", "--target", m, "--data", f["prompts"], "--out", f["root"] / "d.jsonl",
                    "--max-new-tokens", "4", "--no-progress"],
        "bench": ["bench", "--target", m, "--no-chat", "--dataset", f["prompts"], "--out", f["root"] / "bench",
                  "--max-new-tokens", "4", "--no-progress"],
        "train": ["train", "redrafter", "--target", m, "--device", "cpu", "--data", f["prompts"], "--out",
                  f["root"] / "train", "--max-steps", "1", "--no-progress"],
    }


def replace(argv: list, flag: str, value) -> list:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


# ---- regressions ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "distill", "bench"])
def test_max_new_tokens_is_bound_by_the_context(files, command):
    out_dir = files["root"] / f"context-{command}"
    argv = replace(commands(files)[command], "--max-new-tokens", "100000000000")
    rc, out, err = run(replace(argv, "--out", out_dir) if command != "generate" else argv)
    assert_one_line(rc, err, "--max-new-tokens", "context")
    assert out == ""
    assert not (out_dir / "results.json").exists()  # bench: refused before any row was measured


def test_default_max_new_tokens_is_capped_to_the_context(files):
    argv = [a for a in commands(files)["generate"] if a not in ("--max-new-tokens", "4")] + ["--json", "--prompt", "t15 t12 t7"]
    rc, out, err = run(argv + ["--drafter", "none"])
    assert rc == 0, err
    assert json.loads(out)["new_tokens"] <= 128  # the tiny target's context


def test_empty_stop_string_is_rejected(files):
    rc, _, err = run(commands(files)["generate"] + ["--stop", ""])
    assert_one_line(rc, err, "stop")


@pytest.mark.parametrize("command", ["generate", "distill", "bench", "train"])
def test_binary_prompts_or_data_file(files, command):
    flag = {"generate": "--prompts-file", "distill": "--data", "bench": "--dataset", "train": "--data"}[command]
    argv = commands(files)[command]
    if command == "generate":
        argv = [a for a in argv if a not in ("--prompt", "t3")]
    rc, _, err = run(replace(argv, flag, files["binary"]))
    assert_one_line(rc, err, flag, "UTF-8")


@pytest.mark.parametrize("command", ["generate", "distill", "bench", "train"])
def test_huge_seed(files, command):
    sampled = ["--temperature", "1"] if command == "generate" else []
    rc, _, err = run(commands(files)[command] + ["--seed", str(10**30), *sampled])
    assert_one_line(rc, err, "--seed")


@pytest.mark.parametrize("command", ["generate", "distill", "bench", "train"])
def test_truncated_weights(files, command):
    rc, _, err = run(replace(commands(files)[command], "--target", files["truncated"]))
    assert_one_line(rc, err, "--target", "safetensors", "truncated")


@pytest.mark.parametrize("command", ["distill", "bench", "train"])
@pytest.mark.parametrize("where", ["is_a_file_or_folder", "under_a_file"])
def test_output_that_cannot_be_written(files, command, where):
    wrong = files["dir"] if command == "distill" else files["file"]
    out = wrong if where == "is_a_file_or_folder" else files["file"] / "sub" / "out"
    rc, _, err = run(replace(commands(files)[command], "--out", out))
    assert_one_line(rc, err, "--out")
    assert not (files["root"] / "bench" / "results.json").exists()


def test_a_folder_where_a_file_is_expected_is_named_as_such(files):
    argv = [a for a in commands(files)["generate"] if a not in ("--prompt", "t3")]
    rc, _, err = run(argv + ["--prompts-file", files["dir"]])
    assert_one_line(rc, err, "is a directory")
    rc, _, err = run(replace(commands(files)["generate"], "--target", files["file"]))
    assert_one_line(rc, err, "is a file")


def test_bench_checks_every_drafter_before_measuring_any(files, monkeypatch):
    measured = []
    monkeypatch.setattr("specdraft.bench.runner.run_bench", lambda *a, **k: measured.append(1))
    for bad in (f"redrafter:{files['truncated']}", f"draft:{files['file']}", f"lookup+redrafter:{files['missing']}"):
        rc, _, err = run(commands(files)["bench"] + ["--drafters", f"none,lookup,{bad}"])
        assert_one_line(rc, err, "--drafters")
    assert not measured


def test_unexpected_errors_are_one_line_and_the_traceback_is_opt_in(files, monkeypatch):
    def bug(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("specdraft.build.build_engine", bug)
    rc, _, err = run(commands(files)["generate"])
    assert_one_line(rc, err, "ZeroDivisionError", "--debug", code=1)
    rc, _, err = run(["--debug"] + commands(files)["generate"])
    assert rc == 1 and "Traceback" in err and err.strip().splitlines()[-1].startswith("specdraft: error:")
    monkeypatch.setenv("SPECDRAFT_DEBUG", "1")
    rc, _, err = run(commands(files)["generate"])
    assert rc == 1 and "Traceback" in err


def test_the_real_command_prints_one_line(files):
    argv = [a for a in commands(files)["distill"]]
    proc = subprocess.run([sys.executable, "-m", "specdraft", *map(str, replace(argv, "--out", files["dir"]))],
                          capture_output=True, text=True, timeout=120)
    assert_one_line(proc.returncode, proc.stderr, "--out")


# ---- property-based: generated argument vectors at every subcommand ------------------------------

# Where each subcommand's work starts: stubbed with SystemExit(0), meaning "every check passed".
WORK = {
    "serve": ["specdraft.build.build_engine"],
    "distill": ["specdraft.build.build_engine", "specdraft.models.load_target"],
    "bench": ["specdraft.bench.runner.run_bench", "specdraft.bench.verify_cost.run_verify_cost"],
    "sweep": ["specdraft.bench.sweep.run_sweep"],
    "train": ["specdraft.train.heads.run", "specdraft.train.draft.run"],
    "export": ["specdraft.heads.export.export_trtllm", "specdraft.models.load_target"],
    "fit": ["specdraft.train.fit.run_fit"],
    "parity": ["specdraft.build.build_engine"],
}


def passed(*args, **kwargs):
    raise SystemExit(0)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{'generate': parser, 'train redrafter': parser, ...}: every leaf subcommand."""
    out = {}
    for action in parser._actions:  # argparse has no public listing of subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = subparsers(sub)
                out.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return out


# Every subcommand whose work can be stubbed (a new one must be added to WORK to be hunted).
LEAVES = {name: sub for name, sub in subparsers(build_parser()).items()
          if name.split()[0] in WORK or name == "generate"}


def values_for(action: argparse.Action, paths: list[str]):
    """Values an unfriendly user might give this option: edge numbers, odd text, odd paths."""
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "bogus"])
    numbers = st.sampled_from(["0", "1", "2", "-1", "4", "10**30", str(2**64), "nan", "inf", "-inf", "1e308", "0.5"])
    if action.type is int:
        return st.sampled_from(["0", "1", "2", "-1", "3", str(10**30), "1.5", "x"])
    if action.type is float:
        return numbers
    return st.sampled_from(["", "default", "none", "lookup", "x:y", "t3 t4", "1,2", "-", *paths])


@st.composite
def argvs(draw, paths: list[str]):
    name = draw(st.sampled_from(sorted(LEAVES)))
    parser = LEAVES[name]
    argv = name.split()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    positionals = [a for a in parser._actions if not a.option_strings]
    for action in options:
        if not (action.required or draw(st.integers(0, 4)) == 0):
            continue
        flag = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, draw(values_for(action, paths))]
    for action in positionals:
        argv.append(draw(values_for(action, paths)))
    return argv


@settings(max_examples=int(os.environ.get("SPECDRAFT_HUNT_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_generated_argument_vectors_exit_0_or_2_without_traceback(files, data):
    paths = [str(files[k]) for k in ("binary", "dir", "file", "prompts", "truncated", "model", "missing")]
    paths.append(str(files["file"] / "below-a-file"))
    argv = data.draw(argvs(paths))
    if argv[0] == "generate":
        argv += ["--target", str(files["model"]), "--max-new-tokens", "3"]  # (later options win)
        argv += [] if "--prompts-file" in argv or "--prompt" in argv else ["--prompt", "t3 t4"]
    if argv[0] == "serve":  # never listen beyond loopback, nor on a fixed port
        argv += ["--host", "127.0.0.1", "--port", "0"]
    with contextlib.ExitStack() as stack:
        for target in WORK.get(argv[0], []):
            stack.enter_context(mock.patch(target, passed))
        rc, _, err = run(argv)
    assert rc in (0, 2), (argv, err)
    assert "Traceback" not in err, (argv, err)
    if rc == 2 and "usage:" not in err:  # argparse's own errors come with the usage
        lines = err.strip().splitlines()
        assert lines[-1].startswith("specdraft: error:"), (argv, err)
        assert sum(line.startswith("specdraft: error:") for line in lines) == 1, (argv, err)


def test_bad_linear_layout_variable(files, monkeypatch):
    """``$SPECDRAFT_LINEAR_LAYOUT`` with a value no layout has: one error line, before any work."""
    from specdraft import fastpath

    monkeypatch.setattr(fastpath, "CHOSEN", {})  # a fresh process: the layout is chosen at the first load
    monkeypatch.setenv(fastpath.LAYOUT_ENV, "fastest")
    rc, out, err = run(commands(files)["generate"])
    assert_one_line(rc, err, "SPECDRAFT_LINEAR_LAYOUT", "mkl-packed")
    assert out == ""
