"""`ringfeed shard | verify | inspect` on object storage, against moto's S3 server on 127.0.0.1:
shards written to s3:// are the bytes of a local run (manifest included), remote sources shard
as their local copies do, a run killed with SIGKILL mid-upload resumes to the same bytes and
shows no manifest.json before it is complete, and verify/inspect read a bucket."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from helpers import BIN, ringfeed, test_env
from s3_proxy import start_moto
from shards_util import cli, tree_bytes

pytestmark = pytest.mark.integration

JSONL_ARGS = ["--format", "jsonl", "--field", "text=txt", "--field", "label=cls",
              "--val-fraction", "0.2", "--shuffle-seed", "3"]


@pytest.fixture(scope="module")
def s3():
    """(endpoint, s3fs filesystem, --storage-option flags) of a moto server with a bucket."""
    pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server, endpoint = start_moto(set_env=False)
    try:
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("bucket")
        flags = [f for k, v in options.items() for f in ("--storage-option", f"{k}={v}")]
        yield endpoint, fs, flags
    finally:
        server.stop()


def s3_env() -> dict[str, str]:
    return test_env(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                    AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")


def bucket_tree(fs, prefix: str) -> dict[str, bytes]:
    """Every object under s3://bucket/PREFIX (name relative to it -> content)."""
    fs.invalidate_cache()
    root = f"bucket/{prefix}/"
    return {path[len(root):]: fs.cat_file(path) for path in fs.find(root)}


def jsonl(path, rows: int):
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"text": f"row {i} " + "x" * (i % 17), "label": i % 3,
                                "a": i * 0.5, "b": i % 7}) + "\n")
    return path


@pytest.mark.timeout(120)
def test_shard_to_s3_is_the_local_bytes_and_verify_inspect_read_it(capsys, tmp_path, s3):
    _, fs, flags = s3
    src = jsonl(tmp_path / "t.jsonl", 90)
    args = [*JSONL_ARGS, "--max-count", "8"]
    assert cli(capsys, "shard", src, tmp_path / "local", *args)[0] == 0
    staging = tmp_path / "staging"
    code, out, err = cli(capsys, "shard", src, "s3://bucket/one", *args, *flags,
                         "--staging", staging, "--workers", "2")
    assert code == 0, err
    assert "-> s3://bucket/one/manifest.json" in out
    local = tree_bytes(tmp_path / "local")
    assert bucket_tree(fs, "one") == local  # shards, sidecars, manifest.json and manifest.bin
    assert not staging.exists()  # nothing left behind locally

    code, out, _ = cli(capsys, "verify", "s3://bucket/one", *flags)
    assert code == 0 and "12 shards, 90 samples" in out and "all OK" in out
    code, out, _ = cli(capsys, "inspect", "s3://bucket/one", *flags)
    assert code == 0
    assert "s3://bucket/one/manifest.json: jsonl" in out and "total: 90 samples in 12 shards" in out
    assert "classes in train (3)" in out and "first samples of val (val-000000.tar)" in out

    # a second run refuses the full prefix, --overwrite replaces it with the same bytes
    code, _, err = cli(capsys, "shard", src, "s3://bucket/one", *args, *flags)
    assert code == 2 and "already holds shards (manifest.json)" in err
    assert cli(capsys, "shard", src, "s3://bucket/one", *args, *flags, "--staging", staging,
               "--overwrite")[0] == 0
    assert bucket_tree(fs, "one") == local

    # a damaged object and a stray one: verify names both
    fs.pipe_file("bucket/one/train-000001.tar", local["train-000001.tar"][:-1024])
    fs.pipe_file("bucket/one/stray-000000.tar", b"\0" * 1024)
    code, out, _ = cli(capsys, "verify", "s3://bucket/one", *flags)
    assert code == 2
    assert "BAD train/train-000001.tar:" in out and "stray-000000.tar" in out
    code, _, err = cli(capsys, "shard", src, "s3://nobucket/one", *args, *flags)
    assert code == 2 and "s3://nobucket: no such bucket" in err, err
    code, _, err = cli(capsys, "verify", "s3://bucket/none", *flags)
    assert code == 2 and "s3://bucket/none/manifest.json: no manifest.json" in err


