"""Test-only fault injection: real SIGKILLs at exact points of a run, chosen by RINGFEED_FAULT.

    RINGFEED_FAULT=kill-at-step:<step>[:<rank>|:host=<name>]
        SIGKILL the process of that rank (0 unless given), or the one on that Horovod host
        (HOROVOD_HOSTNAME; elastic jobs renumber ranks), when optimizer step <step> starts,
        before its allreduce: the other ranks are left waiting in it.
    RINGFEED_FAULT=kill-in-checkpoint-write:<step>[:<bytes>]
        SIGKILL the writer of ckpt-<step> (rank 0) inside the write: once <bytes> bytes of the
        checkpoint's files are on disk (default 0), or just before the rename that publishes
        it if the files are smaller. Bytes are counted in files written through
        train/checkpoint/files.py open_for_write (torch's payload, meta.json); TensorFlow writes its
        payload itself, so there the count starts at meta.json. For a checkpoint.dir in object
        storage the bytes uploaded count too (staged first, then uploaded), and "just before
        the rename" is just before meta.json's upload, which publishes it. With
        checkpoint.async the writer is rank 0's background thread: the whole process dies.

    RINGFEED_SLOW_RANK=<rank>:<seconds>
        that rank sleeps <seconds> before every optimizer step: a straggler (not a kill).
    RINGFEED_FAULT=sigterm-in-checkpoint-write:<step>
        SIGTERM to the writer's own process as the write of ckpt-<step> starts, and the write
        held for 1 s after it: with checkpoint.async the signal's save meets that write still
        in flight.

The plan is read once, by the entry point (`ringfeed train`: `FaultPlan.from_env`), and handed
to what it hooks: the loop (`before_step`) and the checkpoint writer (`checkpoint_write`, whose
`WriteBudget` counts the write's bytes). Unset (always, outside tests) every hook is a no-op. The
kill is a real SIGKILL: no handler, no `finally`, no flush runs, exactly like the OOM killer or a
lost node.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import IO, Any

from ringfeed.errors import UserError

ENV = "RINGFEED_FAULT"
SLOW_ENV = "RINGFEED_SLOW_RANK"
HOST_ENV = "HOROVOD_HOSTNAME"  # set by horovodrun for each process it starts


@dataclass(frozen=True)
class Fault:
    kind: str  # "kill-at-step" | "kill-in-checkpoint-write" | "sigterm-in-checkpoint-write"
    step: int
    arg: int = 0  # the rank for kill-at-step, the byte budget for kill-in-checkpoint-write
    host: str | None = None  # kill-at-step on this host instead of a rank


def parse(text: str | None) -> Fault | None:
    if not text:
        return None
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    host = None
    if kind == "kill-at-step" and len(parts) == 2 and parts[1].startswith("host="):
        host = parts.pop()[len("host="):]
    if kind not in ("kill-at-step", "kill-in-checkpoint-write", "sigterm-in-checkpoint-write") \
            or not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise UserError(f"{ENV}={text!r}: expected kill-at-step:<step>[:<rank>|:host=<name>], "
                        "kill-in-checkpoint-write:<step>[:<bytes>] or "
                        "sigterm-in-checkpoint-write:<step>")
    return Fault(kind, int(parts[0]), int(parts[1]) if len(parts) == 2 else 0, host)


def parse_slow(text: str | None) -> tuple[int, float] | None:
    """RINGFEED_SLOW_RANK's (rank, seconds per step), or None when unset."""
    if not text:
        return None
    rank, _, seconds = text.partition(":")
    try:
        return int(rank), float(seconds)
    except ValueError:
        raise UserError(f"{SLOW_ENV}={text!r}: expected <rank>:<seconds>") from None


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class WriteBudget:
    """The bytes the checkpoint being written may still put on disk or upload before the
    process is SIGKILLed (kill-in-checkpoint-write)."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def uploaded(self, nbytes: int) -> None:
        """`nbytes` more of the checkpoint reached object storage: the budget running out
        SIGKILLs the process (the objects uploaded so far stay, meta.json is not among them)."""
        if nbytes >= self.left:
            kill_self()
        self.left -= nbytes

    def write(self, file: IO[bytes], data: Any) -> int:
        """`file.write(data)`, except that the budget running out writes the part that fits,
        makes it durable and SIGKILLs the process."""
        view = memoryview(data).cast("B")
        if len(view) >= self.left:
            file.write(view[:self.left])
            file.flush()
            os.fsync(file.fileno())
            kill_self()
        self.left -= len(view)
        return file.write(data)


# The budget of the checkpoint write this thread is inside (None: no write armed). A backend
# writes its payload through checkpoint/files.py's open_for_write without knowing of faults: the
# budget reaches it through the write's own context, set and reset by `checkpoint_write` (and
# handed explicitly to the upload, whose callbacks run on fsspec's thread).
_armed: ContextVar[WriteBudget | None] = ContextVar("ringfeed_write_budget", default=None)


def armed_budget() -> WriteBudget | None:
    """The byte budget of the checkpoint write this thread is inside, if one is armed."""
    return _armed.get()


@dataclass(frozen=True)
class FaultPlan:
    """The faults to inject into this process: RINGFEED_FAULT's, RINGFEED_SLOW_RANK's, and the
    Horovod host it runs on. `FaultPlan()` (NO_FAULTS) injects none."""

    fault: Fault | None = None
    slow: tuple[int, float] | None = None  # (rank, seconds it sleeps before every step)
    host: str | None = None  # this process's HOROVOD_HOSTNAME

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultPlan:
        """The plan the environment asks for; a malformed value is one UserError line."""
        return cls(parse(environ.get(ENV)), parse_slow(environ.get(SLOW_ENV)),
                   environ.get(HOST_ENV))

    def before_step(self, step: int, rank: int) -> None:
        """Called as optimizer step `step` (1-based) starts."""
        if self.slow is not None and self.slow[0] == rank:
            time.sleep(self.slow[1])
        fault = self.fault
        if fault and fault.kind == "kill-at-step" and fault.step == step:
            if self.host == fault.host if fault.host else fault.arg == rank:
                kill_self()

    @contextmanager
    def checkpoint_write(self, step: int) -> Iterator[WriteBudget | None]:
        """Around the write of ckpt-`step`: arms the byte budget (yielded, and the write's
        `armed_budget()`); the block ends just before the rename, where a budget larger than
        the files kills."""
        fault = self.fault
        if fault is not None and fault.kind == "sigterm-in-checkpoint-write" \
                and fault.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        budget = (WriteBudget(fault.arg) if fault is not None
                  and fault.kind == "kill-in-checkpoint-write" and fault.step == step else None)
        token = _armed.set(budget)
        try:
            yield budget
        finally:
            _armed.reset(token)
        if budget is not None:
            kill_self()


NO_FAULTS = FaultPlan()
