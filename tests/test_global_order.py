"""`order: global` (pipeline/canonical.py): the epoch's global batches - which ids form global
batch t - depend on the seed, the epoch and the data alone, not on the world size or the loader
workers; a resume at another world size continues them exactly; skip lists.

Ranks are simulated in one process: each rank's real ShardPipeline built with rank/world_size,
global batch t = the ranks' batches t joined in rank order (what allreduce averages over).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from pipeline_util import write_shards

from ringfeed.pipeline import PipelineError, ShardPipeline

pytestmark = pytest.mark.integration

SIZES = [37, 50, 13, 64, 41, 29, 55, 33]  # 322 samples, uneven shards
G, C = 24, 6  # global batch, canonical streams: 13 global batches of 4 per stream


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("global")
    write_shards(root / "a", SIZES)
    write_shards(root / "b", [40, 70], prefix="b")
    return root


def make(source, rank, world_size, workers=0, **options):
    options = {"order": "global", "global_batch_size": G, "canonical_streams": C,
               "shuffle_buffer": 16, "seed": 5, "num_workers": workers, **options}
    return ShardPipeline(source, rank=rank, world_size=world_size, **options)


def global_batches(pipes, loader=False, stop_after=None, g=G):
    """Global batch t (the ranks' ids joined in rank order), checking each decoded sample is
    the one its id names (write_shards: npy = [id, 2 id]) and each rank's batch is G / N."""
    per_rank = []
    for pipe in pipes:
        if loader:
            from ringfeed.pipeline.torch import make_loader

            batches = make_loader(pipe)
        else:
            batches = pipe
        ids = []
        for t, batch in enumerate(batches):
            index = np.asarray(batch["__index__"])
            assert len(index) == g // len(pipes) == pipe.batch_size
            if pipe.mixture is None:
                assert (np.asarray(batch["npy"])[:, 0] == index).all()
            ids.append(index.tolist())
            if stop_after is not None and t + 1 == stop_after:
                break
        per_rank.append(ids)
    assert len({len(ids) for ids in per_rank}) == 1  # every rank the same batch count
    return [sum(parts, []) for parts in zip(*per_rank, strict=True)]


def test_global_batches_are_the_same_on_1_2_3_ranks_and_0_or_2_loader_workers(shards):
    source = shards / "a"
    reference = global_batches([make(source, 0, 1)])
    assert len(reference) == 322 // G and all(len(b) == G for b in reference)
    ids = sum(reference, [])
    assert len(set(ids)) == len(ids)  # every sample at most once per epoch
    for ranks, workers, loader in [(2, 0, False), (3, 0, False), (3, 2, False), (1, 2, True),
                                   (3, 2, True)]:
        got = global_batches([make(source, r, ranks, workers) for r in range(ranks)], loader)
        assert got == reference, (ranks, workers, loader)  # same ids, same order
    other_epoch = [make(source, 0, 1)]
    other_epoch[0].set_epoch(1)
    assert global_batches(other_epoch) != reference


def test_the_default_streams_serve_8_16_and_64_ranks_with_the_same_global_batches(shards):
    """canonical_streams left at auto: gcd(64, 192) = 64 streams, one sample each per global
    batch; the world sizes people launch need no hand-set value (12, the old default, refused
    8 ranks)."""
    def default(rank, world_size):
        return ShardPipeline(shards / "a", rank=rank, world_size=world_size, order="global",
                             global_batch_size=64, shuffle_buffer=16, seed=5)

    reference = global_batches([default(0, 1)], g=64)
    assert len(reference) == 322 // 64
    for ranks in (2, 8, 16, 64):
        got = global_batches([default(r, ranks) for r in range(ranks)], g=64)
        assert got == reference, ranks
    with pytest.raises(PipelineError, match=re.escape(
            "canonical_streams=12 is not divisible by the world size 8")):
        ShardPipeline(shards / "a", rank=0, world_size=8, order="global", global_batch_size=64,
                      canonical_streams=12)


def test_an_auto_stream_count_no_world_size_divides_is_one_line(shards, tmp_path,
                                                                 monkeypatch):
    from ringfeed.errors import UserError
    from ringfeed.train.config import load_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name: mlp}}\ndata: {{train: {shards / 'a'}}}\n"
                   f"output: {{dir: {tmp_path / 'out'}}}\n")
    monkeypatch.setenv("HOROVOD_SIZE", "5")  # 20 samples over 5 ranks, but 4 streams
    with pytest.raises(UserError, match=re.escape(
            "data.canonical_streams=auto (gcd(20, 192) = 4) is not divisible by the world "
            "size 5")):
        load_config(cfg, ["data.order=global", "data.global_batch_size=20"])


def test_a_rank_reads_the_shards_of_its_own_range_only(shards):
    """Locality: rank r's streams are a contiguous block, so it opens the shards its stretch
    of the epoch's shard order covers (about a third each on 3 ranks), not all of them."""
    opened = []
    for r in range(3):
        pipe = make(shards / "a", r, 3)
        for _ in pipe:
            pass
        opened.append(pipe.stats()["shards_opened"])
    assert sum(opened) <= len(SIZES) + 2 * C, opened  # (boundary shards: at most 2 per stream)
    assert max(opened) < len(SIZES), opened


