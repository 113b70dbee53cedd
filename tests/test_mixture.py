"""Weighted mixtures (pipeline/mixture.py): shares, passes, determinism, exact resume at another
world size, field checks. Real tars (tests/pipeline_util.py), no framework.

Oracles here are independent of MixtureOrder: a source's multiplicities in an epoch follow from
n_s and its size alone (full passes see every sample once, a partial pass a subset), and the
shares of any prefix of the epoch are binomial-like around the weights.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from pipeline_util import write_shards

from ringfeed.pipeline import PipelineError, ShardPipeline, WeightedSource
from ringfeed.pipeline.mixture import Mixture, MixtureOrder, shares
from ringfeed.pipeline.plan import Layout

SIZES = {"web": [100, 120, 80], "code": [250, 250], "books": [60, 90, 50]}  # 300, 500, 200
WEIGHTS = {"web": 0.7, "code": 0.2, "books": 0.1}
B = 5


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, sizes in SIZES.items():
        write_shards(root / name, sizes)
    return [{"path": str(root / name), "weight": WEIGHTS[name]} for name in SIZES]


def make(sources, rank=0, world_size=1, **options):
    options = {"batch_size": B, "shuffle_buffer": 50, "seed": 3, **options}
    return ShardPipeline(sources, rank=rank, world_size=world_size, **options)


def epoch_ids(pipes, stop_after=None):
    """(source, local id) pairs of the valid samples every rank yields, checking that each
    decoded value is its own sample (write_shards: npy = [local id, 2 local id])."""
    out = []
    for pipe in pipes:
        for t, batch in enumerate(pipe):
            src, local = pipe.source_of(batch["__index__"])
            assert (batch["npy"][:, 0] == local).all()
            out += [(int(s), int(i)) for s, i, v in zip(src, local, batch["__valid__"],
                                                          strict=True) if v]
            if stop_after is not None and t + 1 == stop_after:
                break
    return out


def test_shares_split_a_total_exactly():
    assert shares([0.7, 0.2, 0.1], 1000).tolist() == [700, 200, 100]
    parts = shares([1, 1, 1], 100)
    assert parts.sum() == 100 and sorted(parts.tolist()) == [33, 33, 34]


def test_epoch_draws_each_source_by_weight_with_passes(sources):
    pipe = make(sources, balance="pad")
    assert pipe.source_names == ["web", "code", "books"]
    ids = epoch_ids([pipe])
    per_source = Counter(s for s, _ in ids)
    assert [per_source[s] for s in range(3)] == [700, 200, 100]  # E = 1000, pad: all of L
    web = Counter(i for s, i in ids if s == 0)  # 700 of 300: two passes and 100 of a third
    assert set(web) == set(range(300)) and sorted(Counter(web.values()).items()) == [
        (2, 200), (3, 100)]
    for s in (1, 2):  # subsampled: no sample twice within the epoch
        seen = [i for src, i in ids if src == s]
        assert len(seen) == len(set(seen))
    # the next epoch carries on where this one stopped: books' 200 samples over two epochs
    books = {i for s, i in ids if s == 2}
    pipe.set_epoch(1)
    books_next = {i for s, i in epoch_ids([pipe]) if s == 2}
    assert books | books_next == set(range(200)) and not books & books_next


def test_any_stretch_of_the_epoch_keeps_the_weights(sources):
    """The first 20 batches (100 samples): each source's count within 3 sigma of its weight
    (binomial bound; the block interleave keeps it far closer)."""
    pipe = make(sources, shuffle_buffer=0)
    ids = epoch_ids([pipe], stop_after=20)
    counts = Counter(s for s, _ in ids)
    n = len(ids)
    for s, w in enumerate(WEIGHTS.values()):
        assert abs(counts[s] - n * w) <= 3 * np.sqrt(n * w * (1 - w)), (s, counts)


def test_same_seed_same_batches_and_ranks_partition_the_epoch(sources):
    one = epoch_ids([make(sources)])
    assert one == epoch_ids([make(sources)])
    assert one != epoch_ids([make(sources, seed=4)])
    ranks = [make(sources, rank=r, world_size=3, balance="pad") for r in range(3)]
    assert len({p.batches_per_epoch for p in ranks}) == 1
    assert Counter(epoch_ids(ranks)) == Counter(epoch_ids([make(sources, balance="pad")]))


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_resume_at_another_world_size_gives_the_rest_of_the_epoch(sources, before, after):
    """Stopped mid-epoch on `before` ranks, resumed on `after`: what the resumed run reads,
    plus what the first run read, is the uninterrupted epoch's samples (a multiset: sources
    repeat), less the last segment's drop tail (< after x B samples). With sizes chosen so that
    no tail is dropped (epoch_samples 1200 = 2 x 3 x B x 40), it is exact."""
    opts = {"epoch_samples": 1200}
    full = Counter(epoch_ids([make(sources, rank=r, world_size=before, **opts)
                              for r in range(before)]))
    first = [make(sources, rank=r, world_size=before, **opts) for r in range(before)]
    stop = 12 if before == 2 else 8  # 2 x 12 x 5 = 3 x 8 x 5 = 120 samples: 1080 left
    consumed = Counter(epoch_ids(first, stop_after=stop))
    state = json.loads(json.dumps(first[0].state_dict()))
    assert all(p.state_dict() == state for p in first)
    resumed = [make(sources, rank=r, world_size=after, **opts) for r in range(after)]
    for p in resumed:
        p.load_state_dict(state)
    assert len({p.batches_remaining for p in resumed}) == 1
    rest = Counter(epoch_ids(resumed))
    assert consumed + rest == full
    assert sum(full.values()) == 1200


def test_state_of_another_mixture_is_refused(sources):
    state = make(sources).state_dict()
    other = [dict(s, weight=1.0) for s in sources]
    with pytest.raises(PipelineError, match="mixture"):
        make(other).load_state_dict(state)


def test_no_weights_concatenates_every_sample_once(sources):
    plain = [WeightedSource(path=s["path"]) for s in sources]
    ids = epoch_ids([make(plain, balance="pad")])
    assert Counter(ids) == Counter((s, i) for s, n in enumerate((300, 500, 200))
                                   for i in range(n))


@pytest.mark.integration  # DataLoader worker processes
def test_torch_workers_read_a_mixture_like_the_pipeline(sources):
    from ringfeed.pipeline.torch import make_loader

    pipe = make(sources, num_workers=2)
    want = [b["__index__"].tolist() for b in make(sources, num_workers=2)]
    got = [np.asarray(b["__index__"]).tolist() for b in make_loader(pipe)]
    assert got == want


def test_sources_must_carry_the_same_fields(sources, tmp_path):
    write_shards(tmp_path / "pics", [20], images=True)  # an extra png field
    odd = [sources[0], {"path": str(tmp_path / "pics"), "weight": 0.3}]
    with pytest.raises(PipelineError, match=r"mixture source 'web' has no field 'png' that "
                                            r"'pics' has"):
        make(odd)


@pytest.mark.parametrize("bad,match", [
    ([{"path": "x", "weight": -1}], "weight"),
    ([{"path": "x", "wieght": 1}], "wieght"),
])
def test_bad_entries_are_one_line(bad, match):
    with pytest.raises(PipelineError, match=match):
        make(bad)


def test_mixed_weights_and_none_are_refused(sources):
    with pytest.raises(PipelineError, match="every source a weight, or none"):
        make([sources[0], {"path": sources[1]["path"]}])


def test_a_billion_sample_epoch_plans_a_rank_without_materialising_it():
    """10^9 samples in 3 sources of 10^5 shards: a rank's ids come from its blocks alone."""
    layouts = tuple(Layout(np.full(100_000, n, dtype=np.int64)) for n in (5000, 3000, 2000))
    mix = Mixture(layouts, (0.5, 0.3, 0.2), 10**9)
    order = MixtureOrder(mix, seed=0, epoch=2, shuffle=True)
    positions = np.arange(500_000_000, 500_100_000)
    ids = order.ids(positions)
    source, local = mix.source_of(ids)
    counts = np.bincount(source, minlength=3) / len(ids)
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.002)
    assert (local < np.array([5 * 10**8, 3 * 10**8, 2 * 10**8])[source]).all()
    assert np.array_equal(ids, order.ids(positions))


