"""`ringfeed shard | verify | inspect` on object storage: OUT (and SRC) may be any fsspec URL
(`s3://bucket/prefix`, `gs://...`), with fsspec options from `--storage-option KEY=VALUE`
(the pipeline's `storage_options`: endpoint_url, key, secret, anon, ...).

Every call to storage goes through `remote_call`, which retries transient failures under the
command's policy (ringfeed/remote.py: backoff within a time budget, `--retry-budget`, then
`StorageUnavailable`, exit 75, "run again"); permanent ones (no such bucket, no access) are one
line naming the URL. S3 requests get the shared bounded timeouts (`with_timeouts`).

`Store` is a folder of objects; `RemoteJournal` is the record of an unfinished run kept in the
bucket beside its shards (`OUT/.ringfeed-journal.jsonl`), so a rerun from any machine finds it;
`fetch_source` brings a remote SRC into the local staging folder (resumably) for the scan.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from ringfeed.errors import UserError
from ringfeed.formats.manifest import ShardInfo
from ringfeed.fsutil import publish, temp_open
from ringfeed.remote import RetryPolicy, retrying, with_timeouts

T = TypeVar("T")

JOURNAL = ".ringfeed-journal.jsonl"  # the same name as the local journal (journal.py)
_MD5_ETAG = re.compile(r'^"?([0-9a-f]{32})(-\d+)?"?$')  # S3: MD5, or multipart "MD5-N"


def is_url(text: str | os.PathLike | None) -> bool:
    """A remote location (`s3://`, `gs://`, `memory://`, ...), not a local path or file://."""
    return text is not None and "://" in str(text) and not str(text).startswith("file://")


def parse_storage_options(specs: list[str]) -> dict[str, Any]:
    """`--storage-option KEY=VALUE`s as fsspec keyword arguments: a VALUE that is JSON (true,
    3, {"region_name": "eu-west-1"}) is taken as such, else as a string."""
    options: dict[str, Any] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise UserError(f"--storage-option {spec!r}: expected KEY=VALUE, e.g. "
                            "--storage-option endpoint_url=http://127.0.0.1:9000")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def retry_policy(budget_s: float | None) -> RetryPolicy:
    """`--retry-budget`: how long one storage call of the command may keep failing transiently
    before it stops with exit 75 (None: ringfeed/remote.py's default)."""
    if budget_s is None:
        return RetryPolicy()
    if budget_s <= 0:
        raise UserError(f"--retry-budget {budget_s}: must be more than 0 seconds")
    return RetryPolicy(budget_s=budget_s)


def remote_call(fn: Callable[[], T], url: str, what: str, policy: RetryPolicy) -> T:
    """`fn()`, a call to storage about `url` (`what`: "upload", "list", ...), retried while it
    fails transiently under the command's `policy` (StorageUnavailable, exit 75, once its
    budget is spent). The one place this package calls storage through."""
    return retrying(fn, url, what, policy)


def storage_call(fn: Callable[[], T], url: str, what: str, policy: RetryPolicy) -> T:
    """`remote_call` for a URL; a local path's call runs once (a local error is not
    transient)."""
    return remote_call(fn, url, what, policy) if is_url(url) else fn()


@contextmanager
def storage_defaults(urls: str | os.PathLike | list[str], options: dict[str, Any]
                     ) -> Iterator[None]:
    """While inside: `options` are fsspec's defaults for the protocols of `urls` (OUT, and
    shards a manifest names by URL), so readers that open shards by URL alone
    (ringfeed.formats.tarread) reach the same bucket with the same credentials and endpoint (and
    bounded timeouts). Nothing changes for local paths."""
    conf = fsspec.config.conf
    saved: dict[str, Any] = {}
    given = [urls] if isinstance(urls, (str, os.PathLike)) else urls
    for url in {str(u).split("://", 1)[0]: str(u) for u in given if is_url(u)}.values():
        try:
            cls = fsspec.get_filesystem_class(url.split("://", 1)[0])
        except ValueError:  # an unknown protocol: opening it says so
            continue
        for p in (cls.protocol,) if isinstance(cls.protocol, str) else tuple(cls.protocol):
            saved.setdefault(p, conf.get(p))
            conf[p] = {**(conf.get(p) or {}), **with_timeouts(url, options)}
    try:
        yield
    finally:
        for p, value in saved.items():
            if value is None:
                conf.pop(p, None)
            else:
                conf[p] = value


def version_of(info: dict[str, Any]) -> str | None:
    """What changes whenever an object is written again: its ETag (S3), md5Hash/generation
    (GCS), ... None where the filesystem tells none."""
    for key in ("ETag", "etag", "md5Hash", "generation", "checksum"):
        if info.get(key) not in (None, ""):
            return str(info[key])
    return None


