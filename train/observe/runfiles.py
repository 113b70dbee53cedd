"""The run's files under output.dir: their names (one declaration each, for the trainer that
writes them and for replay and tune, which read them back), the files rank 0 appends to during a
run (metrics.jsonl, samples.jsonl, TensorBoard's event file), written whole record by whole
record, and the exit-4 errors that name output.dir or the file when the file system refuses."""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path
from typing import IO

from ringfeed.errors import EXIT_WRITE, UserError

METRICS_FILE = "metrics.jsonl"  # a record per log step, validation and event
SAMPLES_FILE = "samples.jsonl"  # output.sample_log: the sample ids of every step
SUMMARY_FILE = "summary.json"  # written at the end
CONFIG_FILE = "config.yaml"  # the resolved config the run was started with
CHECKPOINTS_DIR = "checkpoints"  # checkpoint.dir unless the config names one


def checkpoint_dir(output_dir: str | os.PathLike, configured: str | None = None) -> str:
    """A run's checkpoint.dir: the `configured` one (a path or URL), else
    <output_dir>/checkpoints."""
    return configured or str(Path(output_dir) / CHECKPOINTS_DIR)


def output_dir_error(out_dir: Path, error: OSError) -> UserError:
    """output.dir cannot take the run's files (a file in the way, no permission, no space): no
    relaunch fixes that, so exit 4 like a checkpoint that cannot be written."""
    reason = error.strerror or str(error)
    return UserError(f"output.dir {out_dir}: cannot write the run's files there ({reason}; "
                     "choose a writable directory)", exit_code=EXIT_WRITE)


def output_write_error(path: Path, error: OSError) -> UserError:
    """A file under output.dir could not be written during the run (the disk filled): exit 4,
    naming the file; what the run wrote before (logs, checkpoints) is kept for a resume."""
    reason = error.strerror or str(error)
    return UserError(f"output.dir: cannot write {path} ({reason}; free space there or choose "
                     "another output.dir, then resume with --resume auto: what was written "
                     "before is kept)", exit_code=EXIT_WRITE)



class AppendFile:
    """A file under output.dir that whole records are appended to, unbuffered. A record that
    cannot be written (disk full, quota, read-only) is cut off again, so the file holds whole
    records only and nothing written before is touched, and the run stops with the exit-4
    error naming the file (a relaunch would fill the disk the same way)."""

    def __init__(self, path: Path):
        self.path = path
        self._file: IO[bytes] | None = open(path, "ab", buffering=0)  # noqa: SIM115 - close()

    def append(self, data: bytes) -> None:
        assert self._file is not None
        before = os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(data)
            while view:  # (a raw write may take part of it and fail on the rest)
                view = view[self._file.write(view):]
        except OSError as e:
            try:
                os.truncate(self.path, before)
            except OSError:
                pass  # the record's start may stay; the error below names the file
            raise output_write_error(self.path, e) from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()  # (unbuffered: nothing left to write, so nothing to fail)
            self._file = None


class EventWriter:
    """Appends scalar summaries to a TensorBoard event file (tensorboard's RecordWriter), one
    whole record at a time."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.ringfeed"
        self._file = AppendFile(logdir / name)
        self._record = io.BytesIO()  # one framed record, appended whole
        self._records = RecordWriter(self._record)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary_pb2.Summary(value=[
            self._summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
            for tag, v in values.items()
        ])
        self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())
        data = self._record.getvalue()
        self._record.seek(0)
        self._record.truncate()
        self._file.append(data)

    def close(self) -> None:
        self._file.close()
