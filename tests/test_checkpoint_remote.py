"""Checkpoints in object storage and written in the background (issue 38), against moto's S3
server on 127.0.0.1: the store (payload objects, meta.json last, keep, leftovers), a damaged or
incomplete remote checkpoint skipped, kill -9 mid-upload, a resume from S3 on 2 ranks
bit-identical, checkpoint.async equal to synchronous saves bit for bit, SIGTERM during a
background write, and a background write's failure agreed at the next save.

"The same" means bit-identical torch fp32 weights and optimizer state. Every run is bounded by
a timeout; the training runs are forked children of the test process (fault_util)."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fault_util import assert_same_torch_state, read_jsonl, ringfeed_forked, torch_final
from helpers import BIN, horovodrun, test_env
from s3_proxy import AWS_ENV, moto_for_module
from test_checkpointing import OneRank, Pipe, checkpointer_of
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import UserError
from ringfeed.remote import RetryPolicy
from ringfeed.train.checkpoint.checkpointer import Checkpointer
from ringfeed.train.checkpoint.files import (
    CheckpointWriteError,
    find_resume_point,
    probe_writable,
    remove_stale_temporaries,
    write_checkpoint,
)
from ringfeed.train.checkpoint.store import open_store
from ringfeed.train.config import RunConfig
from ringfeed.train.runstate import TrainState

FAULT = "RINGFEED_FAULT"
QUICK = RetryPolicy(budget_s=5, first_backoff_s=0.05, max_backoff_s=0.2)


@pytest.fixture(scope="module")
def s3() -> Any:
    """moto's S3 server with a bucket `ckpt`; yields its fsspec options."""
    import s3fs

    with moto_for_module() as endpoint:
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(**options).mkdir("ckpt")
        yield options


def fs_of(options: dict) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return fs


def payload(text: str):
    def write(directory: Path) -> None:
        (directory / "a.bin").write_text(text)
        (directory / "b.bin").write_text(text * 2)
    return write


# -- the store --------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_remote_checkpoint_is_complete_by_its_meta_json_verified_kept_and_cleaned(
        s3, tmp_path):
    """Promise: Checkpoints in object storage (train/RECOVERY.md)."""
    store = open_store("s3://ckpt/unit", s3, tmp_path / "staging", QUICK)
    for step in (10, 20, 30):
        location = write_checkpoint(store, step, {"epoch": 0}, payload(f"s{step}"), keep=2)
        assert location == f"s3://ckpt/unit/ckpt-{step:09d}"
    fs = fs_of(s3)
    assert sorted(fs.find("ckpt/unit")) == [f"ckpt/unit/ckpt-{s:09d}/{f}" for s in (20, 30)
                                            for f in ("a.bin", "b.bin", "meta.json")]
    assert not list((tmp_path / "staging").iterdir())  # staging emptied after each write

    lines: list[str] = []
    hit = find_resume_point("auto", store, lines.append)
    assert hit.location == "s3://ckpt/unit/ckpt-000000030" and hit.meta["step"] == 30
    assert (hit.path / "b.bin").read_text() == "s30s30" and not lines
    store.release(hit.path)
    assert not hit.path.exists()

    # a damaged payload object: reported and skipped for the previous checkpoint
    fs.pipe_file("ckpt/unit/ckpt-000000030/b.bin", b"s30s3")
    hit = find_resume_point("auto", store, lines.append)
    assert hit.location.endswith("ckpt-000000020")
    assert "ckpt-000000030: b.bin is corrupt or truncated" in lines[-1]
    store.release(hit.path)
    # named by URL (--resume URL): it must be good
    named = find_resume_point("s3://ckpt/unit/ckpt-000000020", store, lines.append,
                              lambda url: open_store(url, s3, tmp_path / "staging", QUICK))
    assert named.meta["step"] == 20
    named.store.release(named.path)
    with pytest.raises(UserError, match="ckpt-000000030: b.bin is corrupt"):
        find_resume_point("s3://ckpt/unit/ckpt-000000030", store, lines.append,
                          lambda url: open_store(url, s3, tmp_path / "staging", QUICK))

    # objects without meta.json (an upload killed, a delete cut short after meta.json):
    # incomplete, skipped, and removed by the next run's clean-up
    fs.pipe_file("ckpt/unit/ckpt-000000040/a.bin", b"half")
    fs.rm_file("ckpt/unit/ckpt-000000020/meta.json")
    lines.clear()
    assert find_resume_point("auto", store, lines.append) is None  # (30 corrupt, 20 and 40 cut)
    assert sum("no meta.json (incomplete)" in line for line in lines) == 2
    assert remove_stale_temporaries(store) == ["ckpt-000000020", "ckpt-000000040"]
    assert store.names() == ["ckpt-000000030"]

    # the same step saved again: complete again, with the new payload
    write_checkpoint(store, 30, {"epoch": 1}, payload("new"), keep=2)
    hit = find_resume_point("auto", store, lines.append)
    assert hit.meta["epoch"] == 1 and (hit.path / "a.bin").read_text() == "new"
    store.release(hit.path)


