"""The files rank 0 appends to under output.dir (train/observe/runfiles.py): whole records only
(a record the file system refuses is cut off again, what came before untouched), exit 4 naming
the file, and TensorBoard's event file readable by TensorBoard."""

from __future__ import annotations

import contextlib
import resource
import signal
from pathlib import Path

import pytest

from ringfeed.errors import EXIT_WRITE
from ringfeed.train.observe.runfiles import (
    AppendFile,
    EventWriter,
    output_dir_error,
    output_write_error,
)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Files of this process cannot grow past `limit` bytes (RLIMIT_FSIZE: a write past it
    fails with EFBIG, as on a full disk or quota), SIGXFSZ ignored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_records_are_appended_whole(tmp_path):
    f = AppendFile(tmp_path / "metrics.jsonl")
    f.append(b'{"step": 1}\n')
    f.append(b'{"step": 2}\n')
    f.close()
    f.close()  # twice: nothing left to do
    AppendFile(tmp_path / "metrics.jsonl").append(b'{"step": 3}\n')  # appends, not truncates
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def test_a_record_the_file_system_refuses_is_cut_off_and_stops_the_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = AppendFile(path)
    f.append(b"a" * 3000 + b"\n")
    with file_size_limit(4096):
        with pytest.raises(Exception) as exc:
            f.append(b"b" * 2000 + b"\n")  # 1095 bytes would fit: the write is partial
    assert path.read_bytes() == b"a" * 3000 + b"\n"  # whole records only
    error = exc.value
    assert error.exit_code == EXIT_WRITE
    assert str(error).startswith(f"output.dir: cannot write {path} (File too large; free space")
    assert "resume with --resume auto" in str(error)


def test_output_dir_errors_are_exit_4_naming_the_directory():
    e = output_dir_error(Path("/runs/x"), NotADirectoryError(20, "Not a directory"))
    assert e.exit_code == EXIT_WRITE
    assert str(e) == ("output.dir /runs/x: cannot write the run's files there (Not a directory; "
                      "choose a writable directory)")
    assert "No space left" in str(output_write_error(Path("/r/m"), OSError(28, "No space left "
                                                                          "on device")))


def read_events(path: Path) -> list:
    """The events of a TensorBoard event file, through TensorBoard's own record reader (the
    one it uses without TensorFlow: every record's length and crc32c checked)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    reader, events = PyRecordReader_New(str(path)), []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return events
        events.append(event_pb2.Event.FromString(reader.record()))


def test_tensorboard_reads_the_scalars_of_the_event_file(tmp_path):
    w = EventWriter(tmp_path / "tb")
    w.scalars(5, {"loss": 0.25, "lr": 0.1})
    w.scalars(10, {"loss": 0.125})
    w.close()
    [path] = (tmp_path / "tb").iterdir()
    assert path.name.startswith("events.out.tfevents.") and path.name.endswith(".ringfeed")
    events = read_events(path)
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert scalars == [(5, "loss", 0.25), (5, "lr", pytest.approx(0.1)), (10, "loss", 0.125)]
