"""Storage faults against a real S3 server (moto's, on 127.0.0.1) behind a real TCP fault proxy
(tests/s3_proxy.py): connection resets, stalls, 503 SlowDown and bodies cut short are waited out
by the retry policy (ringfeed/remote.py) and the data read is the data written; a download cut
again and again resumes with range reads; an outage past the budget is `storage unavailable`,
exit 75, and `ringfeed run` finishes the job; a 2-rank training through an outage ends with the
weights of one without it. Every run is bounded by a timeout."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from fault_util import (
    alongside,
    assert_same_torch_state,
    logged_step,
    torch_final,
    wait_for,
    waited,
)
from helpers import BIN, run, test_env
from s3_proxy import AWS_ENV, FaultProxy, host_port, moto_for_module
from train_util import finish, start, toy_config, write_config, write_toy_shards

from ringfeed.pipeline import PipelineDataError, ShardPipeline
from ringfeed.pipeline.cache import ShardCache
from ringfeed.pipeline.source import ShardRef
from ringfeed.remote import RetryPolicy, StorageUnavailable, with_timeouts

pytestmark = pytest.mark.system  # servers and processes (tests/conftest.py)

RINGFEED = BIN / "ringfeed"
QUICK = {"first_backoff_s": 0.05, "max_backoff_s": 0.5}  # waits short enough for a test
STEPS = 60  # toy shards: 480 samples / (2 ranks x 4), one epoch


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """moto's S3 server with the toy shards at s3://bucket/toy; yields (endpoint, local dir)."""
    import s3fs

    with moto_for_module() as endpoint:
        shards = write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
        fs.makedirs("bucket", exist_ok=True)  # (moto keeps one store per process)
        fs.put(str(shards) + "/", "bucket/toy/", recursive=True)
        yield endpoint, shards


@pytest.fixture
def proxy(bucket):
    with FaultProxy(host_port(bucket[0])) as p:
        yield p


def options(proxy: FaultProxy) -> dict:
    """fsspec options through the proxy, with timeouts short enough to see a stall in a test."""
    return {"endpoint_url": proxy.url, "key": "testing", "secret": "testing",
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 1,
                              "retries": {"max_attempts": 2, "mode": "standard"}}}


def pipeline(source: str | Path, cache: Path, proxy: FaultProxy | None = None,
             **config) -> ShardPipeline:
    return ShardPipeline(source, batch_size=8, cache_dir=str(cache), seed=3, rank=0,
                         world_size=1, storage_options=options(proxy) if proxy else {},
                         **config)


def collect(pipe: ShardPipeline) -> list[tuple[list[int], bytes]]:
    """An epoch as comparable values: each batch's sample ids and its bytes of x."""
    return [(batch["__index__"].tolist(), batch["x.npy"].tobytes()) for batch in pipe]


# -- the cache's downloads ------------------------------------------------------------------
def test_a_download_cut_again_and_again_resumes_with_range_reads(bucket, proxy, tmp_path):
    """Promise: Storage outages (train/RECOVERY.md)."""
    import s3fs

    data = os.urandom((4 << 20) + 12345)
    s3fs.S3FileSystem(endpoint_url=bucket[0]).pipe_file("bucket/big.tar", data)
    # every connection closes after 1.5 MiB: only a download that goes on from where it broke
    # can finish (one starting over would get the same 1.5 MiB each time)
    proxy.cut_after = 3 << 19
    proxy.set_mode("cut")
    # s3fs's own retries off (on the instance fsspec caches for these options): what is
    # tested is ringfeed's resume, not s3fs's retry of a broken range
    s3fs.S3FileSystem(**with_timeouts("s3://", options(proxy))).retries = 1
    cache = ShardCache(tmp_path / "cache", storage_options=options(proxy),
                       policy=RetryPolicy(budget_s=60, **QUICK))
    ref = ShardRef("s3://bucket/big.tar", 1, bytes=len(data),
                   sha256=hashlib.sha256(data).hexdigest())
    handle = cache.open(ref)
    try:
        assert handle.file.read() == data
        assert handle.storage.retries >= 2
    finally:
        handle.close()
    counts = proxy.counters()
    assert counts["faults"]["cut"] >= 2 and counts["requests"] >= 3, counts
    # each byte once, but for what was in flight at each cut (the read under way, socket and
    # client buffers: under 1 MiB) and the headers
    lost = counts["faults"]["cut"] * (1 << 20) + counts["requests"] * 2000
    assert counts["bytes_down"] <= len(data) + lost, counts


