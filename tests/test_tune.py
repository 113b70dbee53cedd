"""`ringfeed tune`: a bad search file is one line naming the field; a small TPE study of 2-rank
Horovod trials on digits finds a clearly better lr than its worst; the median pruner stops a bad
trial from what it streams; a study killed with SIGKILL mid-trial continues when rerun (the
orphaned job is stopped, the trial retried from its checkpoint, nothing run twice); a crashing
trial is recorded with its log and the study goes on; PBT's exploit copies a checkpoint and the
member resumes from it at the interval's step, with the lineage recorded.

Every trial is a real `horovodrun --gloo ringfeed train` job; nothing is mocked. The TPE study's
trials run on 2 ranks; the others on 1, as what they check (pruning, durability, crashes, PBT's
checkpoint copies) does not depend on the world size and each rank costs seconds of start-up."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import BIN, REPO, ringfeed, test_env
from train_util import finish, start

from ringfeed.train.cli import main


def launch(ranks: int) -> str:
    return (f"{BIN / 'horovodrun'} -np {ranks} -H localhost:{ranks} --gloo {BIN / 'ringfeed'} "
            "train {config}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """scikit-learn's bundled digits (8x8, 10 classes) as npz -> `ringfeed shard`."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    np.savez(root / "digits.npz", x=(digits.data / 16).astype(np.float32),
             y=digits.target.astype(np.int64))
    assert main(["shard", str(root / "digits.npz"), str(root / "shards"), "--format", "npz",
                 "--val-fraction", "0.2", "--shuffle-seed", "0", "--max-count", "400"]) == 0
    return root / "shards"


