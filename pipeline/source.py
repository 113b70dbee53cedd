"""Resolve a pipeline source (a shard directory/URL with manifest.json, or shard URLs) into
an ordered list of `ShardRef`s with sample counts.

Sample counts drive all planning (rank balance, resume), so they are needed before any data is
read: they come from `manifest.json` when there is one; for a bare list of shard URLs they are
learned by one counting pass over the shards (through the cache, so remote shards are fetched
once and reused by the epochs that follow).
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import braceexpand
import fsspec

from pipeline.errors import PipelineError
from shards.manifest import Manifest, ManifestError

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class ShardRef:
    """One shard: where it is, how many samples it holds, and what the manifest says about it."""

    url: str
    num_samples: int
    bytes: int | None = None
    sha256: str | None = None
    index: str | None = None  # the tar index sidecar `ringfeed shard` wrote, if any

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


def read_manifest(location: str, storage_options: dict[str, Any]) -> tuple[Manifest, str]:
    """Load manifest.json from a local/remote directory or a manifest URL; returns (manifest,
    base directory its shard names are relative to)."""
    if location.endswith("manifest.json"):
        manifest_url, base = location, location[: -len("manifest.json")].rstrip("/") or "."
    else:
        manifest_url, base = _join(location, "manifest.json"), location.rstrip("/") or "/"
    if is_local_url(manifest_url):
        return Manifest.load(local_path(manifest_url)), base
    try:
        with fsspec.open(manifest_url, "rb", **storage_options) as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise PipelineError(f"{manifest_url}: no manifest.json (run `ringfeed shard` first, "
                            "or pass a list of shard URLs)") from None
    except json.JSONDecodeError as e:
        raise PipelineError(f"{manifest_url}: not valid JSON ({e})") from e
    except OSError as e:
        raise PipelineError(f"{manifest_url}: cannot read manifest ({e})") from e
    return Manifest.from_dict(data, origin=manifest_url), base


def refs_from_manifest(manifest: Manifest, base: str, split: str) -> list[ShardRef]:
    try:
        shards = manifest.split(split).shards
    except ManifestError as e:
        raise PipelineError(str(e)) from None
    return [ShardRef(_join(base, s.name), s.num_samples, s.bytes, s.sha256,
                     _join(base, s.index) if getattr(s, "index", None) else None)
            for s in shards]
