"""output.loggers: a run's scalars, config and summary in MLflow and Weights & Biases, and a
resumed run continuing the same tracker runs.

MLflow is a real `mlflow server` started here on 127.0.0.1 (a free port, SQLite in tmp_path),
read back through its REST API; W&B runs offline (WANDB_MODE=offline) and its run file is read
back with W&B's own record protobufs. No tracker is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers import BIN, ringfeed, test_env
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.train.cli import main
from ringfeed.train.observe.trackers import flat_config


# -- one process ----------------------------------------------------------------------------
def test_a_missing_tracker_package_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    shards = write_toy_shards(tmp_path / "shards", n_train=40, n_val=8)
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, tmp_path / "out", output={"loggers": ["tensorboard", "wandb"]}))
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, as when not installed
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output.loggers: wandb needs the 'wandb' package, which is " \
                                      "not installed (pip install wandb" in err, err
    assert not (tmp_path / "out").exists()  # refused before anything started


def test_the_old_tensorboard_key_still_reads_and_conflicts_are_one_line(tmp_path, capsys):
    shards = write_toy_shards(tmp_path / "shards", n_train=40, n_val=8)
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, tmp_path / "out", output={"tensorboard": False}))
    assert main(["train", str(cfg), "--print-config"]) == 0
    assert "loggers: []" in capsys.readouterr().out
    assert main(["train", str(cfg), "--print-config", "--set", "output.loggers=[mlflow]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensorboard: replaced by output.loggers" in err, err


def test_the_config_is_flattened_into_parameters():
    flat = flat_config({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "model": {
        "name": "mlp", "args": {}}, "data": {"val": None}})
    assert flat == {"optim.lr": "0.1", "optim.betas": "[0.9, 0.99]", "model.name": "mlp",
                    "model.args": "{}", "data.val": "null"}


# -- a real MLflow server and W&B offline ------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on 127.0.0.1 (SQLite backend in tmp_path), starting: its URL. The
    test's first run starts beside it (its MLflow client retries until the server answers)."""
    pytest.importorskip("mlflow")
    port = free_port()
    log = open(tmp_path / "mlflow-server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--default-artifact-root", str(tmp_path / "mlartifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def rest(url: str, path: str, body: dict | None = None, **query: str) -> dict:
    """MLflow's REST API: GET with `query`, or POST `body`."""
    full = f"{url}/api/2.0/mlflow/{path}"
    if query:
        full += "?" + urllib.parse.urlencode(query)
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(full, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-<id>.wandb`): its log format - a 7-byte header
    (":W&B", magic, version), then 32 KiB blocks of chunks (crc32, length, type: full, first,
    middle, last) - each record one of W&B's own `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def wandb_run(files: list[Path]) -> dict:
    """What the run files hold: run ids, history steps with their keys, config, summary."""
    out: dict = {"ids": set(), "history": {}, "config": {}, "summary": {}}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["ids"].add(record.run.run_id)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                out["history"][items["_step"]] = items
            elif kind == "config":
                out["config"].update({i.key: i.value_json for i in record.config.update})
            elif kind == "summary":
                out["summary"].update({i.key or "/".join(i.nested_key): i.value_json
                                       for i in record.summary.update})
    return out


def jsonl_scalars(path: Path) -> dict[int, set[str]]:
    """metrics.jsonl's scalar keys per step, of its metric records (not its events, such as
    a checkpoint's): what every tracker must have."""
    steps: dict[int, set[str]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "event" in record:
            continue
        keys = {k for k, v in record.items() if k not in ("step", "epoch", "time")
                and isinstance(v, (int, float)) and not isinstance(v, bool)}
        steps.setdefault(record["step"], set()).update(keys)
    return steps


@pytest.mark.system
@pytest.mark.timeout(300)
def test_mlflow_and_wandb_get_every_scalar_and_a_resume_continues_the_same_runs(
        tmp_path, mlflow_server):
    shards = write_toy_shards(tmp_path / "shards", n_train=80, n_val=16)
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, out, train={"max_steps": 10, "log_every": 5, "val_every": 5},
        checkpoint={"every_steps": 5, "keep": 5},
        output={"loggers": ["tensorboard", "mlflow", "wandb"]}))
    env = test_env(MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="ringfeed-test",
                   # (retries 1, 2, 4, ... s apart while the server starts: ~2 min)
                   MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="1",
                   WANDB_MODE="offline", WANDB_PROJECT="ringfeed-test",
                   WANDB_DIR=str(tmp_path / "wandb"))
    first = ringfeed("train", str(cfg), timeout=240, env=env)
    assert first.returncode == 0, (first.output[-3000:],
                                   (tmp_path / "mlflow-server.log").read_text()[-2000:])
    ids = json.loads((out / "trackers.json").read_text())
    # resumed from step 10 (its checkpoint), to step 20
    second = ringfeed("train", str(cfg), "--resume", "auto", "--set", "train.max_steps=20",
                      timeout=180, env=env)
    assert second.returncode == 0, second.output[-3000:]
    assert "ckpt-000000010 at step 10" in second.output and "Traceback" not in second.output
    assert json.loads((out / "trackers.json").read_text()) == ids
    expected = jsonl_scalars(out / "metrics.jsonl")
    assert sorted(expected) == [5, 10, 15, 20]

    # MLflow: one run in the experiment, every metrics.jsonl scalar at its steps, the config
    # as params, the summary, ended FINISHED
    experiment = rest(mlflow_server, "experiments/get-by-name",
                      experiment_name="ringfeed-test")["experiment"]["experiment_id"]
    runs = rest(mlflow_server, "runs/search", {"experiment_ids": [experiment]})["runs"]
    assert [r["info"]["run_id"] for r in runs] == [ids["mlflow"]["id"]]
    run = runs[0]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["optim.lr"] == "0.05" and params["model.name"] == "mlp"
    logged = {m["key"] for m in run["data"]["metrics"]}
    assert {"summary/samples_per_s", "summary/val/accuracy"} <= logged
    assert set().union(*expected.values()) <= logged, set().union(*expected.values()) - logged
    for key in set().union(*expected.values()):
        history = rest(mlflow_server, "metrics/get-history", run_id=ids["mlflow"]["id"],
                       metric_key=key)["metrics"]
        steps = sorted({m["step"] for m in history})
        assert steps == sorted(s for s, keys in expected.items() if key in keys), (key, steps)
    loss = {m["step"]: m["value"] for m in rest(
        mlflow_server, "metrics/get-history", run_id=ids["mlflow"]["id"],
        metric_key="loss")["metrics"]}
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert loss == pytest.approx({r["step"]: r["loss"] for r in records if "loss" in r})

    # W&B offline: one run id across both processes' run files, every step's scalars
    files = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    wandb = wandb_run(files)
    assert wandb["ids"] == {ids["wandb"]["id"]}
    assert sorted(wandb["history"]) == [5, 10, 15, 20]
    for step, keys in expected.items():
        assert keys <= set(wandb["history"][step]), (step, keys - set(wandb["history"][step]))
    assert json.loads(wandb["config"]["optim.lr"]) == "0.05"
    assert "summary/val/accuracy" in wandb["summary"]


def test_a_tracker_failing_mid_run_is_one_warning_and_training_goes_on(capsys):
    from ringfeed.train.observe.trackers import Guarded

    class Flaky:  # a sink whose server went away after the second record
        name = "mlflow"

        def __init__(self):
            self.steps: list[int] = []

        def scalars(self, step, values):
            if len(self.steps) == 2:
                raise ConnectionError("Connection refused\nretries exhausted")
            self.steps.append(step)

        def describe(self):
            return "http://127.0.0.1:1 run abc"

    inner = Flaky()
    sink = Guarded(inner)
    for step in (10, 20, 30, 40):
        sink.scalars(step, {"loss": 1.0})
    sink.summary(40, {"status": "finished"})
    sink.close()
    out = capsys.readouterr().out
    assert inner.steps == [10, 20] and sink.failed
    assert out == ("ringfeed: warning: output.loggers: mlflow failed (ConnectionError: "
                   "Connection refused); nothing more goes to it in this run (metrics.jsonl has "
                   "everything)\n"), out
    assert sink.describe().endswith("(failed, see above)")
