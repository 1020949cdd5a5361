"""``specdraft bench`` / ``sweep`` / ``--verify-cost`` on the tiny random target, in-process.

Checks the files each mode writes and the arithmetic of every figure against the raw
numbers stored beside it (τ = tokens / forwards, speed-up = ratio of the same run's
rates, acceptance by depth from the histogram), that unsupported peer settings are
marked rather than skipped, that a rerun with --resume measures only missing rows, and
that a run that fails midway keeps the rows that finished.
"""

from __future__ import annotations

import json
import time
import shutil
import statistics
from pathlib import Path

import pytest

from specdraft.bench import metrics
from specdraft.cli import parse_args
from specdraft.drafters import LookupDrafter
from specdraft.errors import SpecdraftError

PROMPTS = ["t3 t4 t5 t3 t4", "t7 t8 t9 t7 t8 t9 t7", "t2 t5 t2 t5 t2 t5"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*argv) -> int:
    """Run a bench/sweep command line in-process as `specdraft ...` would, but let
    SpecdraftError propagate (main() turns it into exit code 2)."""
    args = parse_args([str(a) for a in argv])
    return args.run(args)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def bench(target, prompts, out, *extra) -> dict:
    rc = cli("bench", "--target", target, "--no-chat", "--dataset", prompts, "--max-new-tokens", 16,
             "--no-progress", "--out", out, *extra)
    assert rc == 0
    return json.loads((Path(out) / "results.json").read_text())


def rows_by(results: dict) -> dict[tuple, dict]:
    return {(r["drafter"], r["temperature"], r["batch_size"]): r for r in results["runs"]}


