"""`ringfeed verify OUT`: re-hash every shard and re-count its samples against the manifest, and
check that each shard's index sidecar is the shard's index (rebuilt from the tar and compared).
A compressed shard is hashed as it is stored and its samples counted by decompressing it; one that
cannot be read says what is wrong with its compressed data or with the tar inside."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringfeed.errors import UserError
from ringfeed.formats.manifest import MANIFEST_NAME, Manifest, ManifestError, ShardInfo
from ringfeed.formats.tarindex import TarIndex, build_index
from ringfeed.formats.tarread import TAR_SUFFIXES, TarReadError, open_shard, scan_tar, shard_url
from ringfeed.remote import RetryPolicy
from ringfeed.shards.parallel import parallel_map
from ringfeed.shards.remote import Store, is_url, storage_call, storage_defaults


@dataclass
class ShardCheck:
    split: str
    name: str
    problems: list[str] = field(default_factory=list)
    num_samples: int = 0
    bytes: int = 0


@dataclass
class Verification:
    manifest: Manifest
    checks: list[ShardCheck]
    unlisted: list[str] = field(default_factory=list)  # tar files in OUT the manifest omits

    @property
    def bad(self) -> list[ShardCheck]:
        return [c for c in self.checks if c.problems]


def load_manifest(out: str | Path, storage_options: dict[str, Any] | None = None,
                  policy: RetryPolicy | None = None) -> Manifest:
    """OUT's manifest: a local folder's, or a URL's (`s3://bucket/prefix`: its manifest.json
    object, whose presence says the dataset is complete)."""
    try:
        if not is_url(out):
            return Manifest.load(Path(out))
        url = f"{str(out).rstrip('/')}/{MANIFEST_NAME}"
        try:
            data = Store(str(out), storage_options or {}, policy).read(MANIFEST_NAME)
        except FileNotFoundError:
            raise UserError(f"{url}: no manifest.json (run `ringfeed shard` first, or let it "
                            "finish: the manifest is uploaded last)") from None
        try:
            return Manifest.from_dict(json.loads(data), origin=url)
        except ValueError as e:  # JSONDecodeError, or ManifestError
            raise ManifestError(str(e) if isinstance(e, ManifestError)
                                else f"{url}: not valid JSON ({e})") from None
    except ManifestError as e:
        raise UserError(str(e)) from None


def verify(out: str | Path, workers: int = 1, storage_options: dict[str, Any] | None = None,
           policy: RetryPolicy | None = None) -> Verification:
    """Every shard of OUT checked against its manifest; storage calls retried under `policy`
    (default: ringfeed/remote.py's)."""
    policy = policy or RetryPolicy()
    manifest = load_manifest(out, storage_options, policy)
    tasks = [(split, info) for split, s in manifest.splits.items() for info in s.shards]
    out = str(out).rstrip("/") if is_url(out) else str(out)
    with storage_defaults([out, *(info.name for _, info in tasks)], storage_options or {}):
        checks = list(parallel_map(_check, tasks, workers, (out, policy), 1))
    if is_url(out):
        listed = {info.name for _, info in tasks}
        unlisted = sorted(name for name in Store(out, storage_options or {}, policy).list()
                          if "/" not in name and name.endswith(TAR_SUFFIXES)
                          and name not in listed)
    else:
        local = {Path(shard_url(out, info.name)).resolve() for _, info in tasks}
        unlisted = sorted(p.name for p in Path(out).iterdir()
                          if p.name.endswith(TAR_SUFFIXES) and p.resolve() not in local)
    return Verification(manifest, checks, unlisted)


def _check(shared: tuple[str, RetryPolicy], task: tuple[str, ShardInfo]) -> ShardCheck:
    out, policy = shared
    split, info = task
    check = ShardCheck(split, info.name)
    url = shard_url(out, info.name)
    try:
        scan = storage_call(lambda: scan_tar(url), url, "verify", policy)
    except FileNotFoundError:
        check.problems.append("missing")
        return check
    except TarReadError as e:
        check.problems.append(f"{e}; re-download or re-create it")
        return check
    except OSError as e:
        check.problems.append(f"unreadable ({e})")
        return check
    check.num_samples, check.bytes = scan.num_samples, scan.bytes
    if scan.bytes != info.bytes:
        check.problems.append(f"{scan.bytes} bytes, manifest says {info.bytes}")
    if info.sha256 is not None and scan.sha256 != info.sha256:
        check.problems.append("sha256 differs from the manifest (content changed)")
    if scan.num_samples != info.num_samples:
        check.problems.append(f"{scan.num_samples} samples, manifest says {info.num_samples}")
    if scan.duplicate_keys:
        check.problems.append(f"sample key {scan.duplicate_keys[0]!r} appears more than once")
    if info.index is not None:
        problem = _check_index(out, info.name, info.index, policy)
        if problem:
            check.problems.append(problem)
    return check


def _check_index(out: str, name: str, index: str, policy: RetryPolicy) -> str | None:
    """What is wrong with shard `name`'s index sidecar `index`, or None when it is the shard's
    index."""
    def read() -> bytes:
        with open_shard(shard_url(out, index)) as f:
            return f.read()
    try:
        recorded = TarIndex.from_bytes(storage_call(read, shard_url(out, index), "verify",
                                                    policy))
    except FileNotFoundError:
        return f"index sidecar {index} is missing"
    except ValueError as e:
        return f"index sidecar {index} is not a valid index ({e})"
    except OSError as e:
        return f"index sidecar {index} is unreadable ({e})"
    def index_of_shard() -> TarIndex:
        with open_shard(shard_url(out, name)) as f:
            return build_index(f)[0]
    try:
        actual = storage_call(index_of_shard, shard_url(out, name), "verify", policy)
    except OSError as e:
        return f"index sidecar {index} cannot be checked: the shard is unreadable ({e})"
    if actual != recorded:
        return f"index sidecar {index} does not match the shard: {_difference(recorded, actual)}"
    return None


def _difference(recorded: TarIndex, actual: TarIndex) -> str:
    """How a sidecar's index differs from the one rebuilt from the tar, in plain words."""
    if recorded.num_samples != actual.num_samples:
        return (f"it lists {recorded.num_samples} samples, the tar holds "
                f"{actual.num_samples} whole ones")
    for mine, theirs in zip(recorded.keys, actual.keys, strict=True):
        if mine != theirs:
            return (f"it lists other sample keys ({mine!r} where the tar has {theirs!r}; "
                    "another shard's index?)")
    return (f"same {actual.num_samples} sample keys, but other member names, offsets or sizes "
            "(the tar was rewritten)")
