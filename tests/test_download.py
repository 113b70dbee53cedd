"""Downloading one remote shard (pipeline/download.py), from fsspec's in-memory store: streamed
into a temp file and renamed, checked against the manifest's size and sha256, nothing left
behind on a mismatch, and a transfer broken by a storage fault resumed at the byte where it
stopped (or started over where the store cannot seek). Against S3 and HTTP servers with
faults: test_storage_faults.py and test_remote.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fsspec
import numpy as np
import pytest

from ringfeed.pipeline import download as dl
from ringfeed.pipeline.download import ChecksumMismatch, download, resumable
from ringfeed.pipeline.source import ShardRef
from ringfeed.remote import RetryCounts, RetryPolicy

DATA = np.random.default_rng(0).bytes(3 * dl.DOWNLOAD_CHUNK + 123)
FAST = RetryPolicy(budget_s=5, first_backoff_s=0.001, max_backoff_s=0.001)


@pytest.fixture
def url(tmp_path: Path):
    url = f"memory://dl-{tmp_path.name}/train-000000.tar"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(url, DATA)
    yield url
    fs.rm(f"memory://dl-{tmp_path.name}", recursive=True)


def ref(url: str, **kw) -> ShardRef:
    return ShardRef(url, 10, **{"bytes": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest(),
                                **kw})


def test_a_shard_is_downloaded_whole_and_checked(tmp_path, url):
    path = tmp_path / "cache" / "train-000000.tar"
    counts = RetryCounts()
    assert download(ref(url), path, {}, FAST, counts) == len(DATA)
    assert path.read_bytes() == DATA and counts.retries == 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize("kw, message", [
    ({"bytes": len(DATA) + 1}, f"expected {len(DATA) + 1} bytes, the object holds {len(DATA)}"),
    ({"sha256": "0" * 64}, "expected sha256 000000000000..., got"),
])
def test_bytes_that_are_not_the_manifests_are_refused_and_nothing_is_left(tmp_path, url, kw,
                                                                          message):
    path = tmp_path / "train-000000.tar"
    path.write_bytes(b"an older copy")
    with pytest.raises(ChecksumMismatch, match=message):
        download(ref(url, **kw), path, {}, FAST, RetryCounts())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert path.read_bytes() == b"an older copy"  # untouched


class Breaking:
    """The store's stream of `source`, failing after `after` bytes the first `times` times it
    is opened (a connection reset mid-body), as a flaky network does."""

    def __init__(self, source: str, times: int, after: int):
        self.source, self.times, self.after = source, times, after
        self.opened_at: list[int] = []

    def open(self, url, options, offset=0):
        self.opened_at.append(offset)
        stream = fsspec.open(self.source, "rb").open()
        stream.seek(offset)
        broken = len(self.opened_at) <= self.times
        limit = self.after

        class Stream:
            size = len(DATA)

            def read(self, n):
                nonlocal limit
                if broken and limit <= 0:
                    raise ConnectionResetError(104, "Connection reset by peer")
                chunk = stream.read(min(n, limit) if broken else n)
                limit -= len(chunk)
                return chunk

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                stream.close()

        return Stream()


def test_a_broken_transfer_resumes_where_it_stopped(tmp_path, url, monkeypatch):
    store = Breaking(url, times=2, after=dl.DOWNLOAD_CHUNK + 7)
    monkeypatch.setattr(dl, "open_remote", store.open)
    counts = RetryCounts()
    path = tmp_path / "x.tar"
    assert download(ref(url), path, {}, FAST, counts) == len(DATA)
    assert path.read_bytes() == DATA
    assert store.opened_at == [0, dl.DOWNLOAD_CHUNK + 7, 2 * (dl.DOWNLOAD_CHUNK + 7)]
    assert counts.retries == 2


def test_where_the_store_cannot_seek_a_broken_transfer_starts_over(tmp_path, url, monkeypatch):
    store = Breaking(url, times=1, after=1000)  # served as a plain HTTP server would
    monkeypatch.setattr(dl, "open_remote", store.open)
    path = tmp_path / "x.tar"
    assert download(ref("http://127.0.0.1:1/x.tar"), path, {}, FAST, RetryCounts()) == len(DATA)
    assert store.opened_at == [0, 0] and path.read_bytes() == DATA


@pytest.mark.parametrize("url, can", [
    ("s3://b/x.tar", True), ("gs://b/x.tar", True), ("memory://b/x.tar", True),
    ("http://h/x.tar", False), ("https://h/x.tar", False), ("pipe:curl -s x", False),
])
def test_which_stores_a_transfer_can_resume_from_an_offset(url, can):
    assert resumable(url) is can
