"""The end of a `ringfeed train` process is bounded (train/resilience/exit_bound.py): an exit
handler that never returns (here the user's) ends the process train.hang_timeout_s after its
run returned, with the hang line naming where it was stuck, its stacks on disk and exit 76,
and everything the run wrote kept. Without the bound the process waits for ever (the test's
timeout)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO, ringfeed, test_env
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import EXIT_HANG

pytestmark = pytest.mark.system

LINGERING_HOOK = '''
import atexit
import gc
import os
import time

def _linger():
    with open(os.environ["FREEZE_COUNT_FILE"], "w") as f:  # (see the test's last line)
        f.write(str(gc.get_freeze_count()))
    time.sleep(3600)

atexit.register(_linger)

def transform(sample):
    return sample
'''


def test_an_exit_handler_that_never_returns_ends_the_process_with_the_hang_line(tmp_path):
    (tmp_path / "lingering_hooks.py").write_text(LINGERING_HOOK)
    shards = write_toy_shards(tmp_path / "shards", n_train=40, n_val=10, per_shard=20)
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.yaml", **toy_config(
        shards, out, train={"max_steps": 6, "hang_timeout_s": 5, "hang_grace_s": 600},
        data={"transform": "lingering_hooks:transform"}))
    env = test_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}",
                   FREEZE_COUNT_FILE=str(tmp_path / "frozen"))
    res = ringfeed("train", str(cfg), timeout=240, env=env)
    assert not res.timed_out, res.output
    assert res.returncode == EXIT_HANG, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("ringfeed: hang: rank 0 did not end within 5 s after its run "
                           "returned (train.hang_timeout_s), stuck in _linger ("), last
    assert "Traceback" not in res.output
    stacks = (out / "hang" / "rank-0-exit.stacks").read_text()
    assert "_linger" in stacks and "ringfeed-exit-bound" not in last
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert (out / "checkpoints" / "ckpt-000000006").is_dir()
    # The exit handlers registered before the run returned find the heap frozen (gc.freeze),
    # which the interpreter's finalisation then does not trace: ~1 CPU-s a torch rank.
    assert int((tmp_path / "frozen").read_text()) > 10_000
