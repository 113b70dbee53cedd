"""Where checkpoints live: a local directory or any fsspec URL (`s3://`, `gs://`, ...), behind
one small interface, so train/checkpoint/files.py states the protocol once.

A checkpoint `ckpt-<step>` is a set of files (the framework's payload and `meta.json`, which
holds the sha256 of every payload file). Both stores stage it in a local directory first; what
publishes it differs:

  LocalStore   stages in `<dir>/.ckpt-<step>.tmp-<pid>/`, fsyncs, and renames the directory
               into place: atomic. A killed write leaves only the temporary directory.
  RemoteStore  stages in a local temporary directory (under `<output.dir>/.checkpoint-staging`),
               uploads each payload object under `<dir>/ckpt-<step>/`, then `meta.json` LAST:
               object stores have no rename, and a single PUT is atomic, so the checkpoint is
               complete exactly when its meta.json exists. A killed upload leaves objects
               without a meta.json: incomplete, skipped by a resume and removed by the next run.
               Every call runs under the storage retry policy (ringfeed/remote.py).

Deleting (checkpoint.keep) removes `meta.json` first, so a delete cut short never leaves
something that looks complete. Constructors do no I/O.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any

from ringfeed.fsutil import fsync_path
from ringfeed.remote import RetryPolicy, retrying, with_timeouts

PREFIX = "ckpt-"
META = "meta.json"
NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def step_of(name: str) -> int:
    return int(NAME.match(name).group(1))  # type: ignore[union-attr]


def is_remote(location: str | os.PathLike) -> bool:
    """A URL of a store other than the local file system (`file://` is local)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def local_path(location: str | os.PathLike) -> Path:
    text = str(location)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


class CheckpointStore(ABC):
    """A directory of checkpoints (`url`); checkpoints are addressed by name (`ckpt-<step>`)."""

    url: str

    def location(self, name: str) -> str:
        """The path or URL of checkpoint `name` (what logs and summary.json show)."""
        return f"{self.url.rstrip('/')}/{name}"

    @abstractmethod
    def names(self) -> list[str]:
        """Names of the `ckpt-<step>` entries, complete or not, oldest first."""

    @abstractmethod
    def staging(self, name: str) -> AbstractContextManager[Path]:
        """Context: a local, empty directory to write checkpoint `name` into (removed after)."""

    @abstractmethod
    def upload(self, name: str, staged: Path,
               on_bytes: Callable[[int], None] | None = None) -> None:
        """Make the payload files of `staged` (all but meta.json) durable in the store;
        `on_bytes(n)` hears each n bytes uploaded (the fault plan's byte budget, in tests)."""

    @abstractmethod
    def commit(self, name: str, staged: Path) -> None:
        """Publish `name`: after this it is complete (the rename, or meta.json's PUT)."""

    @abstractmethod
    def discard(self, name: str) -> None:
        """Remove what a failed write of `name` left in the store (best effort)."""

    @abstractmethod
    def read_meta(self, name: str) -> bytes:
        """meta.json of `name`; FileNotFoundError when it has none (incomplete)."""

    @abstractmethod
    def fetch(self, name: str, files: list[str]) -> Path:
        """A local directory holding `files` of `name` (release() it after use)."""

    @abstractmethod
    def release(self, fetched: Path) -> None:
        """Done with a directory fetch() gave."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete checkpoint `name`, meta.json first."""

    @abstractmethod
    def remove_leftovers(self) -> list[str]:
        """Remove what killed writes and deletes left (staging directories, entries without
        meta.json); the names of the incomplete checkpoints removed."""

    @abstractmethod
    def probe(self) -> None:
        """OSError (or StorageUnavailable) when the store cannot take a file."""



def _names_in(entries: list[str]) -> list[str]:
    names = {os.path.basename(e.rstrip("/")) for e in entries}
    return sorted((n for n in names if NAME.match(n)), key=step_of)