@pytest.mark.timeout(120)
def test_shard_from_s3_sources(capsys, tmp_path, s3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, fs, flags = s3
    src = jsonl(tmp_path / "t.jsonl", 60)
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    table = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table, row_group_size=16)
    fs.put_file(str(src), "bucket/src/t.jsonl")
    fs.put_file(str(table), "bucket/src/t.parquet")
    for name in ("t.jsonl", "t.parquet"):
        fmt = ["--format", name.split(".")[1], *JSONL_ARGS[2:], "--max-count", "8"]
        local, remote = tmp_path / f"local-{name}", tmp_path / f"remote-{name}"
        assert cli(capsys, "shard", tmp_path / name, local, *fmt)[0] == 0
        code, _, err = cli(capsys, "shard", f"s3://bucket/src/{name}", remote, *fmt, *flags,
                           "--staging", tmp_path / "staging")
        assert code == 0, err
        expected, got = tree_bytes(local), tree_bytes(remote)
        assert {n for n in expected if n.endswith(".tar")} == {n for n in got if n.endswith(".tar")}
        assert {n: b for n, b in got.items() if not n.startswith("manifest")} == {
            n: b for n, b in expected.items() if not n.startswith("manifest")}
        manifest = json.loads(got["manifest.json"])
        assert manifest["source"]["path"] == f"s3://bucket/src/{name}"  # not the local copy
        manifest["source"]["path"] = str(tmp_path / name)
        assert manifest == json.loads(expected["manifest.json"])
        assert not (tmp_path / "staging").exists()  # the fetched copy is removed

    # both ends in the bucket: the Parquet file's shards again, now as objects
    code, _, err = cli(capsys, "shard", "s3://bucket/src/t.parquet", "s3://bucket/fromparquet",
                       "--format", "parquet", *JSONL_ARGS[2:], "--max-count", "8", *flags,
                       "--staging", tmp_path / "staging2")
    assert code == 0, err
    got = bucket_tree(fs, "fromparquet")
    expected = tree_bytes(tmp_path / "remote-t.parquet")
    assert got == expected
    code, _, err = cli(capsys, "shard", "s3://bucket/src", "s3://bucket/src/shards",
                       "--format", "jsonl", *flags)
    assert code == 2 and "is inside SRC" in err
    code, _, err = cli(capsys, "shard", "s3://bucket/src/none.jsonl", tmp_path / "x",
                       "--format", "jsonl", *flags, "--staging", tmp_path / "staging3")
    assert code == 2 and "s3://bucket/src/none.jsonl" in err


