"""A `ringfeed train` run builds its frameworks' heap (imports, model, optimizer) with the cyclic
collector off, then freezes it (gc.freeze) for the rest of the run (train/loop.py's
Trainer.run): the collector's passes skip torch's ~10^6 objects while it trains, and after the
run the collector is as the caller left it, nothing frozen."""

from __future__ import annotations

import gc

import pytest
from train_util import toy_config, write_config, write_toy_shards

PROBE = '''
import gc
import os

def transform(sample):
    with open(os.environ["GC_PROBE_FILE"], "a") as f:
        f.write(f"{gc.get_freeze_count()} {int(gc.isenabled())}\\n")
    return sample
'''


@pytest.mark.integration
def test_training_runs_on_a_frozen_heap_and_the_collector_is_restored(tmp_path, monkeypatch):
    from ringfeed.train.cli import main

    (tmp_path / "gc_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GC_PROBE_FILE", str(tmp_path / "probe.txt"))
    shards = write_toy_shards(tmp_path / "shards", n_train=40, n_val=8, per_shard=20)
    cfg = write_config(tmp_path / "run.yaml", **toy_config(
        shards, tmp_path / "out", train={"max_steps": 4},
        data={"transform": "gc_probe:transform"}))
    assert gc.isenabled()
    assert main(["train", str(cfg)]) == 0
    last_frozen, last_enabled = map(int, (tmp_path / "probe.txt").read_text().split("\n")[-2]
                                    .split())
    assert last_frozen > 10_000 and last_enabled == 1  # training: frozen, collector on
    assert gc.isenabled() and gc.get_freeze_count() == 0  # after: as before the run