@pytest.mark.parametrize("mixture", [False, True])
def test_resume_at_another_world_size_continues_the_global_batches(shards, mixture):
    source = ([{"path": str(shards / "a"), "weight": 0.6},
               {"path": str(shards / "b"), "weight": 0.4}] if mixture else shards / "a")
    reference = global_batches([make(source, 0, 1)])
    first = [make(source, r, 3) for r in range(3)]
    head = global_batches(first, stop_after=5)
    state = first[0].state_dict()
    assert all(p.state_dict() == state for p in first)  # any rank's state resumes them all
    assert state["segments"][-1]["batches_consumed"] == 5
    second = [make(source, r, 2, workers=2) for r in range(2)]
    for pipe in second:
        pipe.load_state_dict(json.loads(json.dumps(state)))
    assert head + global_batches(second) == reference


def test_global_order_rules_are_one_line_errors(shards):
    source = shards / "a"
    with pytest.raises(PipelineError, match=r"canonical_streams=6 is not divisible by the "
                                            r"world size 4: set canonical_streams to a multiple"):
        make(source, 0, 4)
    with pytest.raises(PipelineError, match=r"global_batch_size=20 is not divisible by "
                                            r"canonical_streams=6"):
        make(source, 0, 2, global_batch_size=20)
    with pytest.raises(PipelineError, match="order: global needs global_batch_size"):
        make(source, 0, 1, global_batch_size=None)
    with pytest.raises(PipelineError, match="balance='pad' is for the rank order"):
        make(source, 0, 1, balance="pad")
    rank_state = ShardPipeline(source, batch_size=4, seed=5).state_dict()
    with pytest.raises(PipelineError, match="order='rank', this pipeline order='global'"):
        make(source, 0, 1).load_state_dict(rank_state)
    with pytest.raises(PipelineError, match="canonical_streams=6, 24 samples per global batch"):
        make(source, 0, 1, canonical_streams=12).load_state_dict(make(source, 0, 1).state_dict())