@pytest.mark.parametrize("mode", ["reset", "stall", "slowdown", "cut"])
def test_each_kind_of_outage_is_waited_out_and_the_data_is_the_same(bucket, proxy, tmp_path,
                                                                   mode, caplog):
    """Promise: Storage outages (train/RECOVERY.md)."""
    endpoint, shards = bucket
    local = collect(pipeline(shards, tmp_path / "unused"))
    proxy.cut_after = 2000
    # longer than s3fs's and botocore's own retries cover (~2-3 s): ringfeed's policy waits
    proxy.outage(mode, 5.0)
    started = time.monotonic()
    pipe = pipeline("s3://bucket/toy", tmp_path / "cache", proxy, retry_budget_s=60)
    assert collect(pipe) == local
    assert time.monotonic() - started >= 4.5  # it did wait for storage
    # s3fs's and botocore's own retries may cover part of it; every wait ringfeed's policy
    # announced is followed by its recovery line
    lines = [r.getMessage() for r in caplog.records if r.name == "ringfeed.storage"]
    failed = [line for line in lines if "recovered" not in line]
    assert len(lines) == 2 * len(failed), lines
    if mode == "slowdown":
        assert proxy.counters()["faults"]["slowdown"] >= 1


def test_an_outage_during_the_epoch_is_counted_in_the_stats(bucket, proxy, tmp_path):
    endpoint, shards = bucket
    local = collect(pipeline(shards, tmp_path / "unused"))
    pipe = pipeline("s3://bucket/toy", tmp_path / "cache", proxy, retry_budget_s=60,
                    prefetch=0)  # the manifest is read now; the shards as the epoch goes
    proxy.outage("reset", 5.0)
    assert collect(pipe) == local
    stats = pipe.stats()
    assert stats["storage_retries"] >= 1 and stats["storage_wait_s"] > 0, stats


def test_a_missing_object_is_named_at_once_and_an_outage_past_the_budget_is_restartable(
        bucket, proxy, tmp_path):
    started = time.monotonic()
    with pytest.raises(PipelineDataError, match=r"s3://bucket/toy/nope\.tar: cannot read "
                                                r"shard after 1 attempt"):
        pipeline(["s3://bucket/toy/nope.tar"], tmp_path / "c1", proxy, retry_budget_s=60)
    assert time.monotonic() - started < 30  # not the budget's 60 s
    proxy.set_mode("reset")
    with pytest.raises(StorageUnavailable, match=r"s3://bucket/toy/manifest\.json: read "
                                                 r"manifest failed for \d+\.\ds, the retry "
                                                 r"budget \(1\.5s\); last error: "):
        pipeline("s3://bucket/toy", tmp_path / "c2", proxy, retry_budget_s=1.5)


# -- training -------------------------------------------------------------------------------
def train_config(tmp_path: Path, name: str, source: str | Path, proxy: FaultProxy | None,
                 **data) -> Path:
    """2 ranks' (or 1 rank's) toy job: one epoch, a checkpoint every 3 steps; a small shuffle
    buffer, so shards are downloaded as the epoch goes (not all before its first batch)."""
    sections = {"data": {"batch_size": 4, "num_workers": 1, "val_split": None,
                         "cache_dir": str(tmp_path / f"{name}-cache"), "prefetch": 1,
                         "shuffle_buffer": 8,
                         "storage_options": options(proxy) if proxy else {}, **data},
                "train": {"epochs": 1, "log_every": 1},
                "checkpoint": {"every_steps": 3, "keep": 3},
                "output": {"dir": str(tmp_path / name), "tensorboard": False}}
    return write_config(tmp_path / f"{name}.yaml",
                        **toy_config(source, tmp_path / name, **sections))


