"""One `ringfeed tune` trial seen from outside its job (train/tune/trial.py): the metrics.jsonl
tail across the trainer's rewrites, the line of a failed job's log that says why, the metric's
value, and the checkpoints a trial hands on (newest complete one, adopted into another run
dir). Launching and stopping real jobs: test_tune.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tune_util import write_checkpoint_dir

from ringfeed.train.tune.trial import (
    MetricsTail,
    adopt_checkpoint,
    error_line,
    metric_value,
    newest_checkpoint,
    owner,
    process_alive,
)


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_the_tail_returns_each_complete_record_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []  # not there yet
    append(path, '{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert tail.poll() == [{"step": 1, "loss": 2.0}]
    assert tail.poll() == []
    append(path, 'ss": 1.5}\n[1, 2]\nnot json\n{"step": 3}\n')
    assert tail.poll() == [{"step": 2, "loss": 1.5}, {"step": 3}]  # lists and junk skipped


def test_the_tail_starts_over_when_the_file_is_replaced_or_shrinks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    append(path, '{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    assert len(tail.poll()) == 3
    # a resumed run rewrites it without the records after its checkpoint: a new inode
    (tmp_path / "new").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    os.replace(tmp_path / "new", path)
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    path.write_text('{"step": 1}\n')  # truncated in place
    assert tail.poll() == [{"step": 1}]


def test_the_metric_is_its_last_numeric_value_or_the_one_at_a_step():
    records = [{"step": 10, "val_accuracy": 0.5}, {"step": 10, "loss": 1.0},
               {"step": 20, "val_accuracy": 0.75}, {"step": 30, "val_accuracy": "n/a"}]
    assert metric_value(records, "val_accuracy") == 0.75
    assert metric_value(records, "val_accuracy", at_step=10) == 0.5
    assert metric_value(records, "val_accuracy", at_step=30) is None
    assert metric_value(records, "val_loss") is None


@pytest.mark.parametrize("log, line", [
    ("[1]<stderr>:Traceback (most recent call last):\n[1]<stderr>:  File \"x.py\"\n"
     "[1]<stderr>:ringfeed: error: data.train: no manifest.json\n"
     "RuntimeError: Horovod detected that one or more processes exited\n",
     "ringfeed: error: data.train: no manifest.json"),
    ("noise ringfeed: not restartable: the loss is NaN at step 4\n",
     "ringfeed: not restartable: the loss is NaN at step 4"),
    ("[0]<stderr>:Traceback (most recent call last):\n[0]<stderr>:  File \"m.py\", line 3\n"
     "[0]<stderr>:ValueError: my model is broken\nProcess 0 exit with status code 1.\n"
     "RuntimeError: Horovod detected that one or more processes exited\n",
     "ValueError: my model is broken"),  # the rank's exception, not the launcher's
    ("starting\n\nKilled\n", "Killed"),
    ("", "no output"),
])
def test_a_failed_jobs_log_line(tmp_path, log, line):
    (tmp_path / "train.log").write_text(log)
    assert error_line(tmp_path / "train.log") == line
    assert error_line(tmp_path / "missing.log") == "no log"


def test_the_newest_complete_checkpoint_and_the_one_of_a_step(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    for step in (10, 20, 30):
        write_checkpoint_dir(tmp_path, step)
    newest = tmp_path / "checkpoints" / "ckpt-000000030"
    (newest / "state.pt").write_bytes(b"damaged")
    assert newest_checkpoint(tmp_path).name == "ckpt-000000020"
    assert newest_checkpoint(tmp_path, step=10).name == "ckpt-000000010"
    assert newest_checkpoint(tmp_path, step=30) is None
    assert newest_checkpoint(tmp_path, step=40) is None


def test_an_adopted_checkpoint_is_the_only_one_resume_auto_finds(tmp_path):
    donor = tmp_path / "member-00"
    source = write_checkpoint_dir(donor, 20)
    (donor / "metrics.jsonl").write_text('{"step": 20, "val_accuracy": 0.9}\n')
    member = tmp_path / "member-01"
    write_checkpoint_dir(member, 40)  # its own, newer: must not win a --resume auto
    (member / "checkpoints" / ".ckpt-000000020.tmp-tune").mkdir()  # a copy killed halfway
    adopted = adopt_checkpoint(source, member, metrics_from=donor / "metrics.jsonl")
    assert adopted == member / "checkpoints" / "ckpt-000000020"
    assert newest_checkpoint(member) == adopted
    assert sorted(p.name for p in (member / "checkpoints").iterdir()) == ["ckpt-000000020"]
    assert json.loads((member / "metrics.jsonl").read_text())["val_accuracy"] == 0.9
    assert newest_checkpoint(donor) == source  # the donor keeps its own
    shutil.rmtree(source)
    assert newest_checkpoint(member) == adopted  # a copy, not a link


def test_a_process_is_told_by_its_pid_and_start_time():
    me = owner()
    assert me["pid"] == os.getpid() and me["host"]
    assert process_alive(me["pid"], me["started"])
    assert not process_alive(me["pid"], me["started"] - 5)  # a reused pid: not that process
