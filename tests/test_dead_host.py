"""A dead rank or host found in seconds (issue 48): heartbeats missing past
`train.silent_timeout_s` end the job with the rank(s) and host(s) named, exit 76, while
`train.hang_timeout_s` stays the bound for ranks alive without progress.

The rule (unit), two watchdogs over their real UDP channel in one process (integration: a lost
rank, goodbyes, a main thread busy in torch), and real 2-rank jobs (system): SIGSTOP on rank 1
and on rank 0 under `ringfeed run`, and rank 1 in a network namespace whose traffic is dropped
(no reset), relaunched by `ringfeed run` to the final weights of an unfaulted run.

Dropping packets: netem (`tc qdisc ... netem loss 100%`) where the kernel has it; this box's
has neither sch_netem, tc classifiers nor iptables/nft, so the test falls back to blackhole
routes in both namespaces: TCP segments are dropped silently (no reset; they go through once
the route is gone) and UDP sends fail on the sending host only, which is silence to the other.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fault_util import (
    alongside,
    assert_same_torch_state,
    logged_step,
    torch_final,
    wait_for,
    waited,
    worker_processes,
)
from helpers import BIN, REPO, run, test_env
from train_util import finish, start, toy_config, write_config, write_toy_shards
from watchdog_util import Job

from ringfeed.errors import UserError
from ringfeed.train.resilience.watchdog import (
    EXIT_HANG,
    HANG_LINE,
    Hub,
    Limits,
    Seen,
    Watchdog,
    interval_for,
    judge,
)

SILENT = Limits(timeout=100.0, grace=500.0, data=50.0, silent=3.0)


def seen(heard: float, step: int, phase: str, host: str = "", left: bool = False) -> Seen:
    return Seen(heard_at=heard, step=step, phase=phase, moved_at=0.0, host=host, left=left)


# -- the rule (unit) ----------------------------------------------------------------------
def test_a_rank_silent_past_the_short_bound_is_named_with_its_host_long_before_a_hang():
    table = {0: seen(10, 7, "step", "a"), 1: seen(6.5, 7, "step", "b")}
    assert judge(9.4, table, SILENT, 0, beat_s=0.3, out_dir="o") is None  # silent 2.9 s
    verdict = judge(10, table, SILENT, 0, beat_s=0.3, out_dir="o")  # 3.5 s; no move for 10
    assert verdict is not None and verdict.named == verdict.silent == (1,)
    step = "at step 8, in the step (forward, backward, allreduce)"
    assert verdict.line.startswith(
        f"{HANG_LINE} rank 1 stopped responding on host b (no heartbeat for 4 s; last heard "
        f"{step}); the others wait: rank 0 {step}; heartbeats missing for longer than "
        "train.silent_timeout_s (3 s); Python stacks of rank(s) 0 in o/hang/")
    assert f"exit {EXIT_HANG} (restartable" in verdict.line and "\n" not in verdict.line


def test_a_lost_host_is_one_phrase_naming_its_ranks():
    table = {r: seen(20, 3, "data", "a") for r in range(2)}
    table |= {r: seen(15, 3, "step", "b") for r in (2, 3)}
    verdict = judge(20, table, SILENT, 0, beat_s=0.3, out_dir="o")
    assert verdict is not None and verdict.silent == (2, 3)
    assert "ranks 2-3 stopped responding on host b (no heartbeat for 5 s; last heard at step 4" \
           in verdict.line and "the others wait: ranks 0-1 at step 4, waiting for data" \
           in verdict.line


@pytest.mark.parametrize("phase", ["start", "checkpoint", "end"])
def test_silence_waits_hang_timeout_where_a_live_process_may_hold_the_gil(phase):
    # rank 0 writes a checkpoint (its hub reads its own beats); rank 1, silent, is in it too
    table = {0: seen(50, 5, phase), 1: seen(10, 5, "report")}
    assert judge(50, table, SILENT, 0, beat_s=0.3, out_dir="o") is None
    table[0].heard_at = 101  # past hang_timeout_s: the hang rule names it, as before
    verdict = judge(101, table, SILENT, 0, beat_s=0.3, out_dir="o")
    assert verdict is not None and verdict.silent == (1,)
    assert "train.hang_timeout_s 100" in verdict.line


@pytest.mark.parametrize("phase", ["data", "step", "report", "validate"])
def test_the_short_bound_holds_in_the_other_phases_and_the_first_step(phase):
    table = {0: seen(10, 0, phase), 1: seen(6, 0, phase)}  # first_step 0: the first step
    verdict = judge(10, table, SILENT, 0, beat_s=0.3, out_dir="o")
    assert verdict is not None and verdict.silent == (1,)


def test_a_rank_that_said_goodbye_is_not_a_lost_one():
    table = {0: seen(10, 5, "step"), 1: seen(2, 5, "step", left=True)}
    assert judge(10, table, SILENT, 0, beat_s=0.3, out_dir="o") is None


def test_without_a_silent_bound_silence_waits_hang_timeout_as_before():
    limits = Limits(timeout=100.0)
    assert limits.silence({"step"}) == 100.0 and SILENT.silence({"step"}) == 3.0
    assert SILENT.silence({"step", "checkpoint"}) == 100.0
    assert judge(50, {0: seen(50, 5, "step"), 1: seen(10, 5, "step")}, limits, 0, beat_s=1,
                 out_dir="o") is None


def test_the_heartbeat_interval_follows_the_shorter_bound():
    dog = Watchdog(1, 2, SILENT, "o")
    assert dog.beat_s == interval_for(3.0) == pytest.approx(0.3)
    assert Watchdog(1, 2, Limits(timeout=300.0), "o").beat_s == 2.0


def test_a_hub_that_was_frozen_does_not_count_its_own_pause_as_silence():
    hub = Hub(2, SILENT, 0.3, "o", threading.Event(), report=lambda *a: None,
              exit=lambda code: None)
    hub.seen = {0: seen(10, 5, "step"), 1: seen(10, 5, "step")}
    hub._thaw(0.5)  # an ordinary turn
    assert hub.seen[1].heard_at == 10
    hub._thaw(30.0)  # a call held the GIL for 30 s: nobody could be heard
    assert hub.seen[1].heard_at == 40 and judge(41, hub.seen, SILENT, 0, 0.3, "o") is None


def test_the_key_is_validated_against_hang_timeout_and_the_heartbeat(tmp_path):
    from ringfeed.train.config import load_config

    write_toy_shards(tmp_path / "shards", n_train=8, n_val=4, per_shard=8)
    cfg = write_config(tmp_path / "c.yaml", **toy_config(tmp_path / "shards", tmp_path / "o"))
    from ringfeed.train.resilience.watchdog import limits_for

    assert limits_for(load_config(cfg)).silent == 15.0  # unset: 15 s below the 300 s default
    short = load_config(cfg, ["train.hang_timeout_s=10"])  # unset, hang_timeout_s shorter:
    assert limits_for(short).silent is None  # silence waits hang_timeout_s, nothing refused
    with pytest.raises(UserError, match=r"silent_timeout_s \(12\) must be below "
                                        r"hang_timeout_s \(10\)"):
        load_config(cfg, ["train.hang_timeout_s=10", "train.silent_timeout_s=12"])
    with pytest.raises(UserError, match=r"train\.silent_timeout_s: .*greater than or equal to 1"):
        load_config(cfg, ["train.silent_timeout_s=0.5"])
    loaded = load_config(cfg, ["train.hang_timeout_s=null", "train.silent_timeout_s=500"])
    assert loaded.train.silent_timeout_s == 500  # (the watchdog is off)


# -- two watchdogs over their real channel, in one process (integration) --------------------
class Pair(Job):
    """Ranks 0 and 1, both heard in the step of step 4."""

    def __init__(self, out: Path, limits: Limits):
        super().__init__(out, limits, size=2)
        for dog in self.dogs:
            dog.at(3, "step")
        time.sleep(3 * self.dogs[0].beat_s)  # both heard in the step


LONG_HANG = Limits(timeout=600.0, silent=1.0)  # a hang would take 10 minutes


@pytest.mark.integration
def test_a_lost_rank_ends_the_job_within_the_short_bound(tmp_path):
    pair = Pair(tmp_path, LONG_HANG)
    try:
        pair.dogs[1]._stop.set()  # rank 1 falls silent, as a lost host does
        assert wait_for(lambda: pair.exits == {0: EXIT_HANG}, timeout=30), pair.exits
    finally:
        pair.stop()
    (line,) = pair.lines
    assert line.startswith(f"{HANG_LINE} rank 1 stopped responding on host "
                           f"{socket.gethostname()} (no heartbeat for ")
    assert "train.silent_timeout_s (1 s)" in line and (tmp_path / "hang" / "hang.json").exists()


@pytest.mark.integration
def test_rank_0_lost_the_others_name_it_and_its_host(tmp_path):
    pair = Pair(tmp_path, LONG_HANG)
    try:
        pair.dogs[0]._stop.set()  # the hub and rank 0's heartbeats gone, no goodbye
        assert wait_for(lambda: pair.exits == {1: EXIT_HANG}, timeout=30), pair.exits
    finally:
        pair.stop()
    (line,) = pair.lines
    assert re.match(rf"{re.escape(HANG_LINE)} rank 0 stopped responding on host "
                    rf"{re.escape(socket.gethostname())} \(no heartbeat reply for \d+ s; seen by "
                    r"rank 1, itself stuck at step 4, in the step \(forward, backward, "
                    r"allreduce\)\); heartbeats missing for longer than "
                    r"train.silent_timeout_s \(1 s\)", line), line
    assert (tmp_path / "hang" / "rank-1.stacks").exists()


@pytest.mark.integration
@pytest.mark.parametrize("leaver", [0, 1])
def test_a_rank_that_leaves_on_its_own_says_goodbye_and_is_not_named(tmp_path, leaver):
    """The end of a run, or a rank leaving with its own error: its watchdog stops first, and
    the rest of its exit may take longer than the short bound."""
    pair = Pair(tmp_path, LONG_HANG)
    try:
        pair.dogs[leaver].stop()
        time.sleep(4 * LONG_HANG.silent)
        assert pair.exits == {} and pair.lines == []
    finally:
        pair.stop()


@pytest.mark.integration
def test_a_main_thread_busy_in_long_torch_ops_keeps_beating(tmp_path):
    """The watchdog thread beats while the main thread computes: torch releases the GIL."""
    import torch

    pair = Pair(tmp_path, LONG_HANG)
    try:
        a = torch.randn(1024, 1024)
        started = time.monotonic()
        while time.monotonic() - started < 4 * LONG_HANG.silent:  # 4 x the bound in matmuls
            for _ in range(20):
                a = torch.tanh(a @ a)
        assert pair.exits == {} and pair.lines == []
    finally:
        pair.stop()


# -- real jobs (system) ---------------------------------------------------------------------
STEPS, SLOW_S = 60, 0.1  # rank 1 sleeps SLOW_S a step: the job lasts long enough to hit
RUN_TRAIN = {"max_steps": STEPS, "log_every": 5, "hang_timeout_s": 600, "silent_timeout_s": 3}


def job_config(tmp_path: Path, name: str) -> tuple[Path, Path]:
    shards = tmp_path / "shards"
    if not shards.exists():
        write_toy_shards(shards, n_train=360, n_val=12, per_shard=60)
    run_dir = tmp_path / name
    cfg = write_config(tmp_path / f"{name}.yaml", **toy_config(
        shards, run_dir, data={"batch_size": 4, "val_split": None}, train=RUN_TRAIN,
        checkpoint={"every_steps": 10, "keep": 10},
        output={"dir": str(run_dir), "tensorboard": False}))
    return cfg, run_dir


def hang_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if HANG_LINE in line]


@pytest.mark.system
@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_stopped_rank_ends_the_job_in_seconds_naming_rank_and_host(tmp_path, victim):
    cfg, run_dir = job_config(tmp_path, "run")
    job = start([BIN / "ringfeed", "run", "--max-restarts", "0", "--",
                 BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                 BIN / "ringfeed", "train", cfg], env=test_env(RINGFEED_SLOW_RANK=f"1:{SLOW_S}"))
    stopped = None
    try:
        assert wait_for(lambda: logged_step(run_dir) >= 15, timeout=180), "never got there"
        (stopped,) = worker_processes(job.pid, HOROVOD_RANK=str(victim))
        stopped.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        stacks = run_dir / "hang" / f"rank-{1 - victim}.stacks"  # written as the line is said
        assert wait_for(stacks.exists, timeout=240)  # < hang_timeout_s 600
        named_s = time.monotonic() - stopped_at
        assert wait_for(lambda: job.poll() is not None, timeout=120)
        ended_s = time.monotonic() - stopped_at
    finally:
        code, output = finish(job, timeout=60)
        if stopped is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                stopped.kill()
    print(f"[test_dead_host] SIGSTOP rank {victim} -> named {named_s:.1f} s, job ended "
          f"{ended_s:.1f} s")
    assert code == EXIT_HANG, output[-5000:]
    (line,) = hang_lines(output)
    assert f"rank {victim} stopped responding on host {socket.gethostname()} (no heartbeat" \
           in line, line
    assert "train.silent_timeout_s (3 s)" in line and "Traceback" not in output
    live = 1 - victim
    assert (run_dir / "hang" / f"rank-{live}.stacks").exists()
    assert not (run_dir / "hang" / f"rank-{victim}.stacks").exists()


# -- a host whose traffic is dropped: network namespaces ------------------------------------
sys.path.insert(0, str(REPO / "benchmarks"))
import netns_hosts  # noqa: E402  (as tests/test_multinode.py)
from netns_sshd import SSH_PORT, SSHD, root_sshd  # noqa: E402

ADDRESSES = ("192.168.78.1", "192.168.78.2")
NS_PREFIX = "rfdh"
ACROSS = ["-np", "2", "-H", f"{ADDRESSES[0]}:1,{ADDRESSES[1]}:1", "-p", str(SSH_PORT), "--gloo",
          "--network-interface", "eth0", "--disable-cache", "--start-timeout", "60"]


def missing_prerequisite() -> str | None:
    reason = netns_hosts.missing_prerequisite(NS_PREFIX, ("ip", "ssh", "ssh-keygen"))
    if reason is None and not os.access(SSHD, os.X_OK):
        reason = f"{SSHD} not found (Debian: apt-get install openssh-server)"
    return reason


@contextlib.contextmanager
def two_hosts_with_ssh(tmp_path: Path) -> Iterator[tuple[tuple[str, str], dict[str, str]]]:
    """Hosts A and B (network namespaces, one veth link), sshd in each: (namespaces, the env
    whose PATH leads to an ssh using the test's keys), as tests/test_multinode.py."""
    ssh_dir = tmp_path / "ssh"
    try:
        with netns_hosts.two_hosts(NS_PREFIX, ADDRESSES) as pair, \
                root_sshd(pair, ADDRESSES, ssh_dir) as wrapper_dir:
            env = test_env(PATH=f"{wrapper_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
                           RINGFEED_SLOW_RANK=f"1:{SLOW_S}")
            for address in ADDRESSES:
                assert wait_for(lambda a=address: run(
                    ["ip", "netns", "exec", pair[0], "ssh", a, "true"], timeout=15,
                    env=env).returncode == 0, timeout=30, poll=0.5), f"no ssh to {address}"
            yield pair, env
    finally:
        shutil.rmtree(ssh_dir, ignore_errors=True)


def drop_all_traffic(pair: tuple[str, str]) -> list[list[str]]:
    """Every packet between A and B dropped, no reset: netem loss 100% on both ends, else
    blackhole routes to the other host in both (module docstring). The commands that undo
    it."""
    undo = []
    netem = [["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
              "loss", "100%"] for ns in pair]
    if all(subprocess.run(c, capture_output=True).returncode == 0 for c in netem[:1]):
        subprocess.run(netem[1], check=True, capture_output=True)
        for ns in pair:
            undo.append(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"])
        return undo
    for ns, other in zip(pair, reversed(ADDRESSES), strict=True):
        subprocess.run(["ip", "-n", ns, "route", "add", "blackhole", f"{other}/32"], check=True,
                       capture_output=True)
        undo.append(["ip", "-n", ns, "route", "del", "blackhole", f"{other}/32"])
    return undo


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_host_whose_traffic_is_dropped_is_named_and_the_relaunch_ends_as_unfaulted(tmp_path):
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    # the unfaulted run: the same 2 ranks on this host (Gloo's sum of two tensors is the same
    # over any link), training while the faulted job waits on its dropped link
    ref_cfg, ref_dir = job_config(tmp_path, "ref")
    cfg, run_dir = job_config(tmp_path, "run")
    undo: list[list[str]] = []
    with alongside([BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                    BIN / "ringfeed", "train", ref_cfg], tmp_path / "ref.log",
                   test_env()) as ref, two_hosts_with_ssh(tmp_path) as (pair, env):
        job = start(["ip", "netns", "exec", pair[0], BIN / "ringfeed", "run", "--max-restarts",
                     "1", "--backoff", "5", "--", BIN / "horovodrun", *ACROSS,
                     BIN / "ringfeed", "train", cfg], env=env)
        try:
            assert wait_for(lambda: logged_step(run_dir) >= 15, timeout=240), "never got there"
            (launcher,) = [p for p in psutil.Process(job.pid).children(recursive=True)
                           if any(part.endswith("horovodrun") for part in p.cmdline())]
            undo = drop_all_traffic(pair)
            dropped_at = time.monotonic()
            assert wait_for((run_dir / "hang" / "hang.json").exists, timeout=120)
            named_s = time.monotonic() - dropped_at
            # host B stays lost until the launcher has ended (B's own view of the partition
            # never reaches it, as from a dead host); the relaunch finds the link back
            assert wait_for(lambda: not launcher.is_running()
                            or launcher.status() == psutil.STATUS_ZOMBIE, timeout=60)
            ended_s = time.monotonic() - dropped_at
            for command in undo:
                subprocess.run(command, check=True, capture_output=True)
            undo = []
        finally:
            for command in undo:
                subprocess.run(command, capture_output=True)
            code, output = finish(job, timeout=300)
        waited(ref, tmp_path / "ref.log", timeout=300)
    print(f"[test_dead_host] traffic dropped -> verdict {named_s:.1f} s, horovodrun ended "
          f"{ended_s:.1f} s")
    assert code == 0, output[-6000:]
    lines = hang_lines(output)
    assert len(lines) == 1, "\n".join(lines)
    line = lines[0]
    assert f"rank 1 stopped responding on host {ADDRESSES[1]} (" in line, line
    assert "train.silent_timeout_s (3 s)" in line
    assert "ringfeed run: job failed (exit 76); restart 1/1" in output
    assert "ringfeed run: job finished after 1 restart(s)" in output
    assert_same_torch_state(torch_final(run_dir, STEPS), torch_final(ref_dir, STEPS))