@pytest.mark.system  # importing TensorFlow runs `uname`
def test_tf_data_reads_a_mixture_like_the_pipeline(sources):
    from ringfeed.pipeline.tf import make_dataset

    want = [b["__index__"].tolist() for b in make(sources)]
    got = [b["__index__"].numpy().tolist() for b in make_dataset(make(sources))]
    assert got == want


def test_each_source_is_served_from_the_decoded_cache(sources, tmp_path):
    pipe = make(sources, cache_dir=str(tmp_path / "cache"), decoded_cache=True)
    first = epoch_ids([pipe])
    writes = pipe.stats()["decoded_cache_writes"]  # the shards epoch 0 touched, each once
    assert writes >= 3
    # the same epoch again: the same samples, from the decoded arrays
    again = make(sources, cache_dir=str(tmp_path / "cache"), decoded_cache=True)
    assert epoch_ids([again]) == first
    stats = again.stats()
    assert stats["decoded_cache_hits"] >= writes and stats["decoded_cache_writes"] == 0


@pytest.mark.parametrize("train,line", [
    ([{"path": "/tmp", "wieght": 1}], "data.train[0].wieght: unknown key"),
    ([{"path": "/tmp", "weight": -2}], "data.train[0].weight: Input should be greater than 0"),
    ([{"path": "/no/such/shards", "weight": 1}], "data.train[0].path: /no/such/shards does "
                                                 "not exist"),
])
def test_a_bad_mixture_entry_in_a_config_is_one_line_naming_it(tmp_path, train, line):
    from ringfeed.errors import UserError
    from ringfeed.train.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"name": "mlp"}, "data": {"train": train}}))
    with pytest.raises(UserError) as e:
        load_config(path)
    assert line in str(e.value) and "\n" not in str(e.value)
