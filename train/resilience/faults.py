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

Unset (always, outside tests) every hook is a no-op. The kill is a real SIGKILL: no handler,
no `finally`, no flush runs, exactly like the OOM killer or a lost node.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from ringfeed.errors import UserError

ENV = "RINGFEED_FAULT"


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


ACTIVE = parse(os.environ.get(ENV))
SLOW_ENV = "RINGFEED_SLOW_RANK"


def parse_slow(text: str | None) -> tuple[int, float] | None:
    """RINGFEED_SLOW_RANK's (rank, seconds per step), or None when unset."""
    if not text:
        return None
    rank, _, seconds = text.partition(":")
    try:
        return int(rank), float(seconds)
    except ValueError:
        raise UserError(f"{SLOW_ENV}={text!r}: expected <rank>:<seconds>") from None


SLOW = parse_slow(os.environ.get(SLOW_ENV))


def arm(text: str | None) -> None:
    """Set the fault after import (a forked test child that changed RINGFEED_FAULT)."""
    global ACTIVE
    ACTIVE = parse(text)

_write_budget: list[int] = []  # bytes left before the kill, while a doomed checkpoint is written


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def before_step(step: int, rank: int) -> None:
    """Called as optimizer step `step` (1-based) starts."""
    if SLOW is not None and SLOW[0] == rank:
        time.sleep(SLOW[1])
    if ACTIVE and ACTIVE.kind == "kill-at-step" and ACTIVE.step == step:
        if (os.environ.get("HOROVOD_HOSTNAME") == ACTIVE.host if ACTIVE.host
                else ACTIVE.arg == rank):
            kill_self()


@contextmanager
def checkpoint_write(step: int):
    """Around the write of ckpt-`step`: arms the byte budget; the block ends just before the
    rename, where a budget larger than the files kills."""
    if ACTIVE is not None and ACTIVE.kind == "sigterm-in-checkpoint-write" \
            and ACTIVE.step == step:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    armed = ACTIVE is not None and ACTIVE.kind == "kill-in-checkpoint-write" \
        and ACTIVE.step == step
    if armed:
        _write_budget.append(ACTIVE.arg)
    try:
        yield
    finally:
        if armed:
            _write_budget.clear()
    if armed:
        kill_self()


def uploaded(nbytes: int) -> None:
    """`nbytes` more of the checkpoint reached object storage: an armed byte budget running
    out SIGKILLs the process (the objects uploaded so far stay, meta.json is not among them)."""
    if _write_budget:
        if nbytes >= _write_budget[0]:
            kill_self()
        _write_budget[0] -= nbytes


def write(file: IO[bytes], data: Any) -> int:
    """`file.write(data)`, except that an armed byte budget running out writes the part that
    fits, makes it durable and SIGKILLs the process."""
    if _write_budget:
        view = memoryview(data).cast("B")
        if len(view) >= _write_budget[0]:
            file.write(view[:_write_budget[0]])
            file.flush()
            os.fsync(file.fileno())
            kill_self()
        _write_budget[0] -= len(view)
    return file.write(data)
