"""Two real Horovod ranks (horovodrun, Gloo, localhost) read uneven shards through the pipeline:
rank/size default to Horovod's, both ranks get the same batch count (an allreduce per batch
would hang otherwise), and a fatal data error on one rank stops the whole job."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, horovodrun
from pipeline_util import write_shards

from ringfeed.pipeline import ShardPipeline

pytestmark = pytest.mark.system
UNEVEN = [1, 23, 3, 17, 2, 9, 5]
PROGRAM = str(REPO / "tests" / "pipeline_util.py")


def test_two_ranks_same_batch_count_from_uneven_shards(tmp_path):
    write_shards(tmp_path / "shards", UNEVEN)
    result = horovodrun(2, ["python", PROGRAM, str(tmp_path / "shards"), str(tmp_path / "out")],
                        timeout=180)
    assert result.returncode == 0 and not result.timed_out, result.output[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["hvd_size"]) for r in ranks] == [(0, 2, 2), (1, 2, 2)]
    expected = (sum(UNEVEN) // 2) // 4
    assert [len(r["batches"]) for r in ranks] == [expected, expected]
    assert all(r["batches_per_epoch"] == expected for r in ranks)
    ids = [g for r in ranks for batch in r["batches"] for g in batch]
    assert len(ids) == len(set(ids)) == 2 * expected * 4


def test_fatal_data_error_on_one_rank_stops_the_job(tmp_path):
    shard_dir = tmp_path / "shards"
    paths = write_shards(shard_dir, UNEVEN)
    # the shard that only rank 1 reads in epoch 0 (same plan as the program's pipeline)
    pipe = ShardPipeline(shard_dir, batch_size=4, seed=3, shuffle_buffer=8, rank=0, world_size=2)
    plan = pipe.begin()[0]
    shards = [set(pipe.layout.locate(plan.rank_slots(r)[0])[0].tolist()) for r in (0, 1)]
    only_rank1 = sorted(shards[1] - shards[0], key=lambda s: -UNEVEN[s])[0]
    victim = paths[only_rank1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 3])  # truncated
    result = horovodrun(2, ["python", PROGRAM, str(shard_dir), str(tmp_path / "out"), "fail"],
                        timeout=180)
    assert not result.timed_out, "a rank's data error hung the job"
    assert result.returncode != 0
    assert "PipelineDataError" in result.output and victim.name in result.output
    assert not (tmp_path / "out" / "rank0.json").exists(), "rank 0 finished an epoch alone"
