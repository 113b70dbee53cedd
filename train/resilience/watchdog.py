"""The hang watchdog: a job in which no rank makes progress for `train.hang_timeout_s`, or a rank
is silent for `train.silent_timeout_s` (a lost host), ends with every live rank's Python stacks
on disk, one line naming the rank(s) that stopped, where, and on which host, and exit 76
(restartable: `ringfeed run` relaunches it with `--resume auto`).

Progress cannot be learned through Horovod when a rank is stuck (every collective waits for
it), so the watchdog talks over a side channel of its own: rank 0 hosts a small UDP hub, whose
addresses reach the other ranks with one broadcast at start; every rank's watchdog thread sends
it a heartbeat every `interval` seconds - (rank, steps done, phase, seconds since its position
last changed, host) - and reads the verdict (and rank 0's host) in the reply. UDP needs no
shared filesystem and works across hosts (and under Gloo, MPI or NCCL alike); a lost datagram
is only a missed beat.

The rule (`judge`), on rank 0's hub:
  - a rank's position is (steps done, phase), phases in loop order (PHASES); it progresses
    when its position changes;
  - the job is stalled when no rank's position changed for `limit` seconds, where `limit` is
    hang_timeout_s plus the allowance of where the rank(s) furthest behind are: start-up, the
    first step, validation, checkpoints and the end get `train.hang_grace_s` more (tracing,
    compiling, a long checkpoint write on rank 0 while the others wait), the data phase
    `data.retry_budget_s` more (a storage outage ends itself: the pipeline's exit 75);
  - a rank whose heartbeats stopped (a stopped process, a frozen host; a live process beats
    whatever its main thread does) gets no allowance: its silence is not work;
  - a lost rank is not a stall: heartbeats missing for longer than silent_timeout_s end the
    job at once, the silent ranks named, grouped by host (`gone_ranks`). Not while any rank
    is in LONG_CALL_PHASES (restore, checkpoint, end), where a live process may hold the GIL
    for long and its watchdog thread cannot beat: silence there waits hang_timeout_s. A rank
    whose watchdog stopped said goodbye (the end, or its own error on the way out) and is
    not judged by it; neither is the time the hub itself was frozen (`Hub._thaw`);
  - named: the silent ranks if any, else the ranks furthest behind (all of them when every
    rank is at the same place: a collective that never completes).
When the hub fires, each live rank gets the verdict with its next reply, writes its stacks
(faulthandler, every thread) to `<output.dir>/hang/rank-<r>.stacks` on its own host and
acknowledges; rank 0 waits for the live ranks' acknowledgements (a few intervals at most),
writes its own stacks and `hang/hang.json` (every rank's last position) and prints the one
line; then the others are told to go (the reply to their next heartbeat) and every live rank
leaves with os._exit(76) (a thread cannot raise into a stuck collective); the launcher kills
the stopped ones. No rank leaves before rank 0 has said everything: a launcher ends the whole
job as soon as one rank exits. After its stacks, a rank's stdout and stderr go to /dev/null
(the collectives failing as ranks leave would print tracebacks). If rank 0 is the one that
stopped, each live rank decides alone, by the same bound for its own phase (the ranks move in
step): the hub silent, no goodbye from it, and its own position unchanged for that long.
Gloo's receive timeout stays above both bounds (gloo_timeout_s), so the watchdog speaks first.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringfeed.errors import EXIT_HANG

HANG_LINE = "ringfeed: hang:"  # the one line; not the not-restartable `ringfeed: error:`

# Where a rank is, with the optimizer steps it has done, in loop order (train/loop.py sets them):
# after step s it reports, validates, checkpoints, then waits for the data of step s + 1 and
# takes it.
PHASES = ("start", "report", "validate", "checkpoint", "data", "step", "end")
BEFORE_STEP = frozenset({"start", "data", "step"})  # phases of the step after those done
GRACE_PHASES = frozenset({"start", "validate", "checkpoint", "end"})
# Phases in which a live process may hold the GIL for long, so its watchdog thread cannot beat:
# restore pickles the optimizer state for its broadcast, a checkpoint write may go through
# h5py or pickle, the end writes the last one (pickle.dumps of 512 MB held it 0.4 s on 2 cores,
# str.join of 5M items 0.7 s). Measured not to hold it: torch ops, torch.save/load, TF steps,
# the first step under torch.compile (max gap 0.3 s in 17 s), allreduces, data waits.
# A rank silent while any rank is in one of these waits hang_timeout_s, not silent_timeout_s.
LONG_CALL_PHASES = frozenset({"start", "checkpoint", "end"})
PHASE_WORDS = {"start": "starting (restore, planning)", "data": "waiting for data",
               "step": "in the step (forward, backward, allreduce)",
               "report": "reporting (log gather)", "validate": "validating",
               "checkpoint": "checkpointing", "end": "finishing (last validation, checkpoint)"}
# A rank silent for this many heartbeat intervals is reported as stopped.
SILENT_BEATS = 3
GLOO_MARGIN_S = 60  # Gloo's receive timeout = hang_timeout_s + this: the watchdog speaks first


@dataclass(frozen=True)
class Limits:
    """How long the job may go without progress (seconds)."""

    timeout: float  # train.hang_timeout_s
    grace: float = 0.0  # train.hang_grace_s: start-up, first step, validation, checkpoints, end
    data: float = 0.0  # data.retry_budget_s: a storage outage ends itself (exit 75)
    silent: float | None = None  # train.silent_timeout_s; None: silence waits `timeout` too

    def silence(self, phases: set[str]) -> float:
        """How long heartbeats may be missing while the job is in `phases` (the silent
        rank's last one and the others'): silent_timeout_s, or hang_timeout_s where a live
        process may hold the GIL for long (LONG_CALL_PHASES)."""
        if self.silent is None or phases & LONG_CALL_PHASES:
            return self.timeout
        return min(self.silent, self.timeout)

    @property
    def shortest(self) -> float:
        """The shorter of the two bounds: the heartbeat interval is a tenth of it."""
        return min(self.timeout, self.silent or self.timeout)

    def allowed(self, phase: str, step: int, first_step: int, silent: bool) -> float:
        """The stall allowed while a (the) rank furthest behind is at (step, phase)."""
        if silent:
            return self.timeout
        if phase in GRACE_PHASES or (step == first_step and phase in ("data", "step")):
            return self.timeout + self.grace
        if phase == "data":
            return self.timeout + self.data
        return self.timeout


@dataclass
class Seen:
    """The hub's record of one rank, in the hub's monotonic clock."""

    heard_at: float  # the last heartbeat's arrival
    step: int = 0
    phase: str = "start"
    moved_at: float = 0.0  # when its position last changed
    dumped: bool = False  # it wrote its stacks after a verdict
    heard: bool = True  # False until its first heartbeat: where it is is not known
    host: str = ""  # its host (heartbeats carry it), named when it falls silent
    left: bool = False  # it said goodbye (its watchdog stopped): its silence is not judged
    peer: tuple[str, int] | None = None  # where its heartbeats come from (the hub's goodbye)

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)


@dataclass(frozen=True)
class Verdict:
    """A hang: the ranks named, the stall, and the one line."""

    named: tuple[int, ...]
    silent: tuple[int, ...]
    stalled_s: float
    line: str


def judge(now: float, seen: dict[int, Seen], limits: Limits, first_step: int,
          beat_s: float, out_dir: str) -> Verdict | None:
    """The hub's rule (module docstring): a Verdict when the job is hung, else None. A rank
    never heard from (its heartbeats cannot reach the hub) is left out: nothing is known of
    it."""
    heard = {r: s for r, s in seen.items() if s.heard}
    if not heard:
        return None
    stalled = now - max(s.moved_at for s in heard.values())
    silent = tuple(r for r, s in sorted(heard.items())
                   if now - s.heard_at > SILENT_BEATS * beat_s)
    gone = gone_ranks(now, heard, silent, limits)
    if gone:  # a lost rank or host: its silence says so long before a stall would
        named = silent = gone
        why = f"heartbeats missing for longer than train.silent_timeout_s ({limits.silent:g} s)"
    else:
        if silent:
            named = silent
        else:
            lowest = min(s.position for s in heard.values())
            named = tuple(r for r, s in sorted(heard.items()) if s.position == lowest)
        allowed = min(limits.allowed(seen[r].phase, seen[r].step, first_step, r in silent)
                      for r in named)
        if stalled <= allowed:
            return None
        why = f"no rank progressed for {stalled:.0f} s (train.hang_timeout_s {limits.timeout:g})"
    line = hang_line(now, heard, named, silent, why, out_dir)
    unheard = sorted(set(seen) - set(heard))
    if unheard:
        line += f" (rank(s) {ranges(unheard)} never reached the hub: not judged)"
    return Verdict(named, silent, stalled, line)


def gone_ranks(now: float, heard: dict[int, Seen], silent: tuple[int, ...],
               limits: Limits) -> tuple[int, ...]:
    """The silent ranks (not those that said goodbye) whose heartbeats have been missing for
    longer than `limits.silence` allows where the job is (every heard rank's phase)."""
    bound = limits.silence({s.phase for s in heard.values()})
    if bound >= limits.timeout:  # the stall rule names them, as it always did
        return ()
    return tuple(r for r in silent if not heard[r].left and now - heard[r].heard_at > bound)


def hang_line(now: float, seen: dict[int, Seen], named: tuple[int, ...],
              silent: tuple[int, ...], why: str, out_dir: str) -> str:
    """`ringfeed: hang: <who, where>; <why>; ...; exit 76 (restartable)` on one line. Silent
    ranks are grouped by host and last place: a lost host is one phrase."""
    def where(r: int) -> str:
        return place(seen[r].step, seen[r].phase)

    if silent:
        lost: dict[tuple[str, str], list[int]] = {}
        for r in silent:
            lost.setdefault((seen[r].host, where(r)), []).append(r)
        who = "; ".join(
            f"rank{'s' * (len(rs) > 1)} {ranges(rs)} stopped responding{on_host(host)} (no "
            f"heartbeat for {max(now - seen[r].heard_at for r in rs):.0f} s; last heard {at})"
            for (host, at), rs in lost.items())
    elif len(named) == len(seen) > 1:
        who = f"every rank is stuck {where(named[0])}"
    else:
        who = "; ".join(f"rank {r} is stuck {where(r)}" for r in named)
    live = [r for r in sorted(seen) if r not in silent]
    if silent and live:  # where the others wait tells where the silent ones are, too
        places: dict[str, list[int]] = {}
        for r in live:
            places.setdefault(where(r), []).append(r)
        who += "; the others wait: " + "; ".join(f"rank{'s' * (len(rs) > 1)} {ranges(rs)} {p}"
                                                 for p, rs in places.items())
    return (f"{HANG_LINE} {who}; {why}; Python stacks of rank(s) "
            f"{ranges(live) if live else 'none'} in {Path(out_dir) / 'hang'}/ (on each rank's "
            f"host); exit {EXIT_HANG} (restartable: ringfeed run relaunches with --resume auto)")


def on_host(host: str) -> str:
    """" on host <host>", or nothing when it is not known."""
    return f" on host {host}" if host else ""


def host_label() -> str:
    """This host as the line names it: its name, after the name the launcher gave it where
    that differs (horovodrun's -H; hosts in network namespaces share one name)."""
    name = socket.gethostname()
    given = os.environ.get("HOROVOD_HOSTNAME", "")
    if given and given != name and given != "localhost" and not given.startswith("127."):
        return f"{given} ({name})"
    return name


# train.silent_timeout_s when unset, if hang_timeout_s is longer (else silence waits that)
DEFAULT_SILENT_S = 15.0


def limits_for(cfg: Any) -> Limits | None:
    """The watchdog's limits for a RunConfig; None when it is off (train.hang_timeout_s null,
    or an elastic run: Horovod Elastic handles a lost worker, and its Gloo timeout is how it
    notices one)."""
    t = cfg.train
    if t.hang_timeout_s is None or cfg.elastic.enabled:
        return None
    silent = t.silent_timeout_s
    if silent is None and t.hang_timeout_s > DEFAULT_SILENT_S:
        silent = DEFAULT_SILENT_S
    return Limits(t.hang_timeout_s, t.hang_grace_s, float(cfg.data.retry_budget_s), silent)


def hang_timeout_s(cfg: Any) -> float | None:
    """train.hang_timeout_s where the watchdog runs for this RunConfig, else None."""
    limits = limits_for(cfg)
    return limits.timeout if limits is not None else None


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def place(step: int, phase: str) -> str:
    """Where a rank is, in words: "at step 8, waiting for data", "after step 7, checkpointing"."""
    return (f"{'at step ' + str(step + 1) if phase in BEFORE_STEP else 'after step ' + str(step)}"
            f", {PHASE_WORDS[phase]}")


def interval_for(timeout: float) -> float:
    """The heartbeat period: a tenth of the timeout, between 0.2 and 2 s (a silent rank's last
    known place is at most one period old)."""
    return min(2.0, max(0.2, timeout / 10))


def gloo_timeout_s(timeout: float) -> int:
    """HOROVOD_GLOO_TIMEOUT_SECONDS for a watchdog of `timeout`: long enough that the watchdog
    (hang_timeout_s, then a few heartbeats to collect the stacks) ends a stopped rank's job
    first, with its line, instead of Gloo's receive timeout with tracebacks."""
    return int(math.ceil(timeout + GLOO_MARGIN_S))


def candidate_hosts() -> list[str]:
    """The addresses other ranks may reach this host at: the name the launcher gave it
    (HOROVOD_HOSTNAME, horovodrun's -H), its interfaces' IPv4 addresses, and the loopback last
    (no name is looked up here: a slow resolver would hold up rank 0's start)."""
    hosts: list[str] = []
    name = os.environ.get("HOROVOD_HOSTNAME")
    if name and name != "localhost" and not name.startswith("127."):
        hosts.append(name)
    with contextlib.suppress(ImportError):
        import psutil

        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family == socket.AF_INET and not a.address.startswith("127.") \
                        and a.address not in hosts:
                    hosts.append(a.address)
    return [*hosts, "127.0.0.1"]


@dataclass
class Position:
    """A rank's place, written by the loop, read by its watchdog thread (tuple assignments:
    no lock needed)."""

    step: int = 0
    phase: str = "start"
    moved_at: float = field(default_factory=time.monotonic)


class Watchdog:
    """One rank's watchdog (and, on rank 0, the hub). The loop calls `at(step, phase)` as it
    moves and `begin_training(step)` when training (re)starts; `start(broadcast)` is collective
    (the hub's addresses), `stop()` ends it quietly. Constructing it does no I/O."""

    def __init__(self, rank: int, size: int, limits: Limits, out_dir: str | Path,
                 say: Callable[[str], None] | None = None):
        self.rank, self.size, self.limits = rank, size, limits
        self.out_dir = str(out_dir)
        self.beat_s = interval_for(limits.shortest)
        self.say = say or say_on_stderr
        self.host = ""  # this host as the line names it (host_label(), at start)
        self.pos = Position()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sock: socket.socket | None = None  # this rank's socket to the hub
        self._hub_address: tuple[str, int] | None = None  # the hub's address
        self._hub_host = ""  # rank 0's host, from the hub's replies
        self._hub_left = False  # the hub said goodbye: its silence is not judged
        self.hub: Hub | None = None  # rank 0: the hub itself
        self.fired = False  # this rank acted on a verdict: its stacks are written
        # (tests replace these two: they leave the test process as it is)
        self.exit: Callable[[int], None] = os._exit
        self.silence: Callable[[], None] = silence_output

    # -- the loop's side ------------------------------------------------------------------
    def at(self, step: int, phase: str) -> None:
        """This rank is now at `phase` after `step` optimizer steps."""
        pos = self.pos
        if pos.step != step or pos.phase != phase:
            pos.moved_at = time.monotonic()
            pos.step, pos.phase = step, phase

    def begin_training(self, step: int) -> None:
        """Training (re)starts after `step` optimizer steps: its first step (tracing,
        compiling) gets train.hang_grace_s (rank 0's hub judges; the same on every rank)."""
        if self.hub is not None:
            self.hub.first_step = step

    def start(self, broadcast: Callable[[Any], Any], first_step: int = 0) -> None:
        """Collective: rank 0 opens the hub and broadcasts its addresses; every rank starts
        its heartbeat thread. `first_step`: the steps done when training (re)starts."""
        self.at(first_step, "start")
        self.host = host_label()
        addresses = None
        if self.rank == 0:
            self.hub = Hub(self.size, self.limits, self.beat_s, self.out_dir, self._stop,
                           report=self._report, exit=lambda code: self.exit(code))
            self.hub.host = self.host
            addresses = self.hub.open(first_step)
            self._spawn(self.hub.serve, "ringfeed-watchdog-hub")
        addresses = [tuple(a) for a in broadcast(addresses)]
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.settimeout(min(0.5, self.beat_s))
        self._spawn(lambda: self._beat(addresses), "ringfeed-watchdog")

    def stop(self) -> None:
        """End the threads and close the sockets (idempotent). On a rank that has acted on a
        verdict (the main thread's collective failed as the other ranks left), exit 76."""
        if self.fired:
            self.exit(EXIT_HANG)
        # goodbyes first: a rank that leaves on its own (the end, an error it reports) is not
        # a lost one, however long it takes to exit
        if self._sock is not None and self._hub_address is not None and not self._stop.is_set():
            with contextlib.suppress(OSError):
                self._sock.sendto(json.dumps({"r": self.rank, "bye": 1}).encode(),
                                  self._hub_address)
        if self.hub is not None and not self._stop.is_set():
            self.hub.goodbye()
        self._stop.set()
        hub_sock = self.hub.sock if self.hub is not None else None
        for s in (self._sock, hub_sock):  # wake the threads out of their recvfrom
            if s is not None:
                with contextlib.suppress(OSError):
                    s.sendto(b"{}", ("127.0.0.1", s.getsockname()[1]))
        for t in self._threads:
            t.join(timeout=1.0)
        self._threads = []
        for s in (self._sock, hub_sock):
            if s is not None:
                s.close()
        self._sock = None
        if self.hub is not None:
            self.hub.sock = None

    # -- heartbeats -----------------------------------------------------------------------
    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _reach(self, addresses: list[tuple[str, int]]) -> tuple[str, int] | None:
        """The hub, found by saying hello at each of its addresses in turn (names resolved
        here, in this thread) until one answers: the address the answer came from. Said once
        on stderr when a whole round got no answer; None when stopped first."""
        assert self._sock is not None
        warned = False
        while not self._stop.is_set():
            for address in addresses:
                with contextlib.suppress(OSError, ValueError):
                    self._sock.sendto(b'{"hello": 1}', address)
                    data, peer = self._sock.recvfrom(4096)
                    if "v" in json.loads(data):
                        self._sock.settimeout(self.beat_s)
                        return peer
            if not warned:
                warned = True
                say_on_stderr(f"ringfeed: watchdog: rank {self.rank} cannot reach rank 0's "
                              f"heartbeat hub over UDP at {addresses}; it goes on trying (its "
                              "hangs are seen as silence)")
            self._stop.wait(self.beat_s)
        return None

    def _message(self, dumped: bool) -> bytes:
        pos = self.pos
        return json.dumps({"r": self.rank, "s": pos.step, "p": pos.phase, "h": self.host,
                           "age": time.monotonic() - pos.moved_at, "d": dumped}).encode()

    def _beat(self, addresses: list[tuple[str, int]]) -> None:
        """Every beat_s: tell the hub where this rank is; act on its verdict. Without replies
        from the hub while this rank is stuck too, decide alone (`_hub_lost`)."""
        self._hub_address = self._reach(addresses)
        if self._hub_address is None:
            return
        replied_at = last = time.monotonic()
        dumped = False
        while not self._stop.is_set():
            sent = time.monotonic()
            if sent - last > SILENT_BEATS * self.beat_s:
                # this process was frozen itself (SIGSTOP, then SIGCONT as a launcher ends
                # the job; a call that held the GIL): the hub's silence then says nothing
                replied_at = sent
            last = sent
            reply = self._exchange(dumped, sent)
            now = time.monotonic()
            if reply is not None:
                replied_at = now
                answered = self._answer(reply, dumped)
                if answered is None:  # told to go
                    return
                dumped = answered
            elif self._hub_lost(now - replied_at, dumped, now):
                return
            self._stop.wait(max(0.0, self.beat_s - (time.monotonic() - sent)))

    def _exchange(self, dumped: bool, sent: float) -> dict[str, Any] | None:
        """One heartbeat sent and the hub's reply to it (None: none within a beat). A
        goodbye from the hub (it stopped: the run ended or rank 0 reports its own error)
        is noted, not a reply."""
        assert self._sock is not None and self._hub_address is not None
        with contextlib.suppress(OSError, ValueError):
            self._sock.sendto(self._message(dumped), self._hub_address)
            while time.monotonic() - sent < self.beat_s and not self._stop.is_set():
                data, _ = self._sock.recvfrom(65536)
                reply = json.loads(data)
                if "bye" in reply:
                    self._hub_left = True
                elif "v" in reply:
                    return reply
        return None

    def _answer(self, reply: dict[str, Any], dumped: bool) -> bool | None:
        """Act on the hub's reply: whether this rank's stacks are written now; None when
        it was told to go (it has left)."""
        self._hub_host = str(reply.get("h", self._hub_host))
        if self.rank == 0:  # the hub writes rank 0's stacks and takes it out
            return reply["v"] is not None
        if reply.get("go"):  # rank 0 has written and said everything
            self.exit(EXIT_HANG)
            return None
        if reply["v"] is not None and not dumped:
            self.dump_stacks(reply["v"])
            self.fired = True
            self.silence()
            return True
        return dumped

    def _hub_lost(self, silent_s: float, dumped: bool, now: float) -> bool:
        """No reply from rank 0's hub for `silent_s`: past the bound of where this rank is
        (Limits.silence of its phase; the ranks move in step, so rank 0 is in the same
        phase) while this rank is stuck too, rank 0 is lost: decide alone. True when this
        rank acted (it leaves)."""
        if self.rank == 0 or self._hub_left:
            return False
        pos = self.pos
        bound = self.limits.silence({pos.phase})
        if silent_s <= bound or not (dumped or now - pos.moved_at > bound):
            return False
        if dumped:  # the hub left without a word: so does this rank
            self.exit(EXIT_HANG)
        else:
            self._alone(silent_s, bound)
        return True

    def _alone(self, silent_s: float, bound: float) -> None:
        """Rank 0's hub went silent and this rank is stuck too: rank 0 stopped."""
        pos = self.pos
        why = (f"heartbeats missing for longer than train.silent_timeout_s ({bound:g} s)"
               if bound < self.limits.timeout else
               f"no progress for train.hang_timeout_s ({bound:g} s)")
        line = (f"{HANG_LINE} rank 0 stopped responding{on_host(self._hub_host)} (no heartbeat "
                f"reply for {silent_s:.0f} s; seen by rank {self.rank}, itself stuck "
                f"{place(pos.step, pos.phase)}); {why}; Python stacks in "
                f"{Path(self.out_dir) / 'hang'}/ (on each rank's host); exit {EXIT_HANG} "
                "(restartable: ringfeed run relaunches with --resume auto)")
        self.dump_stacks(line)
        self.fired = True
        self.say(line)
        self.silence()
        # the other live ranks see the same silence within a beat: leaving before they have
        # acted would fail their collectives first
        self._stop.wait(SILENT_BEATS * self.beat_s)
        self.exit(EXIT_HANG)

    def _report(self, line: str, record: dict[str, Any]) -> None:
        """Rank 0's part once the hub has a verdict: its stacks, hang.json (`record`), the
        line; then its output is silenced."""
        self.dump_stacks(line)
        self.fired = True
        with contextlib.suppress(OSError):
            from ringfeed.fsutil import atomic_write_text

            atomic_write_text(Path(self.out_dir) / "hang" / "hang.json",
                              json.dumps(record, indent=2) + "\n")
        self.say(line)
        self.silence()

    # -- leaving --------------------------------------------------------------------------
    def dump_stacks(self, why: str) -> Path | None:
        """This process's stacks into hang/rank-<r>.stacks (`write_stacks`)."""
        return write_stacks(Path(self.out_dir) / "hang", self.rank, self.size, self.pos, why)


def write_stacks(directory: Path, rank: int, size: int, pos: Position, why: str) -> Path | None:
    """Every thread's Python stack of this process into <directory>/rank-<r>.stacks (written
    beside, then renamed); None when the directory cannot be written."""
    path = directory / f"rank-{rank}.stacks"
    tmp = directory / f".rank-{rank}.stacks.tmp-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(f"rank {rank} of {size}, host {socket.gethostname()}, pid {os.getpid()}, "
                    f"{place(pos.step, pos.phase)}, no progress for "
                    f"{time.monotonic() - pos.moved_at:.1f} s\n{why}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path
    except OSError:
        return None


class Hub:
    """Rank 0's heartbeat hub (the module docstring): every rank's last heartbeat, answered
    with the verdict, judged every beat (`judge`); after a verdict, once the live ranks have
    written their stacks, rank 0's part (`report`: its stacks, hang.json, the line), then every
    live rank is told to go and rank 0 leaves (`exit`)."""

    def __init__(self, size: int, limits: Limits, beat_s: float, out_dir: str,
                 stop: threading.Event, report: Callable[[str, dict[str, Any]], None],
                 exit: Callable[[int], None]):
        self.size, self.limits, self.beat_s, self.out_dir = size, limits, beat_s, out_dir
        self._stop, self.report, self.exit = stop, report, exit
        self.first_step = 0  # where training (re)started: its first step gets the grace
        self.host = ""  # rank 0's host, in every reply (the others name it if it is lost)
        self.sock: socket.socket | None = None
        self.seen: dict[int, Seen] = {}
        self.verdict: Verdict | None = None

    def open(self, first_step: int) -> list[tuple[str, int]]:
        """The hub's socket bound (any port) with every rank not yet heard from at
        `first_step`: the addresses the other ranks may reach it at."""
        self.first_step = first_step
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.settimeout(self.beat_s)
        port = self.sock.getsockname()[1]
        now = time.monotonic()
        self.seen = {r: Seen(heard_at=now, step=first_step, moved_at=now, heard=False)
                     for r in range(self.size)}
        return [(h, port) for h in candidate_hosts()]

    def serve(self) -> None:
        """Record heartbeats, answer each with the verdict (None while the job moves), and
        judge every beat; after a verdict, end the job."""
        sock = self.sock
        assert sock is not None
        fired_at = leave_at = None
        told: set[int] = set()  # ranks told to go, after rank 0 reported
        last = time.monotonic()
        while not self._stop.is_set():
            # (a datagram that is not a heartbeat of this job is ignored)
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                try:
                    data, peer = sock.recvfrom(65536)
                except TimeoutError:
                    data, peer = b"", None
                beat = json.loads(data) if peer is not None else {}
                if "bye" in beat:
                    self.seen[int(beat["r"])].left = True
                elif "r" in beat:
                    self._record(beat, peer)
                if "p" in beat or "hello" in beat:
                    go = leave_at is not None
                    sock.sendto(json.dumps({"v": self.verdict.line if self.verdict else None,
                                            "go": go, "h": self.host}).encode(), peer)
                    if go and "r" in beat:
                        told.add(int(beat["r"]))
            now = time.monotonic()
            self._thaw(now - last)
            last = now
            if self.verdict is None:
                self.verdict = judge(now, self.seen, self.limits, self.first_step, self.beat_s,
                                     self.out_dir)
                if self.verdict is not None:
                    fired_at = now
            elif leave_at is None and fired_at is not None \
                    and self._acknowledged(now - fired_at):
                self.report(self.verdict.line, self._hang_record())
                # the others leave when told (their next heartbeat), then rank 0
                leave_at = time.monotonic() + (SILENT_BEATS + 2) * self.beat_s
            elif leave_at is not None and (now > leave_at or told >= self._live()):
                self.exit(EXIT_HANG)
                return

    def goodbye(self) -> None:
        """Tell every rank heard from that the hub stops (the run ended, or rank 0 leaves with
        its own error): its silence from now on is not a lost rank 0. One datagram each (one
        lost: the launcher ends that rank as rank 0 exits, as it always did)."""
        if self.sock is None:
            return
        for seen in self.seen.values():
            if seen.peer is not None:
                with contextlib.suppress(OSError):
                    self.sock.sendto(b'{"bye": 1}', seen.peer)

    def _thaw(self, gap: float) -> None:
        """After `gap` s between two turns of the loop: past a few beats, this process was
        frozen (a call that held the GIL, SIGSTOP): nobody could be heard meanwhile, so the
        silence clocks skip the gap."""
        if gap > SILENT_BEATS * self.beat_s:
            for seen in self.seen.values():
                seen.heard_at += gap

    def _record(self, beat: dict[str, Any], peer: tuple[str, int]) -> None:
        now = time.monotonic()
        if beat["p"] not in PHASES or int(beat["r"]) not in self.seen:
            raise ValueError(f"not a heartbeat of this job: {beat}")
        seen = self.seen[int(beat["r"])]
        seen.heard_at, seen.heard, seen.peer = now, True, peer
        seen.host = str(beat.get("h", ""))
        seen.moved_at = now - float(beat["age"])
        seen.step, seen.phase, seen.dumped = int(beat["s"]), str(beat["p"]), bool(beat["d"])

    def _live(self) -> set[int]:
        """The ranks other than 0 heard from and not found silent."""
        assert self.verdict is not None
        return {r for r, s in self.seen.items()
                if s.heard and r not in self.verdict.silent and r != 0}

    def _acknowledged(self, since: float) -> bool:
        """Every live rank wrote its stacks, or they had SILENT_BEATS + 2 beats to."""
        return all(self.seen[r].dumped for r in self._live()) \
            or since > (SILENT_BEATS + 2) * self.beat_s

    def _hang_record(self) -> dict[str, Any]:
        """hang.json: the verdict and every rank's last position."""
        assert self.verdict is not None
        now = time.monotonic()
        return {"line": self.verdict.line, "named": list(self.verdict.named),
                "silent": list(self.verdict.silent), "stalled_s": round(self.verdict.stalled_s, 3),
                "timeout_s": self.limits.timeout,
                "ranks": {str(r): {"step": s.step, "phase": s.phase,
                                   "since_progress_s": round(now - s.moved_at, 3),
                                   "since_heartbeat_s": round(now - s.heard_at, 3),
                                   "stacks_written": s.dumped or r == 0}
                          for r, s in sorted(self.seen.items())}}


def say_on_stderr(line: str) -> None:
    """`line` on stderr in one write (mpirun's output forwarding tags each write it gets)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def silence_output() -> None:
    """After a verdict a rank has said all it will (its stacks are on disk, rank 0 prints the
    line): what is written so far is flushed, and stdout and stderr go to /dev/null from here
    on. The main thread is stuck in a collective that fails as the other ranks leave, and
    that failure's traceback (HorovodInternalError, Gloo's errors) would bury the line."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