@pytest.mark.system  # starts the CLI, kills it
@pytest.mark.timeout(240)
def test_kill_9_mid_upload_then_rerun_is_byte_identical(capsys, tmp_path, s3):
    _, fs, flags = s3
    src = jsonl(tmp_path / "t.jsonl", 240)
    args = [*JSONL_ARGS, "--max-count", "2"]  # 120 shards: the kill lands mid-run
    assert cli(capsys, "shard", src, tmp_path / "reference", *args)[0] == 0
    expected = tree_bytes(tmp_path / "reference")
    staging = tmp_path / "staging"
    command = ["shard", str(src), "s3://bucket/killed", *args, *flags, "--staging", str(staging)]

    def journal() -> list[dict]:
        fs.invalidate_cache()
        try:
            text = fs.cat_file("bucket/killed/.ringfeed-journal.jsonl").decode()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines()[1:]]

    proc = subprocess.Popen([str(BIN / "ringfeed"), *command], env=s3_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(journal()) >= 3:  # a few shards are uploaded and recorded
                break
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    done = journal()
    assert 3 <= len(done) < 120, "the kill should land mid-run"
    left = bucket_tree(fs, "killed")
    assert "manifest.json" not in left and "manifest.bin" not in left  # not complete
    for name, data in left.items():  # every object there is whole
        assert name == ".ringfeed-journal.jsonl" or data == expected[name]

    result = ringfeed(*command, timeout=120, env=s3_env())
    assert result.returncode == 0, result.output
    assert f"kept {len(done)} finished shard(s)" in result.stdout
    assert bucket_tree(fs, "killed") == expected  # no journal left either
    assert not staging.exists()


@pytest.mark.timeout(120)
def test_wds_index_of_a_bucket_of_shards(capsys, tmp_path, s3):
    _, fs, flags = s3
    src = jsonl(tmp_path / "t.jsonl", 40)
    assert cli(capsys, "shard", src, tmp_path / "local", *JSONL_ARGS, "--max-count", "8")[0] == 0
    local = tree_bytes(tmp_path / "local")
    for name, data in local.items():
        if name.endswith(".tar"):
            fs.pipe_file(f"bucket/wds/{name}", data)
    # OUT defaults to SRC: the manifest and sidecars go beside the shards in the bucket
    code, out, err = cli(capsys, "shard", "s3://bucket/wds", "--format", "wds-index", *flags)
    assert code == 0, err
    assert "-> s3://bucket/wds/manifest.json" in out
    got = bucket_tree(fs, "wds")
    assert {n: b for n, b in got.items() if n.endswith((".tar", ".idx"))} == {
        n: b for n, b in local.items() if n.endswith((".tar", ".idx"))}
    manifest = json.loads(got["manifest.json"])
    assert manifest["source"]["path"] == "s3://bucket/wds"
    assert [s["name"] for s in manifest["splits"]["val"]["shards"]] == ["val-000000.tar"]
    code, out, _ = cli(capsys, "verify", "s3://bucket/wds", *flags)
    assert code == 0 and "all OK" in out
    code, _, err = cli(capsys, "shard", "s3://bucket/wds", "--format", "wds-index", *flags)
    assert code == 2 and "manifest.json exists" in err
    # a local manifest for the bucket's shards names them by URL
    code, _, err = cli(capsys, "shard", "s3://bucket/wds/train-{000000..000003}.tar",
                       tmp_path / "idx", "--format", "wds-index", *flags)
    assert code == 0, err
    names = [s["name"] for s in json.loads((tmp_path / "idx" / "manifest.json").read_text())[
        "splits"]["train"]["shards"]]
    assert names == [f"s3://bucket/wds/train-00000{i}.tar" for i in range(4)]
    code, out, _ = cli(capsys, "verify", tmp_path / "idx", *flags)  # its shards in the bucket
    assert code == 0 and "4 shards" in out and "all OK" in out


@pytest.mark.timeout(60)
def test_uploads_are_checked_against_s3s_etag(tmp_path, s3):
    """The ETag an upload is checked against is the one S3 computes, single-part and
    multipart (the MD5 of the parts' MD5s)."""
    from ringfeed.shards.remote import s3_etag

    _, fs, _ = s3
    data = os.urandom(11 << 20)
    (tmp_path / "f").write_bytes(data)
    fs.put_file(str(tmp_path / "f"), "bucket/etag/multi", chunksize=5 << 20)  # 5+5+1 MiB
    fs.put_file(str(tmp_path / "f"), "bucket/etag/single")
    assert fs.info("bucket/etag/multi")["ETag"].strip('"') == s3_etag(tmp_path / "f", 5 << 20)
    assert s3_etag(tmp_path / "f", 5 << 20).endswith("-3")
    assert fs.info("bucket/etag/single")["ETag"].strip('"') == s3_etag(tmp_path / "f")


@pytest.mark.timeout(120)
def test_unreachable_storage_is_exit_75_after_the_retry_budget(capsys, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = ["--storage-option", f"endpoint_url=http://127.0.0.1:{port}", "--storage-option",
             "key=testing", "--storage-option", "secret=testing", "--retry-budget", "1",
             # no retries inside botocore, so each failing call returns sooner
             "--storage-option", 'config_kwargs={"retries": {"max_attempts": 1}}']
    code, _, err = cli(capsys, "verify", "s3://bucket/one", *flags)
    assert code == 75 and "storage unavailable" in err and "s3://bucket/one" in err, err
    src = jsonl(tmp_path / "t.jsonl", 10)
    code, _, err = cli(capsys, "shard", src, "s3://bucket/one", *JSONL_ARGS, *flags,
                       "--staging", tmp_path / "staging")
    assert code == 75 and "storage unavailable" in err, err
    code, _, err = cli(capsys, "verify", "s3://bucket/one", *flags,
                       "--storage-option", "no_such_option=1")
    assert code == 2 and "check --storage-option" in err and "\n" not in err.strip(), err


@pytest.mark.timeout(120)
def test_shard_to_s3_rides_out_throttling_and_connection_resets(capsys, tmp_path, s3):
    """Through a real fault proxy: 503 SlowDown, then connection resets, in the middle of the
    uploads, each until the run has met it twice; the run waits them out (the shared retry
    policy; botocore's own retries are off here, so each fault reaches it), its 2 writers wait
    for the uploads (the staging folder holds a few shards, not all 60), and the bytes are
    unchanged."""
    import threading

    s3_proxy = pytest.importorskip("s3_proxy")
    endpoint, fs, _ = s3
    src = jsonl(tmp_path / "t.jsonl", 60)
    args = [*JSONL_ARGS, "--max-count", "1"]  # 60 shards
    assert cli(capsys, "shard", src, tmp_path / "local", *args)[0] == 0
    stop = threading.Event()
    with s3_proxy.FaultProxy(s3_proxy.host_port(endpoint)) as proxy:
        def seen(kind: str, count: int) -> None:
            while not stop.is_set() and proxy.counters()["faults"][kind] < count:
                time.sleep(0.01)

        def faults() -> None:  # a few PUTs in: 503 SlowDown, then resets, then none
            while not stop.is_set() and proxy.counters()["methods"].get("PUT", 0) < 6:
                time.sleep(0.01)
            proxy.set_mode("slowdown")  # until the run has met it twice
            seen("slowdown", 2)
            proxy.set_mode("reset")
            seen("reset", 2)
            proxy.set_mode("pass")

        on_disk = [0]  # the most shards (finished or being written) seen in the staging folder

        def count() -> None:
            shard = re.compile(r"^\.?\w+-\d{6}\.tar(\.\w+\.tmp)?$")
            while not stop.is_set():
                names = os.listdir(staging) if staging.is_dir() else []
                on_disk[0] = max(on_disk[0], sum(bool(shard.match(n)) for n in names))
                time.sleep(0.005)

        staging = tmp_path / "staging"
        watcher = threading.Thread(target=faults, daemon=True)
        counter = threading.Thread(target=count, daemon=True)
        watcher.start()
        counter.start()
        try:
            code, _, err = cli(capsys, "shard", src, "s3://bucket/outage", *args,
                               "--storage-option", f"endpoint_url={proxy.url}",
                               "--storage-option", "key=testing", "--storage-option",
                               "secret=testing", "--storage-option",
                               'config_kwargs={"retries": {"max_attempts": 1}}',
                               "--staging", staging, "--workers", "2")
        finally:
            stop.set()
            watcher.join(timeout=10)
            counter.join(timeout=10)
        faults_seen = proxy.counters()["faults"]
    assert code == 0, err
    assert faults_seen["slowdown"] >= 2 and faults_seen["reset"] >= 2, faults_seen
    assert 1 <= on_disk[0] <= 2 + 5  # while uploads wait, the writers wait too (--workers + 5)
    assert bucket_tree(fs, "outage") == tree_bytes(tmp_path / "local")
