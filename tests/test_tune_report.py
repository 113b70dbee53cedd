"""What `ringfeed tune` leaves and prints (train/tune/report.py): each trial's state (a failed one
says why), value (a pruned one its last streamed value) and wall time, the results table,
the best trial (PBT: the best member of the last finished interval) and best.yaml with its
lineage, and the exit code of the report."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from tune_util import add_trial, make_search, memory_study

from ringfeed.train.tune import report as report_module
from ringfeed.train.tune.report import (
    best_trial,
    format_table,
    lineage_of,
    report,
    rows,
    state_of,
    trial_line,
    value_of,
    wall_of,
    write_best,
    write_tables,
)

SPACE = {"optim.lr": "loguniform(1e-3, 1)", "model.args.hidden": "choice([8], [16, 16])"}


@pytest.fixture
def tpe(tmp_path):
    search = make_search(tmp_path, space=SPACE)
    study = memory_study()
    trials = [
        add_trial(study, search, value=0.7, params={"optim.lr": 0.01,
                                                     "model.args.hidden": "[8]"}, wall_s=12.5),
        add_trial(study, search, value=0.9, params={"optim.lr": 0.1,
                                                     "model.args.hidden": "[16, 16]"}),
        add_trial(study, search, "PRUNED", steps={10: 0.2, 20: 0.3}, pruned_at_step=20),
        add_trial(study, search, "FAIL", failure="crash", error="exit 1: ValueError: x",
                  log="/runs/t3/train.log"),
        add_trial(study, search, "FAIL"),  # a dead worker's
    ]
    return search, study, trials


def test_each_trials_state_value_and_wall_time(tpe):
    _, _, trials = tpe
    assert [state_of(t) for t in trials] == ["complete", "complete", "pruned", "crash",
                                            "interrupted"]
    assert [value_of(t) for t in trials] == [0.7, 0.9, 0.3, None, None]
    assert wall_of(trials[0]) == 12.5


def test_the_table_has_one_row_per_trial_with_config_values(tpe, tmp_path):
    search, study, _ = tpe
    table = write_tables(search, study)
    assert [r["state"] for r in table] == ["complete", "complete", "pruned", "crash",
                                          "interrupted"]
    assert table[1]["model.args.hidden"] == [16, 16]  # the config's value, not optuna's text
    assert table[2]["pruned_at_step"] == 20 and table[3]["error"] == "exit 1: ValueError: x"
    with open(tmp_path / "results.csv") as f:
        assert [r["trial"] for r in csv.DictReader(f)] == ["0", "1", "2", "3", "4"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["best"] == {"trial": 1, "val_accuracy": 0.9,
                           "params": {"optim.lr": 0.1, "model.args.hidden": [16, 16]}}
    shown = format_table(search, table).splitlines()
    assert shown[0].split() == ["trial", "state", "val_accuracy", "wall_s", "optim.lr",
                                "model.args.hidden"]
    assert shown[2].split()[:3] == ["1", "complete", "0.9"] and "[16, 16]" in shown[2]
    assert shown[4].split()[:3] == ["3", "crash", "-"]  # no value: "-"


def test_best_yaml_is_a_runnable_config_with_the_best_parameters(tpe, tmp_path):
    search, study, _ = tpe
    path = write_best(search, study)
    text = path.read_text()
    assert text.startswith("# ringfeed tune: best trial 1 of study search: val_accuracy = 0.9 "
                           "(maximize)\n")
    assert f"# run: horovodrun -np 2 ringfeed train {path}\n" in text
    raw = yaml.safe_load(text)
    assert raw["optim"]["lr"] == 0.1 and raw["model"]["args"]["hidden"] == [16, 16]
    assert raw["output"]["dir"] == str(tmp_path / "best")


def test_minimize_picks_the_lowest(tmp_path):
    search = make_search(tmp_path, direction="minimize", metric="val_loss")
    study = memory_study("minimize")
    for v in (0.5, 0.2, 0.9):
        add_trial(study, search, value=v)
    assert best_trial(search, study).value == 0.2


def test_pbt_best_is_the_best_member_at_the_end_and_its_lineage(tmp_path):
    search = make_search(tmp_path, algorithm="pbt", space={"optim.lr": "uniform(0.01, 1)"})
    study = memory_study()

    def segment(member, g, value, parent=None, lr=0.1):
        return add_trial(study, search, value=value, params={"optim.lr": lr}, member=member,
                         generation=g, start_step=10 * g, end_step=10 * (g + 1),
                         parent_trial=parent, run_dir=f"/pbt/member-{member:02d}")

    a0, b0 = segment(0, 0, 0.95), segment(1, 0, 0.5)
    a1 = segment(0, 1, 0.6, parent=a0.number)
    b1 = segment(1, 1, 0.8, parent=a0.number, lr=0.12)  # took member 0's checkpoint
    best = best_trial(search, study)
    assert best.number == b1.number  # not a0: its 0.95 is an earlier interval's
    assert [t.number for t in lineage_of(study, best)] == [a0.number, b1.number]
    text = write_best(search, study).read_text()
    assert "#   steps 0-10: optim.lr=0.1 (trial 0, member 0)\n" in text
    assert "#   steps 10-20: optim.lr=0.12 (trial 3, member 1)\n" in text
    assert "# its trained weights: /pbt/member-01/checkpoints\n" in text
    assert [r["member"] for r in rows(search, study)] == [0, 1, 0, 1]
    assert a1.number != b0.number


def test_the_line_printed_when_a_trial_ends(tpe):
    _, _, trials = tpe
    assert trial_line(trials[0], "val_accuracy") == \
        "trial 0: complete  val_accuracy=0.7 (12.5 s)"
    assert trial_line(trials[2], "val_accuracy").startswith(
        "trial 2: pruned at step 20  val_accuracy=0.3")
    assert trial_line(trials[3], "val_accuracy").endswith(
        ": exit 1: ValueError: x; log /runs/t3/train.log")


def test_the_report_exits_1_until_a_trial_has_finished(tmp_path, capsys, monkeypatch):
    # (plot.png is drawn in test_tune.py's studies; matplotlib would add ~2 s here)
    monkeypatch.setattr(report_module, "plot", lambda search, study, path: None)
    search = make_search(tmp_path)
    study = memory_study()
    add_trial(study, search, "FAIL", failure="crash", error="exit 1")
    assert report(search, study) == 1
    assert "no trial has finished yet" in capsys.readouterr().out
    add_trial(study, search, value=0.5)
    assert report(search, study) == 0
    out = capsys.readouterr().out
    assert "best: trial 1, val_accuracy=0.5" in out
    assert "plot          (not drawn: matplotlib is not installed)" in out
    assert (tmp_path / "best.yaml").is_file() and (tmp_path / "results.csv").is_file()