class LocalStore(CheckpointStore):
    """Checkpoints in a directory of the local file system (or a shared mount)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = local_path(directory)
        self.url = str(self.directory)

    def location(self, name: str) -> str:
        return str(self.directory / name)

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return _names_in([p.name for p in self.directory.iterdir() if p.is_dir()])

    def _tmp(self, name: str) -> Path:
        return self.directory / f".{name}.tmp-{os.getpid()}"

    @contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        tmp = self._tmp(name)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def upload(self, name: str, staged: Path,
               on_bytes: Callable[[int], None] | None = None) -> None:
        # the files and their directory reach the disk before the rename publishes them
        for p in staged.rglob("*"):
            if p.is_file():
                fsync_path(p)
        fsync_path(staged)

    def commit(self, name: str, staged: Path) -> None:
        final = self.directory / name
        if final.exists():  # the same step saved twice (e.g. a signal on the last step)
            self.delete(name)
        os.replace(staged, final)
        fsync_path(self.directory)

    def discard(self, name: str) -> None:
        """(a failed write leaves nothing but its staging directory, already removed)"""

    def read_meta(self, name: str) -> bytes:
        return (self.directory / name / META).read_bytes()

    def fetch(self, name: str, files: list[str]) -> Path:
        return self.directory / name

    def release(self, fetched: Path) -> None:
        """(fetch() gave the checkpoint itself)"""

    def delete(self, name: str) -> None:
        with suppress(OSError):
            (self.directory / name / META).unlink(missing_ok=True)
        shutil.rmtree(self.directory / name, ignore_errors=True)

    def remove_leftovers(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        for p in self.directory.glob(f".{PREFIX}*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
        incomplete = [n for n in self.names() if not (self.directory / n / META).exists()]
        for name in incomplete:
            shutil.rmtree(self.directory / name, ignore_errors=True)
        return incomplete

    def probe(self) -> None:
        probe = self.directory / f".write-probe-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"ringfeed")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError:
            with suppress(OSError):
                probe.unlink(missing_ok=True)
            raise


class RemoteStore(CheckpointStore):
    """Checkpoints under an fsspec URL (object storage). `staging_root`: the local directory
    that holds checkpoints on their way up and down."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, staging_root: Path,
                 policy: RetryPolicy | None = None):
        self.url = url.rstrip("/")
        self.options = dict(storage_options or {})
        self.staging_root = Path(staging_root)
        self.policy = policy or RetryPolicy()
        self._fs: Any = None
        self._root = ""

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(
                self.url, **with_timeouts(self.url, self.options))
            self._root = self._root.rstrip("/")
        return self._fs

    def _path(self, *parts: str) -> str:
        self.fs  # noqa: B018 - sets _root
        return "/".join([self._root, *parts])

    def _call(self, fn: Callable[[], Any], what: str, *parts: str) -> Any:
        return retrying(fn, self.location("/".join(parts)) if parts else self.url, what,
                        self.policy)

    def names(self) -> list[str]:
        def ls() -> list[str]:
            try:
                return self.fs.ls(self._path(), detail=False, refresh=True)
            except FileNotFoundError:
                return []

        return _names_in(self._call(ls, "list checkpoints"))

    @contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        self.staging_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{name}.up-", dir=self.staging_root))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _remove(self, *parts: str) -> None:
        def rm() -> None:
            with suppress(FileNotFoundError):
                self.fs.rm_file(self._path(*parts))

        self._call(rm, "delete", *parts)

    def upload(self, name: str, staged: Path,
               on_bytes: Callable[[int], None] | None = None) -> None:
        self._remove(name, META)  # the same step saved twice: no longer complete from here
        for file in sorted(p for p in staged.iterdir() if p.is_file() and p.name != META):
            target = self._path(name, file.name)
            self._call(lambda f=file, t=target: self.fs.put_file(
                str(f), t, callback=_upload_progress(on_bytes)), "upload checkpoint", name,
                file.name)

    def commit(self, name: str, staged: Path) -> None:
        target = self._path(name, META)
        self._call(lambda: self.fs.put_file(str(staged / META), target),
                   "upload checkpoint", name, META)

    def discard(self, name: str) -> None:
        with suppress(Exception):
            self.delete(name)

    def read_meta(self, name: str) -> bytes:
        return self._call(lambda: self.fs.cat_file(self._path(name, META)), "read", name, META)

    def fetch(self, name: str, files: list[str]) -> Path:
        self.staging_root.mkdir(parents=True, exist_ok=True)
        local = Path(tempfile.mkdtemp(prefix=f"{name}.down-", dir=self.staging_root))
        try:
            for file in files:
                source = self._path(name, file)
                self._call(lambda s=source, f=file: self.fs.get_file(s, str(local / f)),
                           "download checkpoint", name, file)
        except BaseException:
            self.release(local)
            raise
        return local

    def release(self, fetched: Path) -> None:
        shutil.rmtree(fetched, ignore_errors=True)

    def delete(self, name: str) -> None:
        self._remove(name, META)

        def rm_rest() -> None:
            with suppress(FileNotFoundError):
                self.fs.rm(self._path(name), recursive=True)

        self._call(rm_rest, "delete", name)

    def _objects(self) -> list[str]:
        def find() -> list[str]:
            self.fs.invalidate_cache(self._path())
            try:
                return self.fs.find(self._path())
            except FileNotFoundError:
                return []

        return self._call(find, "list checkpoints")

    def remove_leftovers(self) -> list[str]:
        shutil.rmtree(self.staging_root, ignore_errors=True)  # this run's, or a killed one's
        root = self._path() + "/"
        by_name: dict[str, set[str]] = {}
        for obj in self._objects():
            parts = obj[len(root):].split("/") if obj.startswith(root) else []
            if len(parts) >= 2 and NAME.match(parts[0]):
                by_name.setdefault(parts[0], set()).add(parts[-1])
        incomplete = sorted((n for n, files in by_name.items() if META not in files),
                            key=step_of)
        for name in incomplete:
            self.delete(name)
        return incomplete

    def probe(self) -> None:
        name = f".write-probe-{os.getpid()}"
        self._call(lambda: self.fs.pipe_file(self._path(name), b"ringfeed"), "write", name)
        self._remove(name)


def _upload_progress(on_bytes: Callable[[int], None] | None) -> Any:
    """An fsspec callback that hands each uploaded part's bytes to `on_bytes` (the fault
    plan's byte budget: a kill mid-upload in tests); fsspec's no-op when nothing listens."""
    from fsspec.callbacks import Callback, NoOpCallback

    if on_bytes is None:
        return NoOpCallback()

    class Progress(Callback):
        def relative_update(self, inc: int = 1) -> None:
            on_bytes(inc)

    return Progress()


def open_store(location: str | os.PathLike, storage_options: dict[str, Any] | None = None,
               staging_root: str | os.PathLike | None = None,
               policy: RetryPolicy | None = None) -> CheckpointStore:
    """The store of a checkpoint directory: a local path (or `file://` URL), or any other
    fsspec URL (`staging_root` default: the system's temporary directory)."""
    if not is_remote(location):
        return LocalStore(location)
    root = Path(staging_root) if staging_root is not None else \
        Path(tempfile.gettempdir()) / f"ringfeed-checkpoint-staging-{os.getpid()}"
    return RemoteStore(str(location), storage_options, root, policy)


def parent_and_name(location: str) -> tuple[str, str]:
    """("s3://b/run", "ckpt-000000010") from "s3://b/run/ckpt-000000010/" (paths alike)."""
    text = str(location).rstrip("/")
    parent, _, name = text.rpartition("/")
    return parent or ".", name