def base_config(tmp_path: Path, shards: Path, **train) -> Path:
    """A 10-class MLP on digits; SGD with momentum; validation at the end (or val_every)."""
    cfg = {
        "framework": "torch",
        "model": {"name": "mlp", "args": {"hidden": [32], "num_classes": 10}},
        "data": {"train": str(shards), "batch_size": 16},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train": {"max_steps": 60, "log_every": 10, **train},
        "checkpoint": {"every_steps": 100, "keep": 2},
        "output": {"dir": str(tmp_path / "unused"), "tensorboard": False},
    }
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def search_file(tmp_path: Path, base_path: Path, name: str = "search", **fields) -> Path:
    doc = {"base": str(base_path), "space": {"optim.lr": "loguniform(1e-5, 1)"},
           "metric": "val_accuracy", "direction": "maximize", "launch": launch(1),
           "output": str(tmp_path / "out"), **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def load(search: Path):
    import optuna

    doc = yaml.safe_load(search.read_text())
    return optuna.load_study(study_name=search.stem,
                             storage=f"sqlite:///{Path(doc['output']) / 'study.db'}")


def tune(search: Path, timeout: float, **env: str):
    res = ringfeed("tune", str(search), timeout=timeout, env=test_env(**env))
    assert not res.timed_out, res.output[-4000:]
    return res


def states(study) -> dict[int, str]:
    return {t.number: t.state.name for t in study.get_trials()}


# -- the search file: checked before anything runs ----------------------------------------
@pytest.mark.parametrize("fields, expected", [
    ({"space": {"optim.lrr": "loguniform(1e-4, 1)"}},
     "space.optim.lrr: not a key of the trainer config (did you mean 'optim.lr'?)"),
    ({"space": {"optim.lr": "logrand(1, 2)"}}, "space.optim.lr: expected loguniform(a, b)"),
    ({"space": {"optim.lr": "uniform(-1, 1)"}},
     "space.optim.lr: with optim.lr=-1.0: optim.lr: Input should be greater than 0"),
    ({"space": {"train.accumulate": "choice(1, 0)"}},
     "space.train.accumulate: with train.accumulate=0: train.accumulate: Input should be"),
    ({"space": {"optim": "choice(1, 2)"}}, "space.optim: is a section; name one of its keys"),
    ({"space": {"optim.lr": "loguniform(0, 1)"}}, "space.optim.lr: loguniform() needs 0 < low"),
    ({"trails": 3}, "trails: unknown key (did you mean 'trials'?)"),
    ({"direction": "up"}, "direction: Input should be 'minimize' or 'maximize'"),
    ({"metric": "accuracy"}, "metric: expected loss (training) or val_<name>"),
    ({"launch": "horovodrun -np 2 ringfeed train"}, "launch: the command must contain {config}"),
    ({"set": {"output.dir": "/tmp/x"}}, "set.output.dir: set by ringfeed tune for every trial"),
    ({"set": {"data.train": "/nonexistent/shards"}},
     "base + set: data.train: /nonexistent/shards does not exist"),
    ({"base": "/no/such/base.yaml"}, "base: /no/such/base.yaml not found"),
    ({"pruner": {"name": "hyperband"}}, "pruner.name: Input should be 'asha', 'median' or"),
    ({"algorithm": "pbt", "space": {"model.args.hidden": "choice([16], [32])"}},
     "space.model.args.hidden: PBT continues members from checkpoints"),
    ({"algorithm": "pbt", "set": {"train.max_steps": None, "train.epochs": 1}},
     "pbt: needs train.max_steps"),
    ({"initial": [{"optim.lr": 5.0}]}, "initial[0].optim.lr: 5.0 is outside the space"),
])
@pytest.mark.integration
def test_bad_search_file_is_one_line_naming_the_field(tmp_path, shards, capsys, fields,
                                                      expected):
    search = search_file(tmp_path, base_config(tmp_path, shards), **fields)
    code = main(["tune", str(search)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"ringfeed: error: {search}: "), err
    assert expected in err, err
    assert not (tmp_path / "out" / "trials").exists()  # nothing ran


def test_space_syntax_and_keys_into_the_config():
    from ringfeed.train.tune.spec import check_config_key, parse_param

    lr = parse_param("optim.lr", "loguniform(1e-4, 1e-1)")
    assert (lr.kind, lr.low, lr.high) == ("loguniform", 1e-4, 1e-1)
    acc = parse_param("train.accumulate", "int(1, 8)")
    assert acc.extremes() == [1, 8]
    hidden = parse_param("model.args.hidden", "choice([16], [32, 32])")
    assert hidden.choices == [[16], [32, 32]]
    assert hidden.decode(hidden.distribution().choices[1]) == [32, 32]  # lists travel as YAML
    assert parse_param("optim.name", "choice(sgd, adam)").choices == ["sgd", "adam"]
    assert check_config_key("model.args.anything") is None  # a free-form mapping
    assert check_config_key("data.normalize.mean") is None  # inside an optional section
    assert "is a value, not a section" in check_config_key("optim.lr.x")


@pytest.mark.parametrize("name", ["digits_tpe.yaml", "digits_pbt.yaml"])
@pytest.mark.integration
def test_example_search_files_are_valid(tmp_path, shards, monkeypatch, name):
    # they name the demo's paths relative to the repository root
    (tmp_path / "demo-out").mkdir()
    (tmp_path / "demo-out" / "digits-shards").symlink_to(shards)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    from ringfeed.train.tune.spec import load_search

    search = load_search(REPO / "examples" / "tune" / name)
    assert search.params and search.out_dir.parent == tmp_path / "demo-out" / "tune"


# -- TPE over 2-rank trials ---------------------------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(900)
def test_tpe_study_finds_a_clearly_better_lr_than_its_worst(tmp_path, shards):
    # loguniform(1e-5, 1): the smallest rates barely move SGD in 60 steps, the larger ones
    # train the MLP; seed 1 draws 0.0012, 0.040 and 1.0e-5 in its first 3 trials
    search = search_file(tmp_path, base_config(tmp_path, shards), trials=3, parallel=2,
                         seed=1, launch=launch(2))
    res = tune(search, timeout=840)
    assert res.returncode == 0, res.output[-4000:]
    study = load(search)
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials), states(study)
    best = max(trials, key=lambda t: t.value)
    worst = min(trials, key=lambda t: t.value)
    assert best.value - worst.value >= 0.3, [(t.params, t.value) for t in trials]
    assert best.params["optim.lr"] > worst.params["optim.lr"]
    # the trial's own config, metrics and log are in its run dir
    run_dir = Path(best.user_attrs["run_dir"])
    assert yaml.safe_load((run_dir / "trial.yaml").read_text())["optim"]["lr"] == \
        best.params["optim.lr"]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    # outputs: table, CSV/JSON, a runnable best config, the plot
    out = tmp_path / "out"
    assert f"best: trial {best.number}" in res.stdout
    csv_rows = (out / "results.csv").read_text().splitlines()
    assert len(csv_rows) == 4 and csv_rows[0].startswith("trial,state,val_accuracy,wall_s")
    doc = json.loads((out / "results.json").read_text())
    assert doc["best"]["trial"] == best.number and len(doc["trials"]) == 3
    from ringfeed.train.config import load_config

    best_cfg = load_config(out / "best.yaml")
    assert best_cfg.optim.lr == best.params["optim.lr"]
    assert best_cfg.output.dir == str(out / "best")
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    # rerun with the budget spent: nothing new runs
    again = tune(search, timeout=120)
    assert again.returncode == 0 and "already has 3 finished trial(s)" in again.stdout
    assert len(load(search).get_trials()) == 3


@pytest.mark.system
@pytest.mark.timeout(600)
def test_median_pruner_stops_a_bad_trial_from_its_streamed_metric(tmp_path, shards):
    # trial 0 (a good lr) sets the median at every validation; trial 1 (lr 1e-5) is at
    # chance at its first validation, far below it, and is stopped there or soon after
    base = base_config(tmp_path, shards, max_steps=1000, val_every=20)
    search = search_file(tmp_path, base, trials=2,
                         initial=[{"optim.lr": 0.05}, {"optim.lr": 1e-5}],
                         pruner={"name": "median", "startup_trials": 1})
    res = tune(search, timeout=540)
    assert res.returncode == 0, res.output[-4000:]
    study = load(search)
    good, bad = study.get_trials()
    assert good.state.name == "COMPLETE" and len(good.intermediate_values) == 50
    assert bad.state.name == "PRUNED", states(study)
    assert bad.user_attrs["pruned_at_step"] < 1000
    assert "trial 1: pruned at step" in res.stdout
    summary = Path(bad.user_attrs["run_dir"]) / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["step"] < 1000


# -- durability ------------------------------------------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(900)
def test_killed_study_continues_where_it_stopped(tmp_path, shards):
    import optuna
    import psutil

    base = base_config(tmp_path, shards, max_steps=800, log_every=50)
    yaml_doc = yaml.safe_load(base.read_text())
    yaml_doc["checkpoint"]["every_steps"] = 50
    base.write_text(yaml.safe_dump(yaml_doc))
    search = search_file(tmp_path, base, trials=2, space={"optim.lr": "loguniform(1e-3, 0.1)"})
    out = tmp_path / "out"

    proc = start([BIN / "ringfeed", "tune", search], env=test_env())
    ckpts = out / "trials" / "trial-0001" / "checkpoints"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None \
            and not any(ckpts.glob("ckpt-*")):
        time.sleep(0.05)
    assert proc.poll() is None, finish(proc, 10)[1][-4000:]
    os.kill(proc.pid, signal.SIGKILL)  # the tuner only: its trial's job is orphaned
    _, first_output = finish(proc, 30)
    study = load(search)
    before = {t.number: (t.state.name, t.value, t.datetime_complete) for t in study.get_trials()}
    assert [before[n][0] for n in (0, 1)] == ["COMPLETE", "RUNNING"], before
    orphan = study.get_trials()[1].user_attrs["launcher"]

    res = tune(search, timeout=600)
    assert res.returncode == 0, first_output[-2000:] + res.output[-4000:]
    assert "trial 1: was running in a ringfeed tune that is gone" in res.stdout
    assert not psutil.pid_exists(orphan["pid"]) or \
        psutil.Process(orphan["pid"]).create_time() != orphan["started"]  # stopped
    study = load(search)
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials)))  # one record per trial, none redone
    # the finished trial is kept as it was
    assert (trials[0].state.name, trials[0].value, trials[0].datetime_complete) == before[0]
    assert trials[1].state == optuna.trial.TrialState.FAIL
    retry = [t for t in trials if t.user_attrs.get("retry_of") == 1]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE"
    assert retry[0].params == trials[1].params
    resumed = Path(retry[0].user_attrs["resumed_from"])  # its checkpoint was carried over
    assert resumed.parent.parent == Path(retry[0].user_attrs["run_dir"])
    assert f"resumed from {resumed}" in Path(retry[0].user_attrs["log"]).read_text()
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2 and len(trials) == 3
    run_dirs = [t.user_attrs["run_dir"] for t in trials]
    assert len(set(run_dirs)) == len(run_dirs)
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[2].startswith("1,interrupted,"), rows


