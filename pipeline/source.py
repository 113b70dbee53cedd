"""Resolve a pipeline source (a shard directory/URL with manifest.json, or shard URLs) into
an ordered list of `ShardRef`s with sample counts.

A split of flat token shards (ringfeed/formats/tokens.py) read with a `seq_len` is seen as
windows (`windowed`): a shard's sample count is its window count, from the manifest's tokens.

Sample counts drive all planning (rank balance, resume), so they are needed before any data is
read: they come from the manifest when there is one (its memory-mapped binary index, so a
10^6-shard manifest costs a rank milliseconds, not a JSON parse); for a bare list of shard URLs
they are learned by one counting pass over the shards (through the cache, so remote shards are
fetched once and reused by the epochs that follow).
"""

from __future__ import annotations

import functools
import os
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import braceexpand
import numpy as np

from ringfeed.formats.manifest import MANIFEST_NAME, Manifest, ManifestError
from ringfeed.formats.manifest_index import SplitIndex, index_of_bytes, load_index
from ringfeed.formats.tarread import TAR_SUFFIXES
from ringfeed.formats.tokens import FLAT, window_count
from ringfeed.pipeline.errors import PipelineError
from ringfeed.remote import RetryPolicy, read_url, retrying


@dataclass(frozen=True)
class Windows:
    """A flat token shard (ringfeed/formats/tokens.py) read as windows of seq_len + 1 tokens:
    its samples are windows, not tar samples."""

    tokens: int  # the shard's tokens (the manifest's shard_tokens)
    seq_len: int
    random: bool  # from an offset drawn per (seed, epoch, shard), else packed from 0

    @property
    def count(self) -> int:
        return int(window_count(self.tokens, self.seq_len, self.random))


@dataclass(frozen=True)
class ShardRef:
    """One shard: where it is, how many samples it holds, and what the manifest says about it."""

    url: str
    num_samples: int
    bytes: int | None = None
    sha256: str | None = None
    index: str | None = None  # the tar index sidecar `ringfeed shard` wrote, if any
    windows: Windows | None = None  # a flat token shard read as windows (num_samples: 1)

    @property
    def is_local(self) -> bool:
        return is_local_url(self.url)


def is_local_url(url: str) -> bool:
    return url.startswith("file:") or "://" not in url and not url.startswith("pipe:")


def local_path(url: str) -> str:
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    return url


def check_pipe_allowed(urls: Sequence[str], allow_pipe: bool) -> None:
    for url in urls:
        if url.startswith("pipe:") and not allow_pipe:
            raise PipelineError(
                f"{url}: pipe: URLs run shell commands and are refused "
                "(pass allow_pipe=True if you trust this source)"
            )


def expand_urls(source: str | Sequence[str]) -> list[str]:
    """A brace pattern ('shards/train-{000000..000009}.tar') or a list of them -> URLs."""
    patterns = [source] if isinstance(source, str) else list(source)
    urls: list[str] = []
    for pattern in patterns:
        urls.extend(braceexpand.braceexpand(str(pattern)))
    return urls


def is_shard_list(source: str | Sequence[str | os.PathLike]) -> bool:
    if not isinstance(source, (str, os.PathLike)):
        return True
    text = str(source)
    return text.startswith("pipe:") or "{" in text or text.endswith(TAR_SUFFIXES)


def _join(base: str, name: str) -> str:
    if "://" in name or name.startswith(("/", "pipe:")):
        return name
    if is_local_url(base):
        return os.path.join(local_path(base), name)
    return posixpath.join(base.rstrip("/"), name)


def manifest_refs(location: str, split: str, storage_options: dict[str, Any],
                  policy: RetryPolicy, cache_dir: str | os.PathLike | None
                  ) -> tuple[Manifest, ShardRefs]:
    """The manifest at a local/remote directory or manifest URL, and its split's shards.

    Read from the manifest's compact binary index (ringfeed/formats/manifest_index.py), never by parsing
    every JSON entry on every rank: the index beside a local manifest.json, else one built once
    into `cache_dir` (keyed by the JSON's path, size and mtime; for a remote manifest, by the
    sha256 of the JSON downloaded)."""
    if location.endswith(MANIFEST_NAME):
        manifest_url, base = location, location[: -len(MANIFEST_NAME)].rstrip("/") or "."
    else:
        manifest_url, base = _join(location, MANIFEST_NAME), location.rstrip("/") or "/"
    if is_local_url(manifest_url):
        try:
            index = load_index(local_path(manifest_url), cache_dir)
        except ManifestError as e:
            raise PipelineError(str(e)) from None
    else:
        try:
            data = retrying(lambda: read_url(manifest_url, storage_options), manifest_url,
                            "read manifest", policy)
        except FileNotFoundError:
            raise PipelineError(f"{manifest_url}: no manifest.json (run `ringfeed shard` first, "
                                "or pass a list of shard URLs)") from None
        except OSError as e:
            raise PipelineError(f"{manifest_url}: cannot read manifest ({e})") from e
        try:
            index = index_of_bytes(data, manifest_url, cache_dir)
        except ManifestError as e:
            raise PipelineError(str(e)) from None
    try:
        shards = index.split(split)
    except ManifestError as e:
        raise PipelineError(str(e)) from None
    return index.manifest(), ShardRefs(shards, base)