# -- skip lists ---------------------------------------------------------------------------------
def test_a_skip_list_leaves_its_ids_out_on_every_rank_and_keeps_earlier_batches(shards):
    source = shards / "a"
    reference = global_batches([make(source, 0, 1)])
    skip = reference[7][:2] + reference[9][5:6] + [10**6]  # (an id past the split: ignored)
    for ranks, workers in [(1, 0), (3, 2)]:
        pipes = [make(source, r, ranks, workers, skip=skip) for r in range(ranks)]
        got = global_batches(pipes)
        # each stream loses at most 3 of its 52 samples: every stream is cut to 49 // 4 chunks
        assert len(got) == (322 // G * (G // C) - 3) // (G // C) == 12
        assert not set(skip) & {i for batch in got for i in batch}
        assert got[:7] == reference[:7]  # batches before the first skipped id are unchanged
        assert all(p.stats()["skip_listed"] == 3 for p in pipes)
        assert pipes[0].batches_per_epoch == 12


def test_skip_list_files_take_ids_or_samples_jsonl_lines(shards, tmp_path):
    source = shards / "a"
    listed = tmp_path / "skip.txt"
    listed.write_text("3, 17\n\n40 41\n")
    jsonl = tmp_path / "samples.jsonl"
    jsonl.write_text(json.dumps({"step": 9, "epoch": 0, "ids": [[3, 17], [40]]}) + "\n"
                     + json.dumps({"step": 10, "epoch": 0, "ids": [[41], []]}) + "\n")
    expected = global_batches([make(source, 0, 1, skip=[3, 17, 40, 41])])
    for path in (listed, jsonl):
        assert global_batches([make(source, 0, 1, skip=str(path))]) == expected
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2\nthree\n")
    with pytest.raises(PipelineError, match=r"skip: .*bad.txt:2: expected sample ids"):
        make(source, 0, 1, skip=str(bad))
    with pytest.raises(PipelineError, match=r"skip: cannot read .*missing.txt"):
        make(source, 0, 1, skip=str(tmp_path / "missing.txt"))


def test_ids_added_to_the_skip_list_after_a_checkpoint_resume_exactly(shards):
    """The rerun of a spike: ids trained after the checkpoint are skipped from it on; the
    resumed run (another world size) yields what a run with the list from the start does."""
    source = shards / "a"
    reference = global_batches([make(source, 0, 1)])
    first = [make(source, r, 3) for r in range(3)]
    head = global_batches(first, stop_after=5)
    skip = reference[8][3:6]
    resumed = [make(source, r, 2, workers=2, skip=skip) for r in range(2)]
    for pipe in resumed:
        pipe.load_state_dict(first[0].state_dict())
    assert head + global_batches(resumed) == global_batches([make(source, 0, 1, skip=skip)])


def rank_batches(source, ranks, workers=0, stop_after=None, state=None, **options):
    """Per rank, its batches as (ids, valid, npy ids) lists, in the rank order."""
    out = []
    for r in range(ranks):
        pipe = ShardPipeline(source, rank=r, world_size=ranks, batch_size=4, shuffle_buffer=16,
                             seed=5, num_workers=workers, **options)
        if state is not None:
            pipe.load_state_dict(state)
        rows = []
        for t, batch in enumerate(pipe):
            rows.append((np.asarray(batch["__index__"]).tolist(),
                         np.asarray(batch["__valid__"]).tolist(),
                         np.asarray(batch["npy"])[:, 0].tolist()))
            if stop_after is not None and t + 1 == stop_after:
                break
        out.append(rows)
    return out, pipe


@pytest.mark.parametrize("ranks, workers", [(1, 0), (2, 2)])
def test_in_the_rank_order_a_listed_ids_row_is_a_stand_in_and_the_plan_is_kept(shards, ranks,
                                                                                  workers):
    source = shards / "a"
    reference, _ = rank_batches(source, ranks, workers)
    skip = [reference[0][1][0][2], reference[-1][3][0][0], reference[0][3][0][3], 10**6]
    got, pipe = rank_batches(source, ranks, workers, skip=skip)
    assert pipe.stats()["skip_listed"] == 3
    for ref_rank, got_rank in zip(reference, got, strict=True):
        assert len(got_rank) == len(ref_rank)  # every rank's step count is unchanged
        for (ids, _, _), (got_ids, valid, npy) in zip(ref_rank, got_rank, strict=True):
            assert got_ids == npy  # each row holds the sample its id names
            for i, sample in enumerate(ids):
                if sample in skip:  # a copy of an unlisted row of the same batch, invalid
                    assert not valid[i] and got_ids[i] in ids and got_ids[i] not in skip
                else:
                    assert valid[i] and got_ids[i] == sample
    trained = {i for rank in got for ids, _, _ in rank for i in ids}
    assert not trained & set(skip)


def test_in_the_rank_order_ids_listed_before_a_resume_at_another_world_size_stay_out(shards):
    source = shards / "a"
    head, first = rank_batches(source, 3, stop_after=5)
    later, _ = rank_batches(source, 2, state=first.state_dict())
    skip = [later[0][2][0][1], later[1][4][0][0]]
    resumed, _ = rank_batches(source, 2, state=first.state_dict(), skip=skip)
    assert len(resumed[0]) == len(later[0]) == len(resumed[1])
    for before, after in zip(later, resumed, strict=True):
        for (ids, _, _), (got, valid, _) in zip(before, after, strict=True):
            assert [i for i, v in zip(got, valid, strict=True) if v] == [i for i in ids
                                                                           if i not in skip]


@pytest.mark.parametrize("overrides, expected", [
    (["data.order=global"], "data.order: global needs data.global_batch_size"),
    (["data.order=global", "data.global_batch_size=24", "elastic.enabled=true"],
     "data.order: global keeps one global batch at every world size, which elastic runs do "
     "not"),
    (["data.order=global", "data.global_batch_size=24", "data.canonical_streams=5"],
     "data.global_batch_size=24 / train.accumulate (1) = 24 is not divisible by "
     "data.canonical_streams=5"),
    (["data.order=global", "data.global_batch_size=24", "train.accumulate=4",
      "data.canonical_streams=12"], "= 6 is not divisible by data.canonical_streams=12"),
])
def test_a_run_config_breaking_the_global_order_rules_is_one_line(shards, tmp_path, overrides,
                                                                   expected):
    from ringfeed.errors import UserError
    from ringfeed.train.config import load_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{name: mlp}}\ndata: {{train: {shards / 'a'}}}\n"
                   f"output: {{dir: {tmp_path / 'out'}}}\n")
    with pytest.raises(UserError, match=re.escape(expected)):
        load_config(cfg, overrides)


# -- ringfeed replay's pieces (its run is in test_global_order_train.py) -------------------------
def test_replay_compares_window_means_where_the_run_logged_every_few_steps():
    from ringfeed.train.replay import compare

    original = {4: 1.5, 6: 2.5}  # a run with log_every 2: means over steps 3-4 and 5-6
    replay = {3: 1.0, 4: 2.0, 5: 2.0, 6: 3.0}
    rows = compare(original, replay, 3, 6, log_every=2).splitlines()
    assert rows[1].split() == ["3", "1.000000"]  # nothing logged by the run at step 3
    assert rows[2].split() == ["4", "1.500000", "1.500000", "0"]
    assert rows[-1] == "max |difference| 0"


def test_replay_errors_are_one_line(shards, tmp_path, capsys):
    from ringfeed.train.cli import main

    assert main(["replay", str(tmp_path), "--steps", "5:3"]) == 2
    assert "--steps '5:3': expected A:B" in capsys.readouterr().err
    assert main(["replay", str(tmp_path), "--steps", "3:5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.yaml here" in err, err
    (tmp_path / "config.yaml").write_text(f"model: {{name: mlp}}\ndata: {{train: {shards / 'a'}}}\n"
                                          f"output: {{dir: {tmp_path}}}\n")
    assert main(["replay", str(tmp_path), "--steps", "3:5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint at or before step 2" in err, err