def test_two_ranks_train_through_an_outage_to_the_weights_of_a_run_without_it(
        bucket, proxy, tmp_path):
    """Promise: Storage outages (train/RECOVERY.md)."""
    endpoint, shards = bucket
    hvd2 = [BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", RINGFEED, "train"]
    proxy.bandwidth = 60_000  # the toy epoch's shards take ~10 s to come: the outage lands
    cfg = train_config(tmp_path, "s3", "s3://bucket/toy", proxy)
    # the reference trains while the S3 run waits on its slow link and the outage
    with alongside([*hvd2, train_config(tmp_path, "ref", shards, None)], tmp_path / "ref.log",
                   test_env()) as reference:
        job = start([*hvd2, cfg], env=test_env(**AWS_ENV))
        try:
            assert wait_for(lambda: logged_step(tmp_path / "s3") >= 2, timeout=240), "no step"
            proxy.outage("reset", 5.0)
        finally:
            code, output = finish(job, timeout=300)
        waited(reference, tmp_path / "ref.log", timeout=240)
    assert code == 0, output[-5000:]
    assert "Traceback" not in output
    assert "storage: s3://bucket/toy/" in output and "recovered after" in output, output[-5000:]
    storage = json.loads((tmp_path / "s3" / "summary.json").read_text())["storage"]
    assert storage["retries"] >= 1 and storage["wait_s"] > 0, storage  # summed over ranks
    assert re.search(r"storage +\d+ retried read\(s\) \(\d+ throttled\), \d+\.\ds waiting",
                     output), output[-3000:]
    assert_same_torch_state(torch_final(tmp_path / "ref", STEPS),
                            torch_final(tmp_path / "s3", STEPS))


def test_past_the_budget_exit_75_then_ringfeed_run_finishes_the_job(bucket, proxy, tmp_path):
    """Promise: Storage outages (train/RECOVERY.md)."""
    endpoint, shards = bucket
    reference = run([RINGFEED, "train", train_config(tmp_path, "ref", shards, None)],
                    timeout=240)
    assert reference.returncode == 0, reference.output[-3000:]
    cfg = train_config(tmp_path, "s3", "s3://bucket/toy", proxy, retry_budget_s=1.0)
    proxy.bandwidth = 60_000
    env = test_env(**AWS_ENV)

    # alone: the restartable status and its one line, no traceback
    job = start([RINGFEED, "train", cfg], env=env)
    try:
        assert wait_for(lambda: logged_step(tmp_path / "s3") >= 4, timeout=180), "no step"
        proxy.set_mode("reset")
    finally:
        code, output = finish(job, timeout=120)
    assert code == 75, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("ringfeed: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "ringfeed: storage unavailable: s3://bucket/toy/"), output[-3000:]
    assert "Traceback" not in output and "ringfeed: error:" not in output

    # under `ringfeed run`: relaunched with --resume auto until storage is back, then done
    timer = proxy.outage("reset", 15.0)  # longer than one attempt (s3fs, botocore retry too)
    supervised = run([RINGFEED, "run", "--max-restarts", "5", "--backoff", "2", "--",
                      RINGFEED, "train", cfg, "--resume", "auto"], timeout=300, env=env)
    timer.cancel()
    assert supervised.returncode == 0, supervised.output[-5000:]
    assert "ringfeed run: job failed (exit 75); restart 1/5" in supervised.output
    assert "resumed from" in supervised.output
    assert_same_torch_state(torch_final(tmp_path / "ref", 2 * STEPS),
                            torch_final(tmp_path / "s3", 2 * STEPS))


# -- the README's recipe ----------------------------------------------------------------------
def test_readme_data_in_a_bucket_recipe_runs_as_written(bucket, tmp_path):
    from tabular_util import write_parquet

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Data in a bucket", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    mine = readme.split("## Your own data", 1)[1]
    (config,) = re.findall(r"```bash\n(cat > mine\.yaml.*?EOF\n)```", mine, re.S)
    write_parquet(tmp_path / "table.parquet", "breast_cancer")
    import s3fs

    s3fs.S3FileSystem(endpoint_url=bucket[0]).makedirs("my-bucket", exist_ok=True)
    script = config + re.sub(r"^(ringfeed train .*)$", r"\1 --set train.max_steps=3",
                             block.replace("\\\n", " "), flags=re.M)
    res = run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, timeout=300,
              env=test_env(S3_ENDPOINT=bucket[0], **AWS_ENV))
    assert res.returncode == 0, f"{script}\n{res.output[-4000:]}"
    assert "Traceback" not in res.output and "ringfeed: error" not in res.output
    summary = json.loads((tmp_path / "runs" / "bucket" / "summary.json").read_text())
    assert summary["step"] == 3 and summary["pipeline"]["shards_opened"] > 0
    assert summary["pipeline"]["storage_retries"] == 0  # (counted there; none here)
    assert any("-train-" in p.name for p in (tmp_path / "cache").iterdir())  # downloaded


LOADER_SCRIPT = """
import shutil, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import s3fs
from s3_proxy import FaultProxy, host_port, start_moto
from train_util import write_toy_shards
from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.torch import make_loader
server, endpoint = start_moto()
s3fs.S3FileSystem(endpoint_url=endpoint).put(
    str(write_toy_shards(Path(sys.argv[2]) / "toy")) + "/", "bucket/toy/", recursive=True)
for attempt in range(2):  # the second loader's workers inherit the first's S3 clients
    with FaultProxy(host_port(endpoint)) as proxy:
        pipe = ShardPipeline("s3://bucket/toy", batch_size=4, rank=0, world_size=1,
                             cache_dir=str(Path(sys.argv[2]) / f"cache{attempt}"),
                             num_workers=2, storage_options={"endpoint_url": proxy.url})
        loader = make_loader(pipe)
        for epoch in range(2):
            print("samples", sum(len(b["__index__"]) for b in loader), flush=True)
        del loader, pipe
server.stop()
"""


def test_loader_workers_reading_s3_end_without_a_traceback(tmp_path):
    """Loader workers inherit the parent's S3 clients (connections open, as S3 keeps them)
    and make their own; none is closed with a traceback (s3fs's exit-time closer of an
    inherited client printed 'Task exception was never retrieved ... different loop')."""
    tests = Path(__file__).resolve().parent
    res = run([sys.executable, "-c", LOADER_SCRIPT, str(tests), str(tmp_path)], timeout=180,
              env=test_env(**AWS_ENV))
    assert res.returncode == 0 and res.stdout.count("samples 480") == 4, res.output[-3000:]
    assert "Traceback" not in res.stderr and "never retrieved" not in res.stderr, \
        res.stderr[-3000:]