class ShardRefs(Sequence[ShardRef]):
    """A split's shards as ShardRefs, each made when it is accessed (no Python object per shard
    of a 10^6-shard manifest); `counts` is the sample-count array planning needs."""

    def __init__(self, shards: SplitIndex, base: str) -> None:
        self.shards, self.base = shards, base

    @property
    def counts(self) -> np.ndarray:
        return self.shards.counts

    def __len__(self) -> int:
        return len(self.shards)

    @functools.cached_property
    def all_local(self) -> bool:
        """Whether every shard is a local file, read from the index's name bytes (no ShardRef
        per shard). Conservative: a name with a scheme (file:// included) counts as remote."""
        names = self.shards.arrays.names.tobytes()
        return (is_local_url(self.base) and b"://" not in names
                and not len(self.shards.names_starting_with("pipe:")))

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = self.shards[i]
        return ShardRef(_join(self.base, s.name), s.num_samples, s.bytes, s.sha256,
                        _join(self.base, s.index) if s.index else None)

    def __iter__(self) -> Iterator[ShardRef]:
        return (self[i] for i in range(len(self)))

    def urls_starting_with(self, prefix: str) -> list[str]:
        """URLs of the shards whose name starts with `prefix` (names that are URLs are used
        as they are), found without making every ShardRef."""
        return [self[int(i)].url for i in self.shards.names_starting_with(prefix)]


class WindowRefs(Sequence[ShardRef]):
    """A split of flat token shards whose samples are windows: `counts` are window counts
    (what the plan sees as samples), each ShardRef carries its `Windows` for the reader."""

    def __init__(self, refs: Sequence[ShardRef], tokens: np.ndarray, seq_len: int,
                 random: bool) -> None:
        self.refs, self.tokens, self.seq_len, self.random = refs, tokens, seq_len, random

    @functools.cached_property
    def counts(self) -> np.ndarray:
        return window_count(self.tokens, self.seq_len, self.random).astype(np.int64)

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def all_local(self) -> bool | None:
        return getattr(self.refs, "all_local", None)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        windows = Windows(int(self.tokens[i]), self.seq_len, self.random)
        return replace(self.refs[i], windows=windows)

    def __iter__(self) -> Iterator[ShardRef]:
        return (self[i] for i in range(len(self)))

    def urls_starting_with(self, prefix: str) -> list[str]:
        return [r.url for r in self.refs if r.url.startswith(prefix)]


def windowed(manifest: Manifest | None, refs: Sequence[ShardRef], split: str,
             seq_len: int | None, random: bool, where: str) -> Sequence[ShardRef]:
    """`refs` as windows when the manifest says flat token shards (a `seq_len` is then
    needed), else as they are (a `seq_len` is then refused: rows have their length)."""
    text = manifest.text if manifest is not None else None
    if not text or text.get("layout") != FLAT:
        if seq_len is not None:
            drop = "drop seq_len (ringfeed train: data.seq_len)"
            if text and text.get("seq_len"):
                raise PipelineError(
                    f"seq_len {seq_len}: {where} holds rows of {text['seq_len']} tokens (the "
                    f"context fixed by ringfeed shard --seq-len): {drop}, or shard the text "
                    "again without --seq-len")
            raise PipelineError(f"seq_len {seq_len}: {where} holds no flat token shards: {drop}")
        return refs
    if seq_len is None:
        raise PipelineError(f"{where}: flat token shards: set seq_len (ringfeed train: "
                            "data.seq_len), the tokens a training window feeds the model")
    per_shard = (text.get("shard_tokens") or {}).get(split)
    if per_shard is None:
        raise PipelineError(f"{where}: the manifest has no shard_tokens for split {split!r} "
                            "(written by another ringfeed?): shard the text again")
    tokens = np.broadcast_to(np.asarray(per_shard, dtype=np.int64), (len(refs),))
    out = WindowRefs(refs, tokens, seq_len, random)
    if len(refs) and not out.counts.any():
        raise PipelineError(f"{where}: split {split!r} has no window of seq_len + 1 = "
                            f"{seq_len + 1} tokens ({int(tokens.max())} tokens per shard): "
                            "use a smaller seq_len")
    return out


def sample_counts(refs: Sequence[ShardRef]) -> np.ndarray:
    """Samples per shard, int64 (the index's array when there is one)."""
    counts = getattr(refs, "counts", None)
    if counts is not None:
        return counts
    return np.array([r.num_samples for r in refs], dtype=np.int64)