def mtime_ns_of(info: dict[str, Any]) -> int:
    """An object's last-modified time in ns (0 when the filesystem tells none)."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)):
            return int(value * 1e9)
        if isinstance(value, str):
            try:
                return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    return 0


def s3_etag(path: Path, part_size: int | None = None) -> str:
    """The ETag S3 gives a file uploaded in one PUT (its MD5), or in parts of `part_size`
    bytes (the MD5 of the parts' MD5s, then `-<number of parts>`)."""
    digests: list[bytes] = []
    with open(path, "rb") as f:
        while True:
            h, n = hashlib.md5(usedforsecurity=False), 0
            while part_size is None or n < part_size:
                block = f.read(1 << 20 if part_size is None else min(1 << 20, part_size - n))
                if not block:
                    break
                h.update(block)
                n += len(block)
            if part_size is None:
                return h.hexdigest()
            if n == 0:
                break
            digests.append(h.digest())
            if n < part_size:
                break
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def expected_etag(path: Path, etag: str) -> str | None:
    """What `etag` must be if the object holds `path`'s bytes: None where that cannot be told
    (not an S3 ETag; a multipart upload in parts of another size than s3fs's)."""
    match = _MD5_ETAG.match(etag)
    if not match:
        return None
    if not match.group(2):
        return s3_etag(path)
    try:
        from s3fs.core import calculate_chunksize
    except ImportError:
        return None
    size, parts = path.stat().st_size, int(match.group(2)[1:])
    part_size = calculate_chunksize(size)
    if -(-size // part_size) != parts:
        return None
    return s3_etag(path, part_size)


class Store:
    """The objects under one URL (a bucket prefix), named relative to it; every call retried
    under `policy` (default: ringfeed/remote.py's)."""

    def __init__(self, url: str, storage_options: dict[str, Any],
                 policy: RetryPolicy | None = None):
        self.url = url.rstrip("/")
        self.policy = policy or RetryPolicy()
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url,
                                                  **with_timeouts(self.url, storage_options))
        except (ImportError, ValueError, TypeError) as e:
            raise UserError(f"{url}: cannot open this location ({e}); check the URL and "
                            "--storage-option") from None
        self.root = root.rstrip("/")

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def call(self, fn: Callable[[], T], name: str, what: str) -> T:
        """`fn()` through the retry policy; a permanent failure is one line naming the URL."""
        url = self.url_of(name) if name else self.url
        try:
            return remote_call(fn, url, what, self.policy)
        except UserError:
            raise
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{url}: not found ({what})") from e
        except PermissionError as e:
            raise UserError(f"{url}: no permission to {what} ({e}); check the credentials "
                            "(--storage-option key=... secret=...)") from e
        except TypeError as e:  # fsspec connects lazily: an unknown option fails here
            raise UserError(f"{url}: cannot {what} ({e}); check --storage-option") from e
        except OSError as e:
            raise UserError(f"{url}: {what} failed ({e})") from e

    def list(self) -> dict[str, dict[str, Any]]:
        """{name relative to the URL: its info (size, ETag, ...)} of every object below it."""
        def find() -> dict[str, Any]:
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                return {}
        found = self.call(find, "", "list")
        prefix = self.root + "/"
        return {path[len(prefix):]: info for path, info in found.items()
                if path.startswith(prefix) and info.get("type", "file") != "directory"}

    def check_bucket(self) -> None:
        """Fail early, before a long scan, where the URL's bucket (its first part) is not
        there; a store that cannot tell (no permission to look) is given the benefit."""
        bucket = self.root.split("/", 1)[0]
        if not bucket:
            return
        try:
            there = self.call(lambda: self.fs.exists(bucket), "", "look up its bucket")
        except UserError:
            return
        if not there:
            protocol = self.url.split("://", 1)[0]
            raise UserError(f"{protocol}://{bucket}: no such bucket (create it, or check the "
                            "URL and --storage-option endpoint_url)")

    def info(self, name: str) -> dict[str, Any]:
        path = self._path(name)

        def info() -> dict[str, Any]:
            self.fs.invalidate_cache(path)
            return self.fs.info(path)
        return self.call(info, name, "read its size")

    def is_file(self) -> bool:
        """Whether the URL itself names one object (not a prefix of several)."""
        return self.call(lambda: self.fs.isfile(self.root), "", "look it up")

    def read(self, name: str) -> bytes:
        return self.call(lambda: self.fs.cat_file(self._path(name)), name, "read")

    def write(self, name: str, data: bytes) -> None:
        """One PUT: the object is all there or absent (and replaced whole)."""
        self.call(lambda: self.fs.pipe_file(self._path(name), data), name, "write")

    def upload(self, local: Path, name: str) -> dict[str, Any]:
        """Upload a local file as object `name` (a PUT, or a multipart upload that appears
        whole on completion) and check it: its size, and its bytes where the ETag is their MD5
        (S3's ETag: the MD5 of a single PUT, of the parts' MD5s of a multipart upload). The
        object's info."""
        size = local.stat().st_size

        def put_and_check() -> dict[str, Any]:
            self.fs.put_file(str(local), self._path(name))
            self.fs.invalidate_cache(self._path(name))
            info = self.fs.info(self._path(name))
            if info.get("size") != size:
                raise UploadMismatch(f"{info.get('size')} bytes stored, {size} sent")
            etag = str(info.get("ETag", "")).strip('"')
            expected = expected_etag(local, etag)
            if expected is not None and expected != etag:
                raise UploadMismatch(f"its ETag {etag} is not {expected}, the MD5 of the bytes "
                                     "sent")
            return info
        try:
            return self.call(put_and_check, name, "upload")
        except UploadMismatch as e:
            raise UserError(f"{self.url_of(name)}: the uploaded object differs from the shard "
                            f"written ({e}); run the same command again") from e

    def remove(self, names: list[str]) -> None:
        if names:
            self.call(lambda: self.fs.rm([self._path(n) for n in names]), names[0], "delete")

    def download(self, name: str, local: Path) -> None:
        self.call(lambda: self.fs.get_file(self._path(name), str(local)), name, "download")


class UploadMismatch(OSError):
    """An uploaded object is not what was sent (retried like a transient failure)."""


class RemoteJournal:
    """`OUT/.ringfeed-journal.jsonl` in the bucket: the local journal's lines (journal.py), each
    shard's also with the ETags its tar and sidecar were stored with, so a rerun keeps an
    object only while it is the one this run uploaded. Objects cannot be appended to: the whole
    journal is written again (one small PUT) after each uploaded shard."""

    def __init__(self, store: Store, name: str = JOURNAL):
        self.store = store
        self.name = name  # a part of a run (parts.py) has its own
        self.lines: list[str] = []

    def read(self, listing: dict[str, dict[str, Any]]
             ) -> tuple[str | None, dict[str, tuple[ShardInfo, str | None, str | None]]]:
        """(plan fingerprint, {name: (info, tar version, sidecar version)})."""
        if self.name not in listing:
            return None, {}
        try:
            text = self.store.read(self.name).decode()
        except FileNotFoundError:
            return None, {}
        plan, done = None, {}
        for number, line in enumerate(text.splitlines()):
            try:
                entry = json.loads(line)
                if number == 0:
                    plan = entry["plan"]
                else:
                    tar, index = entry.pop("version"), entry.pop("index_version")
                    done[entry["name"]] = (ShardInfo(**entry), tar, index)
            except (ValueError, KeyError, TypeError):
                continue
        return plan, done

    def start(self, plan: str, kept: dict[str, tuple[ShardInfo, str | None, str | None]]) -> None:
        self.lines = [json.dumps({"plan": plan})]
        for info, tar, index in kept.values():
            self.lines.append(self._line(info, tar, index))
        self._write()

    def record(self, info: ShardInfo, tar: str | None, index: str | None) -> None:
        self.lines.append(self._line(info, tar, index))
        self._write()

    @staticmethod
    def _line(info: ShardInfo, tar: str | None, index: str | None) -> str:
        return json.dumps({**asdict(info), "version": tar, "index_version": index})

    def _write(self) -> None:
        self.store.write(self.name, ("\n".join(self.lines) + "\n").encode())

    def remove(self) -> None:
        self.store.remove([self.name])


def fetch_source(url: str, storage_options: dict[str, Any], into: Path,
                 policy: RetryPolicy | None = None) -> Path:
    """Bring SRC `url` (an object or a prefix of objects) into local folder `into`, as
    `into/<its last name>`; an object already there with the remote size and modification time
    is not fetched again, so a rerun after a kill fetches only what it lacks. Each local copy
    gets its object's modification time, so the plan (keyed by sizes and mtimes) is the same
    for every rerun while the source is unchanged. Hidden objects (`.name`) are skipped."""
    store = Store(url, storage_options, policy)
    target = into / (posixpath.basename(store.root) or "src")
    if store.is_file():
        objects = {"": store.info("")}
    else:
        objects = {name: info for name, info in store.list().items()
                   if not any(part.startswith(".") for part in name.split("/"))}
        if not objects:
            raise UserError(f"{url}: no such object or prefix (nothing listed under it)")
    if objects.keys() != {""} and target.is_dir():  # objects deleted since the last fetch
        for old in [p for p in target.rglob("*") if p.is_file()]:
            if old.relative_to(target).as_posix() not in objects:
                old.unlink()
    for name, info in sorted(objects.items()):
        local = target / name if name else target
        size, mtime = int(info.get("size") or 0), mtime_ns_of(info)
        if local.is_file():
            st = local.stat()
            if st.st_size == size and st.st_mtime_ns == mtime:
                continue
        with temp_open(local, "wb") as (_, tmp):
            pass
        try:
            store.download(name, tmp)
            os.utime(tmp, ns=(mtime, mtime))
            publish(tmp, local)
            os.utime(local, ns=(mtime, mtime))
        finally:
            tmp.unlink(missing_ok=True)
    return target


def default_staging(out: str, src: str) -> Path:
    """The local folder a remote run works in, the same for every rerun of one command:
    `$XDG_CACHE_HOME/ringfeed/shard/<hash of OUT and SRC>` (~/.cache when unset)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(f"{out}\0{src}".encode()).hexdigest()[:16]
    return cache / "ringfeed" / "shard" / key