@pytest.mark.system
@pytest.mark.timeout(600)
def test_crashing_trial_is_recorded_and_the_study_goes_on(tmp_path, shards):
    # a user loss that fails in trial 0 only (RINGFEED_TUNE_TRIAL is set for every trial)
    (tmp_path / "crashy_loss.py").write_text(
        "import os\nimport torch.nn.functional as F\n\n\n"
        "def loss(logits, targets):\n"
        "    if os.environ.get('RINGFEED_TUNE_TRIAL') == '0' and logits.requires_grad:\n"
        "        raise RuntimeError('boom in trial 0')\n"
        "    return F.cross_entropy(logits, targets, reduction='none')\n")
    base = base_config(tmp_path, shards, max_steps=30, loss="crashy_loss:loss")
    search = search_file(tmp_path, base, trials=2)
    pythonpath = os.pathsep.join([str(tmp_path), str(REPO)])
    res = tune(search, timeout=540, PYTHONPATH=pythonpath)
    assert res.returncode == 0, res.output[-4000:]
    study = load(search)
    assert states(study) == {0: "FAIL", 1: "COMPLETE"}
    crashed = study.get_trials()[0]
    assert crashed.user_attrs["failure"] == "crash"
    assert "RuntimeError: boom in trial 0" in crashed.user_attrs["error"]
    assert "boom in trial 0" in Path(crashed.user_attrs["log"]).read_text()
    assert "trial 0: FAILED (crash)" in res.stdout and crashed.user_attrs["log"] in res.stdout
    assert (tmp_path / "out" / "results.csv").read_text().splitlines()[1].startswith("0,crash,")


