"""The end of a `ringfeed train` process is bounded: what runs after the run has returned
(Horovod's shutdown, loader workers joined by multiprocessing, trackers' and the user's own exit
handlers, the interpreter's finalisation) gets `train.hang_timeout_s`; past it, this rank writes
the stacks of every thread to `<output.dir>/hang/rank-<r>-exit.stacks`, prints one line and
leaves with exit 76 (restartable: the run's files were written before; `ringfeed run`'s relaunch
resumes at the last step and ends at once). A job that finished its steps never holds its nodes
until the allocation ends.

Two timers, both started as the interpreter begins to exit (the first exit handler to run, being
registered after the others, by `bound_exit`): a Python thread that names the hang, and
faulthandler's C thread, `BACKSTOP_S` later, for a finalisation stuck where Python threads no
longer run (it writes the stacks on stderr and exits 1).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from ringfeed.errors import EXIT_HANG
from ringfeed.train.resilience.watchdog import HANG_LINE

BACKSTOP_S = 30.0


def stacks_path(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / "hang" / f"rank-{rank}-exit.stacks"


def bound_exit(limit_s: float, output_dir: str | Path, rank: int) -> None:
    """Bound this process's exit to `limit_s` seconds from when it begins: one exit handler,
    registered last (so it runs first), replacing any an earlier run in this process left."""
    atexit.unregister(_start_timers)
    atexit.register(_start_timers, limit_s, str(stacks_path(output_dir, rank)), rank)


def _start_timers(limit_s: float, path: str, rank: int) -> None:
    threading.Thread(target=_expire, args=(limit_s, path, rank), daemon=True,
                     name="ringfeed-exit-bound").start()
    with contextlib.suppress(ValueError, OSError, AttributeError):  # (no usable stderr)
        faulthandler.dump_traceback_later(limit_s + BACKSTOP_S, exit=True, file=sys.__stderr__)


def _expire(limit_s: float, path: str, rank: int) -> None:
    time.sleep(limit_s)  # (a daemon thread: the process's end stops it)
    where = _main_thread_place()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        stacks = f"its stacks are in {path}"
    except OSError as e:
        stacks = f"its stacks could not be written ({e.strerror or e})"
    line = (f"{HANG_LINE} rank {rank} did not end within {limit_s:g} s after its run returned "
            f"(train.hang_timeout_s), stuck in {where}; {stacks}; what the run wrote is kept, "
            "and a relaunch resumes from its last checkpoint\n")
    os.write(2, line.encode())
    os._exit(EXIT_HANG)


def _main_thread_place() -> str:
    """The main thread's innermost frame, as 'function (file:line)'."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "the interpreter's finalisation"
    last = traceback.extract_stack(frame)[-1]
    return f"{last.name} ({last.filename}:{last.lineno})"
