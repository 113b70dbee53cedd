"""train/resilience/faults.py: the test-only fault plan, read once from the environment by the
entry point and handed to what it hooks (no parsing at import, no module state)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ringfeed.errors import UserError
from ringfeed.train.resilience.faults import NO_FAULTS, Fault, FaultPlan, armed_budget


def test_the_plan_is_what_the_environment_given_says():
    plan = FaultPlan.from_env({"RINGFEED_FAULT": "kill-at-step:7:host=node-2",
                               "RINGFEED_SLOW_RANK": "1:0.5", "HOROVOD_HOSTNAME": "node-1"})
    assert plan == FaultPlan(Fault("kill-at-step", 7, 0, "node-2"), (1, 0.5), "node-1")
    assert FaultPlan.from_env({}) == NO_FAULTS


@pytest.mark.parametrize("name, value", [("RINGFEED_FAULT", "kill-at-step"),
                                         ("RINGFEED_FAULT", "explode:3"),
                                         ("RINGFEED_SLOW_RANK", "one:2")])
def test_a_malformed_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(UserError, match=f"^{name}=") as raised:
        FaultPlan.from_env({name: value})
    assert "\n" not in str(raised.value)


def test_no_budget_is_armed_outside_the_faulted_write():
    plan = FaultPlan.from_env({"RINGFEED_FAULT": "kill-in-checkpoint-write:5:100"})
    with plan.checkpoint_write(4) as budget:  # another step's write: untouched
        assert budget is None and armed_budget() is None
    with NO_FAULTS.checkpoint_write(5) as budget:
        assert budget is None and armed_budget() is None
    NO_FAULTS.before_step(5, 0)  # nothing happens
    assert armed_budget() is None


def killed_child(body) -> int:
    """Run `body()` in a forked child; its exit status (negative: the signal that ended it;
    1: it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.integration  # forked children, really SIGKILLed
def test_the_faulted_write_dies_with_exactly_its_budget_on_disk(tmp_path: Path):
    from ringfeed.train.checkpoint.files import open_for_write

    plan = FaultPlan.from_env({"RINGFEED_FAULT": "kill-in-checkpoint-write:5:100"})
    target = tmp_path / "state.pt"

    def write() -> None:
        with plan.checkpoint_write(5), open_for_write(target) as f:
            f.write(b"x" * 60)
            f.write(b"y" * 60)  # crosses the budget: 40 of these reach the disk, then SIGKILL

    assert killed_child(write) == -signal.SIGKILL
    assert target.read_bytes() == b"x" * 60 + b"y" * 40


@pytest.mark.integration  # forked children, really SIGKILLed
def test_a_budget_larger_than_the_files_kills_just_before_the_rename(tmp_path: Path):
    from ringfeed.train.checkpoint.files import open_for_write

    plan = FaultPlan.from_env({"RINGFEED_FAULT": "kill-in-checkpoint-write:5:1000"})
    target, after = tmp_path / "meta.json", tmp_path / "renamed"

    def write() -> None:
        with plan.checkpoint_write(5):
            with open_for_write(target) as f:
                f.write(b"{}")
        after.touch()  # never reached

    assert killed_child(write) == -signal.SIGKILL
    assert target.read_bytes() == b"{}" and not after.exists()


@pytest.mark.integration  # forked children, really SIGKILLed
def test_kill_at_step_takes_the_rank_or_the_host_it_names():
    by_rank = FaultPlan.from_env({"RINGFEED_FAULT": "kill-at-step:3:1"})
    assert killed_child(lambda: by_rank.before_step(3, 1)) == -signal.SIGKILL
    assert killed_child(lambda: by_rank.before_step(3, 0)) == 0
    assert killed_child(lambda: by_rank.before_step(2, 1)) == 0
    by_host = FaultPlan.from_env({"RINGFEED_FAULT": "kill-at-step:3:host=b",
                                  "HOROVOD_HOSTNAME": "b"})
    assert killed_child(lambda: by_host.before_step(3, 5)) == -signal.SIGKILL
    elsewhere = FaultPlan.from_env({"RINGFEED_FAULT": "kill-at-step:3:host=b",
                                    "HOROVOD_HOSTNAME": "a"})
    assert killed_child(lambda: elsewhere.before_step(3, 0)) == 0
