"""best.KeepBest: OUT/best holds the drafter at the run's best held-out score, and its
record never describes another drafter, whenever the run stops."""

import json
from types import SimpleNamespace

import pytest

from specdraft.train.best import KeepBest


def saver(out, written):
    """A drafter's save: one file naming the step it was saved at."""
    def save(name):
        (out / name).mkdir()
        (out / name / "step").write_text(str(state.step))
        written.append(state.step)
    state = SimpleNamespace(step=0, tokens=0)
    return save, state


def scores(keep, state, values):
    for step, value in enumerate(values):
        state.step, state.tokens = step * 10, step * 100
        keep({"tau": value})


def test_best_is_the_first_highest_score_and_ties_keep_the_earlier(tmp_path):
    written = []
    save, state = saver(tmp_path, written)
    keep = KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=True)
    scores(keep, state, [1.0, 1.3, 1.2, 1.3, 1.25])
    assert written == [0, 10]  # saved only on a new best; the tie at step 30 keeps step 10's
    assert json.loads((tmp_path / "best.json").read_text()) == {"step": 10, "tokens": 100, "tau": 1.3}
    assert (tmp_path / "best" / "step").read_text() == "10" and not (tmp_path / "best.tmp").exists()
    assert keep.describe() == f"best held-out tau 1.3000 at step 10: {tmp_path / 'best'}"


def test_a_resumed_run_beats_the_record_a_fresh_run_ignores_it(tmp_path):
    written = []
    save, state = saver(tmp_path, written)
    scores(KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=True), state, [1.0, 1.5])
    resumed = KeepBest(tmp_path, "tau", save, state, resumed=True, enabled=True)
    resumed({"tau": 1.4})
    assert written == [0, 10]  # 1.4 does not beat the 1.5 on record
    fresh = KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=True)
    state.step = 3
    fresh({"tau": 1.1})  # a run from scratch: its own first score is its best
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 3
    assert (tmp_path / "best" / "step").read_text() == "3"


def test_a_run_stopped_while_saving_leaves_no_wrong_record(tmp_path):
    written = []
    save, state = saver(tmp_path, written)
    keep = KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=True)
    scores(keep, state, [1.0])

    def interrupted(name):
        (tmp_path / name).mkdir()
        raise KeyboardInterrupt  # half-written staging folder

    keep.save = interrupted
    state.step = 7
    with pytest.raises(KeyboardInterrupt):
        keep({"tau": 2.0})
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 0  # the old pair stands
    assert (tmp_path / "best" / "step").read_text() == "0"
    again = KeepBest(tmp_path, "tau", save, state, resumed=True, enabled=True)
    again({"tau": 2.0})  # the resumed run redoes the evaluation; the stale staging folder goes
    assert (tmp_path / "best" / "step").read_text() == "7" and not (tmp_path / "best.tmp").exists()


def test_other_processes_and_scores_without_the_key_write_nothing(tmp_path):
    written = []
    save, state = saver(tmp_path, written)
    KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=False)({"tau": 9.0})
    KeepBest(tmp_path, "tau", save, state, resumed=False, enabled=True)({})
    assert written == [] and not (tmp_path / "best.json").exists()
