"""`ringfeed train` end to end: bad configs (one line, exit 2, before Horovod works), both
frameworks training under `horovodrun -np 2` with validation, metrics.jsonl, TensorBoard files
and checkpoints; SIGTERM on one rank -> checkpoint -> `--resume auto` reaching bit-identical
torch weights; TF resume from a checkpoint with a corrupt newer one skipped; NaN on one rank
stopping all of them; a run under mpirun. Both resumes train a model with BatchNorm: its
statistics and validations are the uninterrupted run's too (train.average_bn_stats)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import BIN, REPO, horovodrun, run, test_env
from train_util import (
    finish,
    rank_process,
    start,
    toy_config,
    train_steps,
    wait_for_step,
    write_config,
    write_toy_shards,
)

from ringfeed.train.cli import main

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

RINGFEED = BIN / "ringfeed"
HOROVODRUN = BIN / "horovodrun"
USER_CODE_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def config(tmp_path: Path, shards: Path, name: str = "run", **overrides) -> Path:
    out = tmp_path / name
    return write_config(tmp_path / f"{name}.yaml", **toy_config(shards, out, **overrides))


def summary(cfg: Path) -> dict:
    out = Path(yaml.safe_load(cfg.read_text())["output"]["dir"])
    return json.loads((out / "summary.json").read_text())


def train_two_ranks(tmp_path: Path, shards: Path, name: str, steps: int, **overrides) -> dict:
    """A complete `horovodrun -np 2` run that validates well; its summary."""
    cfg = config(tmp_path, shards, name, **overrides)
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=300, env=test_env(**USER_CODE_ENV))
    assert res.returncode == 0, res.output[-4000:]
    done = summary(cfg)
    assert done["status"] == "finished" and done["step"] == steps, done
    assert done["world_size"] == 2 and done["val"]["accuracy"] > 0.6, done
    return done


# -- config validation: in-process, no framework import -------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["train.epochz=3"], "train.epochz: unknown key (did you mean 'epochs'?)"),
    (["data.batch_size=abc"], "data.batch_size: Input should be a valid integer"),
    (["data.train=/nonexistent/shards"], "data.train: /nonexistent/shards does not exist"),
    (["data.global_batch_size=10", "train.accumulate=3"],
     "data.global_batch_size=10 is not divisible by ranks (1) x train.accumulate (3) = 3"),
    (["model.name=resnet"], "model.name: unknown model 'resnet'"),
    (["train.precision=fp8"], "train.precision: Input should be 'fp32', 'bf16' or 'fp16'"),
    (["train.loss=nosuchmodule:loss"], "train.loss: module 'nosuchmodule' not found"),
    (["data.target_key=label.cls"], "data.target_key: 'label.cls' is not a field"),
    (["checkpoint.resume=/no/such/ckpt"], "checkpoint.resume: /no/such/ckpt does not exist"),
    (["train"], "--set 'train': expected KEY=VALUE"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, shards, capsys, overrides, expected):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    cfg = config(tmp_path, shards)
    code = main(["train", str(cfg), *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ringfeed: error: "), err
    assert expected in err, err


def test_existing_checkpoints_need_resume_or_a_new_dir(tmp_path, shards, capsys):
    cfg = config(tmp_path, shards)
    (tmp_path / "run" / "checkpoints" / "ckpt-000000010").mkdir(parents=True)
    assert main(["train", str(cfg)]) == 2
    assert "already holds checkpoints of an earlier run" in capsys.readouterr().err


def test_print_config_shows_resolved_values_and_defaults(tmp_path, shards, capsys):
    cfg = config(tmp_path, shards)
    assert main(["train", str(cfg), "--print-config", "--set", "train.max_steps=7",
                 "--set", "optim.schedule=cosine"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["train"]["max_steps"] == 7 and resolved["optim"]["schedule"] == "cosine"
    assert resolved["train"]["precision"] == "fp32"  # a default filled in
    assert resolved["checkpoint"]["keep"] == 10  # from the file


def test_bad_config_under_horovodrun_fails_fast_on_every_rank(tmp_path, shards):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    cfg = config(tmp_path, shards)
    res = horovodrun(2, [RINGFEED, "train", cfg, "--set", "optim.lr=-1"], timeout=120)
    assert res.returncode != 0 and "Exit code: 2" in res.output, res.output[-3000:]
    # (the launcher may kill the other rank before it prints the same line)
    assert "]<stderr>:ringfeed: error: " in res.output, res.output[-3000:]
    assert "optim.lr: Input should be greater than 0" in res.output
    assert "ringfeed train: torch" not in res.output  # stopped before building anything


# -- torch: train, SIGTERM one rank, resume, compare ----------------------------------------
def val_records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's validation records by step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val_")}
            for r in records if "val_loss" in r}


# A model with BatchNorm: every rank's running statistics follow its own batches, and a
# checkpoint holds one set. train.average_bn_stats averages them before every validation and
# checkpoint, so a resumed run validates as the uninterrupted one did (without it the first
# validation after the resume differs: each rank of the uninterrupted run used its own).
BN_MODEL = {"name": "train_util:bn_mlp", "args": {"num_classes": 3, "hidden": 16}}
# The resumed run's BatchNorm statistics and validations against the uninterrupted run's: the
# statistics were averaged at the signal's step, which the uninterrupted run did not average
# at, so they may round differently (measured, SIGTERM at steps 13 and 21: validation within
# 2.2e-8 relative, the final statistics bit-identical); the parameters are bit-identical.
BN_RTOL = 1e-5


def test_torch_two_ranks_sigterm_then_resume_is_bit_identical(tmp_path, shards):
    """Promises: What is lost on a crash; Signals (train/RECOVERY.md). With BatchNorm: the
    resumed run's weights are the uninterrupted run's bit for bit, its BatchNorm statistics
    and every validation after the resume the same to BN_RTOL."""
    import torch

    common = {"model": BN_MODEL, "optim": {"lr": 0.02}, "data": {"batch_size": 4},
              "train": {"epochs": 4, "log_every": 5, "val_every": 20},
              "checkpoint": {"every_steps": 10, "keep": 3}}
    done = train_two_ranks(tmp_path, shards, "full", 240, **common)  # 480 / (2 x 4) x 4 epochs
    assert 0 <= done["data_wait_share"] < 1
    out = tmp_path / "full"
    assert train_steps(out / "metrics.jsonl") == list(range(5, 241, 5))
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["ckpt-000000220", "ckpt-000000230", "ckpt-000000240"]  # keep: 3

    cut = config(tmp_path, shards, "cut", **common)
    job = start([HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", RINGFEED, "train", cut],
                env=test_env(**USER_CODE_ENV))
    try:
        assert wait_for_step(tmp_path / "cut" / "metrics.jsonl", 10, job, timeout=240)
        rank1 = rank_process(job, 1)
        assert rank1 is not None
        rank1.send_signal(signal.SIGTERM)  # one rank only: the stop must still be agreed
    finally:
        code, output = finish(job, timeout=240)
    assert code != 0 and "Exit code: 143" in output, output[-4000:]
    stopped = summary(cut)
    assert stopped["status"] == "stopped by SIGTERM" and 10 <= stopped["step"] < 240, output
    assert f"ckpt-{stopped['step']:09d} (signal)" in output

    res = horovodrun(2, [RINGFEED, "train", cut, "--resume", "auto"], timeout=300,
                     env=test_env(**USER_CODE_ENV))
    assert res.returncode == 0, res.output[-4000:]
    assert f"resumed from {stopped['checkpoint']} at step {stopped['step']}" in res.output
    steps = train_steps(tmp_path / "cut" / "metrics.jsonl")
    assert steps == sorted(set(steps)) and steps[-1] == 240  # history rewritten, not doubled

    def final(run: str) -> dict:
        path = tmp_path / run / "checkpoints" / "ckpt-000000240" / "state.pt"
        return torch.load(path, map_location="cpu", weights_only=True)

    a, b = final("full"), final("cut")
    for name, tensor in a["model"].items():
        if name.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(b["model"][name], tensor, rtol=BN_RTOL, atol=0, msg=name)
        else:
            assert torch.equal(tensor, b["model"][name]), name
    full, resumed = val_records(out), val_records(tmp_path / "cut")
    assert sorted(full) == sorted(resumed) == list(range(20, 241, 20))
    for step, metrics in full.items():
        assert resumed[step] == pytest.approx(metrics, rel=BN_RTOL), step
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


def test_nan_loss_on_one_rank_stops_all_ranks(tmp_path, shards):
    """Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    cfg = config(tmp_path, shards, train={"loss": "train_util:nan_on_rank1_at_step3"})
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=240, env=test_env(**USER_CODE_ENV))
    assert res.returncode != 0
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:ringfeed: error: loss is nan at step 3" in res.output, \
            res.output[-4000:]
    assert "Exit code: 3" in res.output