@pytest.mark.integration
def test_a_bucket_that_does_not_exist_is_exit_4_naming_the_url(s3, tmp_path):
    """Promise: Checkpoints in object storage (train/RECOVERY.md)."""
    store = open_store("s3://no-such-bucket/run", s3, tmp_path / "staging", QUICK)
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint "
                                                   r"s3://no-such-bucket/run: ") as e:
        probe_writable(store)
    assert e.value.exit_code == 4
    with pytest.raises(CheckpointWriteError, match="s3://no-such-bucket/run/ckpt-000000001"):
        write_checkpoint(store, 1, {}, payload("x"), keep=1)


def pass_after_first_fault(proxy, kind: str) -> None:
    while proxy.counters()["faults"].get(kind, 0) < 1:
        time.sleep(0.02)
    proxy.set_mode("pass")


@pytest.mark.integration
def test_a_storage_outage_is_waited_out_and_past_the_budget_is_exit_75(s3, tmp_path):
    """Promise: Checkpoints in object storage (train/RECOVERY.md)."""
    from s3_proxy import FaultProxy, host_port

    from ringfeed.remote import StorageUnavailable

    with FaultProxy(host_port(s3["endpoint_url"])) as proxy:
        # short timeouts and no retries of botocore's own: the policy's waits are what is tested
        options = {**s3, "endpoint_url": proxy.url, "config_kwargs": {
            "connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}
        store = open_store("s3://ckpt/outage", options, tmp_path / "staging",
                           RetryPolicy(budget_s=30, first_backoff_s=0.1, max_backoff_s=0.5))
        # an outage that ends once it has reset a request (a timed one could end, on a loaded
        # box, before the first request came)
        proxy.set_mode("reset")
        ended = threading.Thread(target=pass_after_first_fault, args=(proxy, "reset"),
                                 daemon=True)
        ended.start()
        write_checkpoint(store, 1, {}, payload("x"), keep=1)  # waited out
        ended.join(timeout=30)
        assert proxy.counters()["faults"]["reset"] >= 1
        hit = find_resume_point("auto", store, print)
        assert hit.meta["step"] == 1
        store.release(hit.path)
        proxy.set_mode("reset")
        short = open_store("s3://ckpt/outage", options, tmp_path / "staging",
                           RetryPolicy(budget_s=0.5, first_backoff_s=0.1, max_backoff_s=0.2))
        with pytest.raises(StorageUnavailable, match=r"s3://ckpt/outage/ckpt-000000002/\S+: "
                                                     r"[a-z ]+ failed for \d") as e:
            write_checkpoint(short, 2, {}, payload("y"), keep=1)
        assert e.value.exit_code == 75
        proxy.set_mode("pass")
    hit = find_resume_point("auto", open_store("s3://ckpt/outage", s3, tmp_path / "staging",
                                               QUICK), print)
    assert hit.meta["step"] == 1  # the step 1 checkpoint is still the newest complete one
    hit.store.release(hit.path)


# -- the checkpointer's background writes -----------------------------------------------------
def checkpointer(tmp_path: Path, **checkpoint: Any) -> tuple[Checkpointer, list[str], list]:
    cfg = RunConfig.model_validate({"framework": "torch", "data": {"train": "unused"},
                                    "output": {"dir": str(tmp_path / "run")},
                                    "checkpoint": checkpoint})
    lines: list[str] = []
    recorded: list = []
    return checkpointer_of(cfg, OneRank(), lines.append, lines.append, recorded.append), \
        lines, recorded


def test_an_async_write_is_collected_by_the_next_save_and_a_failure_agreed_there(tmp_path):
    """Promise: Checkpoints written in the background (train/RECOVERY.md)."""
    ckpt, lines, recorded = checkpointer(tmp_path, **{"async": True, "on_error": "warn"})
    assert ckpt.save(TrainState(step=2), Pipe(), "every_steps") == []  # in the background
    (first,) = ckpt.save(TrainState(step=4), Pipe(), "every_steps")  # collects step 2
    assert first.step == 2 and first.location.endswith("ckpt-000000002") and first.error is None
    assert [s.step for s in ckpt.drain()] == [4] and ckpt.drain() == []
    assert [s.step for s in recorded] == [2, 4]
    assert any(line.startswith(f"saved checkpoint {first.location} (every_steps): training "
                               "blocked ") for line in lines)
    # the directory becomes a file: the write in the background fails; the next save (or the
    # end) reports it on every rank, under on_error: warn without stopping
    import shutil

    shutil.rmtree(ckpt.directory)
    Path(ckpt.directory).write_text("not a directory")
    assert ckpt.save(TrainState(step=6), Pipe(), "every_steps") == []
    (failed,) = ckpt.save(TrainState(step=8), Pipe(), "every_steps")
    assert failed.step == 6 and failed.location is None and "cannot write" in failed.error
    assert "checkpoint at step 6 NOT saved" in lines[-1]
    ckpt.section.on_error = "fail"
    with pytest.raises(CheckpointWriteError, match="at step 8: cannot write checkpoint"):
        ckpt.drain()


# -- training runs (forked children of this process) ------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards", n_train=96, n_val=8)


def run_config(tmp_path: Path, shards: Path, name: str, checkpoint: dict | None = None,
               steps: int = 8) -> Path:
    """One process, `steps` steps, a checkpoint every 2."""
    sections = {"data": {"batch_size": 4, "val_split": None},
                "train": {"max_steps": steps, "log_every": 1},
                "checkpoint": {"every_steps": 2, "keep": 10, **(checkpoint or {})},
                "output": {"dir": str(tmp_path / name), "tensorboard": False}}
    return write_config(tmp_path / f"{name}.yaml",
                        **toy_config(shards, tmp_path / name, **sections))


def remote_state(options: dict, url: str) -> dict:
    import torch

    data = fs_of(options).cat_file(url.removeprefix("s3://") + "/state.pt")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> Path:
    """The uninterrupted run with synchronous local checkpoints."""
    tmp = tmp_path_factory.mktemp("ref")
    ref = ringfeed_forked(["train", run_config(tmp, shards, "ref")], tmp / "ref.log")
    assert ref.code == 0, ref.output[-3000:]
    return tmp / "ref"


@pytest.mark.system
def test_async_checkpoints_equal_synchronous_ones_and_a_kill_mid_write_resumes_bit_identical(
        tmp_path, shards, reference):
    """Promise: Checkpoints written in the background (train/RECOVERY.md)."""
    cfg = run_config(tmp_path, shards, "async", {"async": True})
    # SIGKILLed half-way through staging state.pt of step 4, in the background thread
    state_size = (reference / "checkpoints" / "ckpt-000000004" / "state.pt").stat().st_size
    killed = ringfeed_forked(["train", cfg], tmp_path / "killed.log",
                             env={FAULT: f"kill-in-checkpoint-write:4:{state_size // 2}"})
    assert killed.code == -9, killed.output[-3000:]
    # written in the background while step 3 trained: the synchronous save's weights
    assert_same_torch_state(torch_final(reference, 2), torch_final(tmp_path / "async", 2))
    assert not (tmp_path / "async" / "checkpoints" / "ckpt-000000004").exists()
    resumed = ringfeed_forked(["train", cfg, "--resume", "auto"], tmp_path / "resumed.log")
    assert resumed.code == 0, resumed.output[-3000:]
    assert "ckpt-000000002 at step 2" in resumed.output, resumed.output[-3000:]
    for step in (4, 6, 8):
        assert_same_torch_state(torch_final(reference, step),
                                torch_final(tmp_path / "async", step))
    # the cost of each checkpoint: in the log line, metrics.jsonl and summary.json
    assert re.search(r"saved checkpoint \S+ckpt-000000004 \(every_steps\): training blocked "
                     r"\d+\.\d\ds, write \d+\.\d\ds", resumed.output), resumed.output[-3000:]
    events = [r for r in read_jsonl(tmp_path / "async" / "metrics.jsonl")
              if r.get("event") == "checkpoint" and r["step"] > 2]  # (the resumed process's)
    assert [e["step"] for e in events] == [4, 6, 8] and all(e["write_s"] > 0 for e in events)
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["checkpoints_written"] == 3
    for key in ("checkpoint_write_s", "checkpoint_blocked_s"):
        values = [e[key.removeprefix("checkpoint_")] for e in events]
        assert summary[key]["max"] == pytest.approx(max(values), abs=1e-4)
        assert summary[key]["total"] == pytest.approx(sum(values), abs=1e-3)


@pytest.mark.system
def test_kill_9_mid_upload_resumes_from_the_previous_remote_checkpoint(
        tmp_path, shards, reference, s3):
    """Promise: Checkpoints in object storage (train/RECOVERY.md)."""
    written = reference / "checkpoints" / "ckpt-000000004"
    state_size = (written / "state.pt").stat().st_size
    staged = state_size + (written / "meta.json").stat().st_size + 200  # (its config differs)
    # bytes count as staged, then as uploaded: killed once state.pt is uploaded, before
    # meta.json, which would publish it
    url = "s3://ckpt/kill"
    cfg = run_config(tmp_path, shards, "run", {"dir": url, "storage_options": s3})
    killed = ringfeed_forked(["train", cfg], tmp_path / "killed.log",
                             env={FAULT: f"kill-in-checkpoint-write:4:{staged + 1}"})
    assert killed.code == -9, killed.output[-3000:]
    fs = fs_of(s3)
    objects = {p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1]
               for p in fs.find(url.removeprefix("s3://"))}
    assert "ckpt-000000004/meta.json" not in objects and "ckpt-000000002/meta.json" in objects
    assert "ckpt-000000004/state.pt" in objects  # uploaded, never published
    resumed = ringfeed_forked(["train", cfg, "--resume", "auto"], tmp_path / "resumed.log")
    assert resumed.code == 0, resumed.output[-3000:]
    assert f"resumed from {url}/ckpt-000000002 at step 2" in resumed.output
    assert f"removed incomplete checkpoint(s) ckpt-000000004 in {url}" in resumed.output
    assert_same_torch_state(torch_final(reference, 8),
                            remote_state(s3, f"{url}/ckpt-000000008"))


@pytest.mark.system
def test_sigterm_during_an_async_write_waits_for_it_then_exits_143(tmp_path, shards, s3):
    """Promise: Checkpoints written in the background (train/RECOVERY.md)."""
    url = "s3://ckpt/sigterm"
    cfg = run_config(tmp_path, shards, "run", {"dir": url, "storage_options": s3,
                                               "async": True})
    res = ringfeed_forked(["train", cfg], tmp_path / "run.log",
                          env={FAULT: "sigterm-in-checkpoint-write:2"})
    assert res.code == 143, res.output[-3000:]
    assert "waited" in res.output and "for the checkpoint write of step 2" in res.output
    store = open_store(url, s3, tmp_path / "staging", QUICK)
    hit = find_resume_point("auto", store, print)  # the signal's, at the step it met
    assert hit.meta["step"] in (3, 4) and hit.meta["reason"] == "signal"
    assert store.names() == ["ckpt-000000002", hit.location.rsplit("/", 1)[-1]]
    store.release(hit.path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped by SIGTERM" and summary["checkpoints_written"] == 2
    assert summary["checkpoint"] == hit.location


@pytest.mark.system
def test_two_ranks_resume_auto_from_s3_past_a_damaged_checkpoint_bit_identical(
        tmp_path, shards, s3):
    """Promise: Checkpoints in object storage (train/RECOVERY.md)."""
    url = "s3://ckpt/two-ranks"
    cfg = run_config(tmp_path, shards, "run", {"dir": url, "storage_options": s3, "keep": 2})
    env = test_env(**AWS_ENV)
    first = horovodrun(2, [BIN / "ringfeed", "train", cfg], timeout=240, env=env)
    assert first.returncode == 0, first.output[-4000:]
    store = open_store(url, s3, tmp_path / "staging", QUICK)
    assert store.names() == ["ckpt-000000006", "ckpt-000000008"]  # keep: 2, deleted remotely
    uninterrupted = remote_state(s3, f"{url}/ckpt-000000008")
    fs_of(s3).pipe_file(url.removeprefix("s3://") + "/ckpt-000000008/state.pt", b"damaged")
    again = horovodrun(2, [BIN / "ringfeed", "train", cfg, "--resume", "auto"], timeout=240,
                       env=env)
    assert again.returncode == 0, again.output[-4000:]
    assert "ckpt-000000008: state.pt is corrupt or truncated" in again.output
    assert f"resumed from {url}/ckpt-000000006 at step 6" in again.output
    assert_same_torch_state(uninterrupted, remote_state(s3, f"{url}/ckpt-000000008"))