@pytest.fixture(scope="module")
def first_run(tiny_target_path, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = bench(tiny_target_path, prompts_file, out, "--drafters",
                    f"lookup,hf-ar,hf-lookup,hf-assisted:{tiny_target_path}",
                    "--batch-sizes", "1,2", "--temperatures", "0,1", "--repeats", 2)
    return out, results


ASSISTED = "hf-assisted:"  # rows of transformers' assisted generation start with this


# ---- bench ----------------------------------------------------------------------------------


def test_every_requested_row_is_there(first_run):
    out, results = first_run
    rows = rows_by(results)
    for drafter in ("none", "lookup", "hf-ar", "hf-lookup"):  # none is measured although not asked for
        for t in (0.0, 1.0):
            for b in (1, 2):
                assert (drafter, t, b) in rows
    assisted = next(k[0] for k in rows if k[0].startswith(ASSISTED))
    for t in (0.0, 1.0):  # transformers' prompt lookup and assisted generation are batch-1 only
        for peer in ("hf-lookup", assisted):
            assert rows[(peer, t, 2)]["status"] == "unsupported"  # marked, not dropped
            assert rows[(peer, t, 2)]["tokens_per_second"] is None
    assert all(r["status"] == "ok" for k, r in rows.items() if k[0] not in ("hf-lookup", assisted) or k[2] == 1)
    env = results["environment"]
    for key in ("device", "dtype", "target", "torch", "transformers", "device_name", "linear_layout"):
        assert env[key]
    assert env["stacked_groups"] == 0  # float32: nothing stacked (siblings.STACKED_LAYOUTS)
    assert "bench" in results["command"]


def test_lookup_and_hf_lookup_compare_the_same_stated_length(first_run):
    # hf-lookup's default length is read from our lookup's, not copied (it once said 8 vs 4).
    rows = rows_by(first_run[1])
    ours, theirs = rows[("lookup", 0.0, 1)], rows[("hf-lookup", 0.0, 1)]
    assert ours["beam_length"] and ours["beam_length"] == theirs["beam_length"]
    assert ours["beam_width"] == theirs["beam_width"] == 1


def test_figures_follow_from_raw_numbers(first_run):
    _, results = first_run
    rows = rows_by(results)
    for (_, t, b), row in rows.items():
        if row["status"] != "ok":
            continue
        rates = [tok / sec for tok, sec in zip(row["new_tokens_repeats"], row["seconds_repeats"])]
        assert row["tokens_per_second"] == pytest.approx(statistics.median(rates))
        assert (row["tokens_per_second_min"], row["tokens_per_second_max"]) == pytest.approx((min(rates), max(rates)))
        tokens = sum(sum(p["new_tokens"]) for p in row["per_prompt"])
        assert tokens == row["new_tokens"] == sum(row["new_tokens_repeats"])
        if row["tokens_per_step"] is not None:
            steps = sum(sum(p["steps"]) for p in row["per_prompt"])
            assert steps == row["target_forwards"]
            assert row["tokens_per_step"] == pytest.approx(tokens / steps) == row["block_efficiency"]
        for ref, field in (("none", "speedup_vs_ar"), ("hf-ar", "speedup_vs_hf_ar")):
            assert row[field] == pytest.approx(row["tokens_per_second"] / rows[(ref, t, b)]["tokens_per_second"])
    for t in (0.0, 1.0):
        assert rows[("none", t, 1)]["tokens_per_step"] == 1.0
        assert rows[("none", t, 1)]["speedup_vs_ar"] == 1.0
        assert rows[("hf-ar", t, 1)]["tokens_per_step"] == 1.0  # counted by a forward hook
        assert rows[("hf-ar", t, 2)]["tokens_per_step"] is None  # not comparable in a padded batch
    assisted = next(r for k, r in rows.items() if k[0].startswith(ASSISTED) and k[1:] == (0.0, 1))
    assert assisted["mbsu"] == pytest.approx(assisted["tokens_per_step"] / (1 + assisted["gamma"]))  # draft = target
    lookup = rows[("lookup", 0.0, 1)]
    assert lookup["tokens_per_step"] > 1  # the prompts repeat themselves
    hist = {int(k): v for k, v in lookup["accepted_hist"].items()}
    depth = metrics.acceptance_by_depth(hist, requests=len(PROMPTS) * 2)
    assert {int(k): v for k, v in lookup["acceptance_by_depth"].items()} == pytest.approx(depth)
    assert set(lookup["stage_seconds"]) == set(metrics.STAGE_KEYS)
    assert lookup["peak_memory_mb"] > 0


def test_greedy_rows_decode_the_same_tokens(first_run):
    _, results = first_run
    rows = rows_by(results)
    ref = [p["token_ids"] for p in rows[("none", 0.0, 1)]["per_prompt"]]
    for key in rows:
        if key[1] == 0.0 and rows[key]["status"] == "ok":
            assert [p["token_ids"] for p in rows[key]["per_prompt"]] == ref, key


def test_default_methods_are_plain_decoding_and_auto(tiny_target_path, prompts_file, tmp_path):
    rows = rows_by(bench(tiny_target_path, prompts_file, tmp_path / "b"))
    assert set(rows) == {("none", 0.0, 1), ("auto", 0.0, 1)}
    ref = [p["token_ids"] for p in rows[("none", 0.0, 1)]["per_prompt"]]
    assert [p["token_ids"] for p in rows[("auto", 0.0, 1)]["per_prompt"]] == ref


def test_report_and_plots(first_run):
    out, _ = first_run
    report = (out / "report.md").read_text()
    assert report.count("| method | B | tokens/s") == 2  # one table per dataset x temperature
    assert "## tiny, temperature 0" in report and "## tiny, temperature 1" in report
    assert "unsupported" in report
    for name in ("speedup.png", "stages.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert f"]({name})" in report


def test_resume_measures_only_missing_rows(first_run, tiny_target_path, prompts_file, tmp_path):
    src, before = first_run
    out = tmp_path / "resumed"
    shutil.copytree(src, out)
    wider = f"lookup@2x{LookupDrafter.default_shape()[1]}"  # lookup's own L, so W is all that differs
    results = bench(tiny_target_path, prompts_file, out, "--drafters",
                    f"lookup,hf-ar,hf-lookup,hf-assisted:{tiny_target_path},{wider}",
                    "--batch-sizes", "1,2", "--temperatures", "0,1", "--repeats", 2, "--resume")
    old, new = rows_by(before), rows_by(results)
    assert set(new) - set(old) == {(wider, t, b) for t in (0.0, 1.0) for b in (1, 2)}
    for key, row in old.items():  # untouched: re-measuring would give other timings
        assert new[key] == row
    assert (out / "tau_vs_width.png").read_bytes().startswith(PNG_MAGIC)  # lookup at widths 1 and 2
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        cli("bench", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--max-new-tokens", 8,
            "--no-progress", "--out", out, "--drafters", "lookup", "--resume")


def test_failed_run_keeps_finished_rows(tiny_target_path, prompts_file, tmp_path):
    empty = tmp_path / "not-a-checkpoint"
    empty.mkdir()
    out = tmp_path / "out"
    with pytest.raises(SpecdraftError, match="config.json"):  # fails when its row comes up
        bench(tiny_target_path, prompts_file, out, "--drafters", f"lookup,redrafter:{empty}")
    results = json.loads((out / "results.json").read_text())
    assert [r["drafter"] for r in results["runs"]] == ["none", "lookup"]
    assert (out / "report.md").is_file()


@pytest.mark.parametrize("spec", ["nonsense", "lookup@3", "draft:/no/such/folder", "hf-ar:x"])
def test_bad_method_fails_before_measuring(tiny_target_path, prompts_file, tmp_path, spec):
    with pytest.raises(SpecdraftError):
        bench(tiny_target_path, prompts_file, tmp_path, "--drafters", f"lookup,{spec}")
    assert not (tmp_path / "results.json").exists()


def test_mt_bench_second_turn(tiny_target_path, tmp_path, monkeypatch):
    """Turn 2 = [question 1, the method's own greedy answer, question 2] through the chat template."""
    from transformers import AutoTokenizer

    import specdraft.prompts

    target = tmp_path / "chat-tiny"
    shutil.copytree(tiny_target_path, target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(target)
    questions = [{"id": 1, "prompt": "t3 t4 t5", "turns": ["t3 t4 t5", "t9 t10"]}]
    monkeypatch.setattr(specdraft.prompts, "mtbench_two_turns", lambda: questions)
    monkeypatch.setattr(specdraft.prompts, "mtbench_first_turns", lambda: [{"id": 1, "prompt": "t3 t4 t5"}])
    results = {}
    for turns in (1, 2):
        rc = cli("bench", "--target", target, "--dataset", "mt-bench", "--mt-bench-turns", turns, "--drafters",
                 "lookup", "--max-new-tokens", 6, "--no-progress", "--out", tmp_path / f"turns{turns}")
        assert rc == 0
        results[turns] = json.loads((tmp_path / f"turns{turns}" / "results.json").read_text())
    first, second = (rows_by(results[t])[("none", 0.0, 1)] for t in (1, 2))
    assert (first["mt_bench_turn"], second["mt_bench_turn"]) == (1, 2)
    answer = tok.decode(first["per_prompt"][0]["token_ids"], skip_special_tokens=True)
    conversation = tok.apply_chat_template(
        [{"role": "user", "content": "t3 t4 t5"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "t9 t10"}], add_generation_prompt=True, tokenize=True)
    if hasattr(conversation, "keys"):
        conversation = conversation["input_ids"]
    assert second["per_prompt"][0]["prompt_tokens"] == len(conversation)
    assert rows_by(results[2])[("lookup", 0.0, 1)]["per_prompt"][0]["prompt_tokens"] == len(conversation)


# ---- verify cost ------------------------------------------------------------------------------


@pytest.mark.parametrize("random_weights", [False, True])
def test_verify_cost(tiny_target_path, tmp_path, random_weights):
    which = ["--random-target", tiny_target_path / "config.json"] if random_weights else ["--target", tiny_target_path]
    rc = cli("bench", "--verify-cost", *which, "--verify-tokens", "1,2,4,8",
             "--verify-prefix", 16, "--verify-trials", 2, "--no-progress", "--out", tmp_path)
    assert rc == 0
    result = json.loads((tmp_path / "verify_cost.json").read_text())
    assert result["environment"]["target"].startswith("random") == random_weights
    assert [r["tree_tokens"] for r in result["rows"]] == [1, 2, 4, 8]
    assert result["rows"][0]["relative_to_one_token"] == 1.0
    for r in result["rows"]:
        assert r["ms_min"] <= r["ms_median"] <= r["ms_max"]
        assert r["ms_per_token"] == pytest.approx(r["ms_median"] / r["tree_tokens"])
    assert "| tree tokens N |" in (tmp_path / "verify_cost.md").read_text()
    assert (tmp_path / "verify_cost.png").read_bytes().startswith(PNG_MAGIC)


def test_paired_medians_keep_a_shapes_relation_through_a_swing_of_the_machine():
    """A slow spell over rounds 3-5 of the one-token shape but only rounds 3-4 of the
    two-token one: each shape's own median would put two tokens below one (2 < 3); within
    each round two tokens cost 2x one, and that is what the paired estimate keeps."""
    from specdraft.timing import paired_medians

    times = {1: [1.0, 1.0, 3.0, 3.0, 3.0], 2: [2.0, 2.0, 6.0, 6.0, 2.0]}
    assert statistics.median(times[2]) < statistics.median(times[1])
    paired = paired_medians(times, 1)
    assert paired[1] == pytest.approx(3.0)
    assert paired[2] == pytest.approx(6.0)


def test_verify_cost_rejects_a_prefix_beyond_the_context(tiny_target_path, tmp_path):
    with pytest.raises(SpecdraftError, match="context"):
        cli("bench", "--verify-cost", "--target", tiny_target_path, "--verify-prefix", 200, "--out", tmp_path)


# ---- sweep ------------------------------------------------------------------------------------


def test_sweep_lookup_records_best_shape(tiny_target_path, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rc = cli("sweep", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--drafter", "lookup",
             "--widths", "1,2", "--lengths", "3,5", "--batch-sizes", "1,2", "--max-new-tokens", 12, "--no-progress",
             "--out", tmp_path / "out")
    assert rc == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["runs"]
    shapes = [r for r in runs if r["drafter"] != "none" and not r["adaptive"] and r["batch_size"] == 1]
    assert sorted((r["beam_width"], r["beam_length"]) for r in shapes) == [(1, 3), (1, 5), (2, 3), (2, 5)]
    assert not any(r["adaptive"] for r in runs if r["drafter"] != "lookup@adaptive")
    best = max(shapes, key=lambda r: r["tokens_per_second"])  # recorded: the fastest at the smallest batch
    recorded = json.loads((tmp_path / "cache" / "lookup.json").read_text())
    assert (recorded["beam_width"], recorded["beam_length"]) == (best["beam_width"], best["beam_length"])
    assert recorded["specdraft_sweep"]["tokens_per_second"] == pytest.approx(best["tokens_per_second"])
    assert "| W | L |" in (tmp_path / "out" / "sweep.md").read_text()
    assert (tmp_path / "out" / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    # the same run measured adaptive drafting, and compares it per batch size with the best of
    # plain decoding and every fixed shape
    compared = {c["batch_size"]: c for c in json.loads((tmp_path / "out" / "sweep.json").read_text())["adaptive"]}
    assert set(compared) == {1, 2}
    for b, c in compared.items():
        at_b = [r for r in runs if r["batch_size"] == b]
        adaptive = next(r for r in at_b if r["drafter"] == "lookup@adaptive")
        assert adaptive["adaptive"] and adaptive["drafting"]["adaptive"]
        reference = max(r["tokens_per_second"] for r in at_b if not r["adaptive"])
        assert c["ratio"] == pytest.approx(adaptive["tokens_per_second"] / reference)
    assert "## Adaptive drafting" in (tmp_path / "out" / "sweep.md").read_text()


@pytest.mark.parametrize("spec, base, shape", [
    ("lookup", "lookup", {}),
    ("lookup@1x3", "lookup", {"beam_width": 1, "beam_length": 3}),
    ("lookup@1x3/fixed", "lookup", {"beam_width": 1, "beam_length": 3, "adaptive": False}),
    ("redrafter:a@b/c@adaptive", "redrafter:a@b/c", {"adaptive": True}),
    ("draft:P@g5/adaptive", "draft:P", {"gamma": 5, "adaptive": True}),
    ("draft:P@g1/fixed/compiled", "draft:P", {"gamma": 1, "adaptive": False, "compiled": True}),
    ("draft:P@compiled", "draft:P", {"compiled": True}),
    ("redrafter:P@int8", "redrafter:P", {"int8": True}),
    ("redrafter:P@1x3/fixed/int8", "redrafter:P", {"beam_width": 1, "beam_length": 3, "adaptive": False, "int8": True}),
    ("redrafter:P@no-int8", "redrafter:P", {"int8": False}),
    ("redrafter:P@2x3/no-int8", "redrafter:P", {"beam_width": 2, "beam_length": 3, "int8": False}),
])
def test_method_suffix_sets_shape_and_policy(spec, base, shape):
    from specdraft.bench.specs import split_shape

    assert split_shape(spec) == (base, shape)


@pytest.mark.parametrize("spec", ["lookup@", "lookup@1x3/2x4", "lookup@fixed/adaptive", "lookup@g2/1x3", "lookup@on",
                                  "draft:P@compiled/compiled", "redrafter:P@int8/int8",
                                  "redrafter:P@int8/no-int8"])
def test_method_suffix_rejects_nonsense(spec):
    from specdraft.bench.specs import split_shape

    with pytest.raises(SpecdraftError, match="suffix"):
        split_shape(spec)


def test_bench_measures_fixed_and_adaptive_rows_side_by_side(tiny_target_path, prompts_file, tmp_path):
    rc = cli("bench", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--limit", 2,
             "--drafters", "lookup@1x3/fixed,lookup@1x3", "--max-new-tokens", 8, "--no-progress",
             "--out", tmp_path / "out")
    assert rc == 0
    runs = {r["drafter"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    assert runs["lookup@1x3/fixed"]["adaptive"] is False and runs["lookup@1x3"]["adaptive"] is True


def test_ignore_eos_makes_every_row_write_max_new_tokens(tiny_target_path, tmp_path):
    """--ignore-eos: a prompt the tiny target answers with EOS after 3 tokens writes all 16
    (every method of ours); transformers' peers are reported unsupported, not run."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt": "t2 t2 t3"}) + "\n" + json.dumps({"id": 1, "prompt": PROMPTS[0]}))
    plain = rows_by(bench(tiny_target_path, prompts, tmp_path / "a", "--drafters", "lookup"))
    assert plain[("none", 0.0, 1)]["per_prompt"][0]["new_tokens"] == [3]  # it does stop without the flag
    got = bench(tiny_target_path, prompts, tmp_path / "b", "--drafters", "lookup,hf-ar", "--ignore-eos")
    assert got["settings"]["ignore_eos"] is True
    rows = rows_by(got)
    for name in ("none", "lookup"):
        assert [p["new_tokens"] for p in rows[(name, 0.0, 1)]["per_prompt"]] == [[16], [16]]
    assert rows[("none", 0.0, 1)]["per_prompt"][0]["token_ids"][:3] == plain[("none", 0.0, 1)]["per_prompt"][0]["token_ids"]
    assert rows[("hf-ar", 0.0, 1)]["status"] == "unsupported" and "ignore_eos" in rows[("hf-ar", 0.0, 1)]["reason"]


def test_sweep_draft_model_records_gamma(tiny_target_path, prompts_file, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_target_path, draft)  # the target drafting for itself: a valid draft model
    rc = cli("sweep", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--limit", 2,
             "--drafter", f"draft:{draft}", "--widths", "1", "--gammas", "1,3", "--max-new-tokens", 8,
             "--no-progress", "--out", tmp_path / "out")
    assert rc == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    shapes = {r["gamma"]: r for r in runs if r["drafter"] != "none" and not r["adaptive"]}
    assert set(shapes) == {1, 3}
    assert all(r["mbsu"] == pytest.approx(r["tokens_per_step"] / (1 + r["gamma"])) for r in shapes.values())
    best = max(shapes.values(), key=lambda r: r["tokens_per_second"])
    config = json.loads((draft / "config.json").read_text())
    assert config["gamma"] == best["gamma"] and config["vocab_size"] == 16  # the rest is kept


def test_sweep_rejects_gammas_for_beam_drafters(tmp_path):
    with pytest.raises(SpecdraftError, match="gammas"):
        cli("sweep", "--drafter", "lookup", "--gammas", "2", "--out", tmp_path)


# ---- prompt sets ------------------------------------------------------------------------------


def test_humaneval_prompts():
    from specdraft.bench.datasets import load_prompts

    chat, bare = load_prompts("humaneval", None, chat=True), load_prompts("humaneval", 2, chat=False)
    assert len(chat) == 164 and chat[0].id == "HumanEval/0"
    assert bare[0].text.startswith("from typing import List") and bare[0].text in chat[0].text


def test_mt_bench_two_turns():
    from specdraft.bench.datasets import load_prompts

    items = load_prompts("mt-bench", 3, chat=True, turns=2)
    assert len(items) == 3 and all(it.follow_up and it.text != it.follow_up for it in items)
    assert all(it.follow_up is None for it in load_prompts("mt-bench", 3, chat=True, turns=1))


def test_sharegpt_heldout_prompts():
    from specdraft.bench.datasets import load_prompts

    items = load_prompts("sharegpt-heldout", 2, chat=True)
    assert len(items) == 2 and all(it.text.strip() for it in items)


# ---- metrics ----------------------------------------------------------------------------------


def test_acceptance_by_depth_excludes_prefill():
    # 2 requests: 2 prefill steps (gained 1), then decode steps gaining 1, 2, 3, 3 tokens
    hist = {1: 3, 2: 1, 3: 2}
    assert metrics.acceptance_by_depth(hist, requests=2) == pytest.approx({1: 3 / 4, 2: 2 / 4})
    assert metrics.acceptance_by_depth({1: 2}, requests=2) == {}


def test_mbsu_and_stages():
    assert metrics.mbsu(3.0, 4, 10, 100) == pytest.approx(3.0 / 1.4)
    assert metrics.mbsu(3.0, None, None, 100) is None
    stages = metrics.batch_stages([{"draft": 1.0, "verify": 1.0}, {"draft": 2.0, "verify": 3.0}], wall=6.0)
    assert stages["draft"] == 2.0 and stages["verify"] == 3.0 and stages["other"] == pytest.approx(1.0)


def test_method_specs_are_checked_before_anything_runs(tmp_path):
    from specdraft.bench.specs import check_spec

    for good in ("none", "lookup@1x4", "redrafter:default", "lookup+redrafter:default@1x2", f"draft:{tmp_path}"):
        check_spec(good)
    for bad, match in (("medusa:default", "no medusa drafter is shipped"), ("lookup+hf-ar", "only our drafters"),
                       (f"redrafter:{tmp_path / 'missing'}", "not found"), ("lookup+nope", "unknown method")):
        with pytest.raises(SpecdraftError, match=match):
            check_spec(bad)


def test_draft_table_script_pivots_bench_rows(tmp_path):
    """scripts/draft_table.py: one row per model, a τ / MBSU cell per (task, γ, mode)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draft_table", Path(__file__).parents[1] / "scripts" / "draft_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [{"drafter": "none", "status": "ok", "dataset": "mt-bench", "temperature": 0.0},
            {"drafter": "draft:a@g3", "status": "ok", "dataset": "mt-bench", "temperature": 0.0,
             "block_efficiency": 1.5, "mbsu": 1.25},
            {"drafter": "draft:a@g5", "status": "ok", "dataset": "mt-bench", "temperature": 1.0,
             "block_efficiency": 1.75, "mbsu": 1.0},
            {"drafter": "draft:a@g5", "status": "failed", "dataset": "humaneval", "temperature": 0.0}]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    rows = module.draft_rows([str(tmp_path)])
    assert [r["drafter"] for r in rows] == ["draft:a@g3", "draft:a@g5"]
    text = module.table({"FKL": rows, "RKL": []})
    assert text.splitlines()[0] == "| draft model | mt-bench γ=3 greedy | mt-bench γ=5 T=1 |"
    assert text.splitlines()[2] == "| FKL | 1.50 / 1.25 | 1.75 / 1.00 |"
    assert text.splitlines()[3] == "| RKL | – | – |"


def test_sweep_records_shipped_drafters_in_their_folder():
    """`sweep --drafter draft:default` writes the shipped folder's config, not ./default."""
    from specdraft.assets import shipped
    from specdraft.bench.sweep import record_path

    assert record_path("draft:default") == shipped("draft") / "config.json"
    assert record_path("redrafter:default") == shipped("redrafter") / "config.json"
    assert record_path("draft:some/folder") == Path("some/folder/config.json")


def test_head_table_script_pivots_bench_rows(tmp_path):
    """scripts/head_table.py: one row per head, a τ / speed-up cell per beam shape."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("head_table", Path(__file__).parents[1] / "scripts" / "head_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    runs = [{"drafter": "none", "status": "ok"},
            {"drafter": "redrafter:a@1x2", "status": "ok", "beam_width": 1, "beam_length": 2,
             "tokens_per_step": 1.25, "speedup_vs_ar": 1.1},
            {"drafter": "redrafter:a@4x3", "status": "ok", "beam_width": 4, "beam_length": 3,
             "tokens_per_step": 1.5, "speedup_vs_ar": 0.9},
            {"drafter": "redrafter:ab@4x3", "status": "ok", "beam_width": 4, "beam_length": 3,
             "tokens_per_step": 9.0, "speedup_vs_ar": 9.0},
            {"drafter": "medusa:b@4x3", "status": "failed", "beam_width": 4, "beam_length": 3}]
    rows = module.head_rows(runs, "redrafter:a")
    assert [r["drafter"] for r in rows] == ["redrafter:a@1x2", "redrafter:a@4x3"]
    text = module.table({"ReDrafter": rows, "Medusa": module.head_rows(runs, "medusa:b")})
    assert text.splitlines()[0] == "| head | W=1 L=2 | W=4 L=3 |"
    assert text.splitlines()[2] == "| ReDrafter | 1.25 / 1.10× | 1.50 / 0.90× |"
    assert text.splitlines()[3] == "| Medusa | – | – |"


def test_interleave_runs_every_methods_batch_i_before_any_batch_i_plus_1(tiny_target_path, prompts_file, tmp_path,
                                                                         monkeypatch):
    from specdraft.bench.runner import Bench

    calls, real_build = [], Bench.build

    def logging_build(self, spec, warm_prompt):
        method = real_build(self, spec, warm_prompt)
        generate = method.generate

        def logged(prompts, params):
            calls.append((spec, len(prompts)))
            return generate(prompts, params)
        method.generate = logged
        return method

    monkeypatch.setattr(Bench, "build", logging_build)
    rc = cli("bench", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--drafters",
             "none,lookup@1x3/fixed,lookup@1x3/adaptive", "--max-new-tokens", 6, "--repeats", 2, "--interleave",
             "--no-warmup", "--no-progress", "--out", tmp_path / "out")
    assert rc == 0
    # 3 prompts at batch 1, 2 repeats: 6 rounds, each running every method once, the order rotating
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 6 and all(sorted(s for s, _ in r) == sorted(["none", "lookup@1x3/fixed",
                                                                         "lookup@1x3/adaptive"]) for r in rounds)
    assert rounds[0][0][0] != rounds[1][0][0]  # batch 1 starts with another method than batch 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert sorted(r["drafter"] for r in runs) == sorted(["none", "lookup@1x3/fixed", "lookup@1x3/adaptive"])
    for r in runs:
        assert r["status"] == "ok" and len(r["seconds_repeats"]) == 2 and r["memory_peak_is_per_row"] is False
    assert len({r["new_tokens"] for r in runs}) == 1  # greedy: every method writes the same tokens


def test_lockstep_advances_our_methods_a_step_each_in_turn_and_times_each_alone(tiny_target_path, prompts_file,
                                                                                tmp_path, monkeypatch):
    from specdraft.bench import methods
    from specdraft.engine import SpeculativeEngine

    steps, real_advance, real_step = [], methods.Stepping.advance, SpeculativeEngine.step

    def logged_advance(self):
        steps.append(self.method.spec)
        real_advance(self)

    def slow_step(self, batch):  # every step of `none` takes 50 ms longer: only its own time may grow
        if self.drafter.__class__.__name__ == "NoDrafter":
            time.sleep(0.05)
        return real_step(self, batch)

    monkeypatch.setattr(methods.Stepping, "advance", logged_advance)
    monkeypatch.setattr(SpeculativeEngine, "step", slow_step)
    rc = cli("bench", "--target", tiny_target_path, "--no-chat", "--dataset", prompts_file, "--drafters",
             "none,lookup@1x3/fixed", "--max-new-tokens", 6, "--batch-sizes", 3, "--lockstep",
             "--no-warmup", "--no-progress", "--out", tmp_path / "out")
    assert rc == 0
    # one batch of 3 prompts: while both run, every round is one step of each, the order rotating
    both = 2 * min(steps.count("none"), steps.count("lookup@1x3/fixed"))
    rounds = [steps[i:i + 2] for i in range(0, both, 2)]
    assert len(rounds) >= 2 and all(sorted(r) == ["lookup@1x3/fixed", "none"] for r in rounds)
    assert rounds[0] != rounds[1]
    runs = {r["drafter"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["runs"]}
    none_steps = steps.count("none")
    assert runs["none"]["seconds_repeats"][0] >= 0.05 * none_steps
    assert runs["lookup@1x3/fixed"]["seconds_repeats"][0] < 0.05 * none_steps  # the other's sleeps not counted
    assert runs["none"]["per_prompt"][0]["token_ids"] == runs["lookup@1x3/fixed"]["per_prompt"][0]["token_ids"]


def test_server_bench_script_pairs_each_round_with_plain_decoding(tmp_path):
    """scripts/bench_server.py: `vs none` is the median of per-round ratios at the same level."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_server", Path(__file__).parents[1] / "scripts" / "bench_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(tps):
        return {"requests": 8, "wall": 1.0, "rps": 1.0, "tps": tps, "per_request": tps / 2, "tau": 1.0,
                "p50": 1.0, "p95": 1.0, "ttft": 0.1}

    runs = {("none", 1): [run(10.0), run(5.0), run(10.0)], ("lookup", 1): [run(12.0), run(5.5), run(9.0)]}
    rows = module.table_rows(runs, ["none", "lookup"], [1])
    lookup = rows[1][2]
    assert lookup["vs_none_rounds"] == pytest.approx([1.2, 1.1, 0.9])
    assert lookup["vs_none"] == pytest.approx(1.1)  # not 9.0 / 10.0: medians of ratios, not ratio of medians
    args = argparse.Namespace(dtype="float32", device="cpu", target="t", completions=True, max_tokens=8, max_batch_size=16,
                              ignore_eos=True)
    with open(tmp_path / "table.md", "w") as f:
        module.print_table(args, rows, 3, f)
    text = (tmp_path / "table.md").read_text()
    assert "median of 3 interleaved round(s)" in text
    assert "| lookup | 1 | 8 | 1.00 | 9.0 | 4.5 | 1.10× | 1.20 1.10 0.90 | 1.00 |" in text  # tok/req: median
    assert "EOS ignored" in text