@pytest.mark.skipif(not shutil.which("mpirun"), reason="no mpirun (install openmpi-bin)")
def test_torch_under_mpirun(tmp_path, shards):
    cfg = config(tmp_path, shards, train={"max_steps": 20, "log_every": 10},
                 data={"val_split": None})
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", RINGFEED, "train", cfg]
    res = run(cmd, timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    done = summary(cfg)
    assert done["world_size"] == 2 and done["step"] == 20


# -- TensorFlow: train, resume from a copied checkpoint past a corrupt newer one -------------
def test_tensorflow_two_ranks_train_and_resume_past_a_corrupt_checkpoint(tmp_path, shards):
    """Promise: Checkpoints that survive being killed (train/RECOVERY.md)."""
    common = {"framework": "tensorflow", "model": BN_MODEL,
              "train": {"epochs": 2, "log_every": 10},
              "checkpoint": {"every_steps": 40, "every_epochs": 1, "keep": 10}}
    train_two_ranks(tmp_path, shards, "full", 120, **common)  # 480 / (2 x 4) x 2 epochs
    saved = [(r["step"], r["reason"]) for r in map(json.loads, (
        tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "checkpoint"]
    assert saved == [(40, "every_steps"), (60, "every_epochs"), (80, "every_steps"),
                     (120, "every_steps")]
    assert list((tmp_path / "full" / "tensorboard").glob("events.out.tfevents.*"))

    again = config(tmp_path, shards, "again", **common)
    src, dst = tmp_path / "full" / "checkpoints", tmp_path / "again" / "checkpoints"
    for step in (40, 60):
        shutil.copytree(src / f"ckpt-{step:09d}", dst / f"ckpt-{step:09d}")
    data = next((dst / "ckpt-000000060").glob("*.data-*"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    res = horovodrun(2, [RINGFEED, "train", again, "--resume", "auto"], timeout=300,
                     env=test_env(**USER_CODE_ENV))
    assert res.returncode == 0, res.output[-4000:]
    assert "skipping checkpoint" in res.output and "ckpt-000000060" in res.output
    assert f"resumed from {dst / 'ckpt-000000040'} at step 40" in res.output

    import tensorflow as tf

    def final(run: str) -> dict[str, np.ndarray]:
        prefix = tmp_path / run / "checkpoints" / "ckpt-000000120" / "tf_checkpoint"
        reader = tf.train.load_checkpoint(str(prefix))
        return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                if k.startswith("model/")}

    events = next((tmp_path / "full" / "tensorboard").glob("events.out.tfevents.*"))
    logged = {(e.step, v.tag) for e in tf.compat.v1.train.summary_iterator(str(events))
              for v in e.summary.value}  # TensorBoard's own reader takes our event file
    assert {(120, "loss"), (120, "val_accuracy"), (120, "accuracy"), (60, "data_wait")} \
        <= logged

    a, b = final("full"), final("again")
    assert a.keys() == b.keys() and len(a) >= 8  # (2 Dense, 1 BatchNormalization: 4 + 4)
    # The stated tolerance for TF resume: bit-identical on CPU fp32 (measured: 0 difference),
    # BatchNorm statistics and validation included: the checkpoint resumed from was averaged
    # at its step in the uninterrupted run too.
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert val_records(tmp_path / "again") == val_records(tmp_path / "full")
    assert sorted(val_records(tmp_path / "full")) == [60, 120]