# -- PBT -----------------------------------------------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(900)
def test_pbt_exploit_copies_a_checkpoint_and_the_member_resumes_from_it(tmp_path, shards):
    base = base_config(tmp_path, shards, max_steps=20, val_every=10)
    search = search_file(
        tmp_path, base, algorithm="pbt", parallel=2,
        set={"checkpoint.every_steps": 10, "optim.momentum": 0.0},
        space={"optim.lr": "loguniform(1e-4, 1)"},
        pbt={"population": 2, "interval": 10, "quantile": 0.5, "resample_probability": 0.0})
    res = tune(search, timeout=840)
    assert res.returncode == 0, res.output[-4000:]
    study = load(search)
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials), states(study)
    first = {t.user_attrs["member"]: t for t in trials if t.user_attrs["generation"] == 0}
    second = {t.user_attrs["member"]: t for t in trials if t.user_attrs["generation"] == 1}
    # the weaker member of interval 0 took the stronger one's checkpoint of step 10
    weak = min(first, key=lambda m: first[m].value)
    strong = 1 - weak
    child = second[weak]
    assert child.user_attrs["exploited"] is True
    assert child.user_attrs["parent_member"] == strong
    assert child.user_attrs["parent_trial"] == first[strong].number
    assert second[strong].user_attrs["exploited"] is False
    ratio = child.params["optim.lr"] / first[strong].params["optim.lr"]
    assert min(abs(ratio - 0.8), abs(ratio - 1.2)) < 1e-9  # explore: the donor's lr x0.8/1.2
    # the copy is the donor's checkpoint, file for file, and the member resumed from it
    out = tmp_path / "out" / "pbt"
    copied = out / f"member-{weak:02d}" / "checkpoints" / "ckpt-000000010"
    donor = out / f"member-{strong:02d}" / "checkpoints" / "ckpt-000000010"
    copied_meta = json.loads((copied / "meta.json").read_text())
    assert copied_meta["files"] == json.loads((donor / "meta.json").read_text())["files"]
    log = (out / f"member-{weak:02d}" / "gen-001.log").read_text()
    assert f"resumed from {copied} at step 10" in log
    summary = json.loads((out / f"member-{weak:02d}" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["step"] == 20
    events = [json.loads(line) for line in
              (out / f"member-{weak:02d}" / "metrics.jsonl").read_text().splitlines()]
    exploits = [e for e in events if e.get("event") == "pbt_exploit"]  # (beside checkpoints')
    assert len(exploits) == 1
    assert {"step": 10, "event": "pbt_exploit", "from_member": strong}.items() <= \
        exploits[0].items()
    plan = study.user_attrs["pbt_plan_1"]
    assert plan["copied"] is True and plan["members"][str(weak)]["parent_member"] == strong
    # lineage in the results and the best config's comment
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    row = next(r for r in doc["trials"] if r["trial"] == child.number)
    assert (row["member"], row["generation"], row["parent_member"]) == (weak, 1, strong)
    assert (tmp_path / "out" / "plot.png").exists()
    assert "the schedule it followed" in (tmp_path / "out" / "best.yaml").read_text()
