"""`ringfeed verify OUT`: re-hash every shard and re-count its samples against the manifest, and
check that each shard's index sidecar is the shard's index (rebuilt from the tar and compared).
A compressed shard is hashed as it is stored and its samples counted by decompressing it; one that
cannot be read says what is wrong with its compressed data or with the tar inside."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest, ManifestError, ShardInfo
from ringfeed.formats.tarindex import TarIndex, build_index
from ringfeed.formats.tarread import TAR_SUFFIXES, TarReadError, open_shard, scan_tar, shard_url
from ringfeed.shards.parallel import parallel_map


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


def load_manifest(out: Path) -> Manifest:
    try:
        return Manifest.load(out)
    except ManifestError as e:
        raise UserError(str(e)) from None


def verify(out: Path, workers: int = 1) -> Verification:
    manifest = load_manifest(out)
    tasks = [(split, info) for split, s in manifest.splits.items() for info in s.shards]
    checks = list(parallel_map(_check, tasks, workers, str(out), 1))
    listed = {Path(shard_url(str(out), info.name)).resolve() for _, info in tasks}
    unlisted = sorted(p.name for p in out.iterdir()
                      if p.name.endswith(TAR_SUFFIXES) and p.resolve() not in listed)
    return Verification(manifest, checks, unlisted)


def _check(out: str, task: tuple[str, ShardInfo]) -> ShardCheck:
    split, info = task
    check = ShardCheck(split, info.name)
    try:
        scan = scan_tar(shard_url(out, info.name))
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
        problem = _check_index(out, info.name, info.index)
        if problem:
            check.problems.append(problem)
    return check


def _check_index(out: str, name: str, index: str) -> str | None:
    """What is wrong with shard `name`'s index sidecar `index`, or None when it is the shard's
    index."""
    try:
        with open_shard(shard_url(out, index)) as f:
            recorded = TarIndex.from_bytes(f.read())
    except FileNotFoundError:
        return f"index sidecar {index} is missing"
    except ValueError as e:
        return f"index sidecar {index} is not a valid index ({e})"
    except OSError as e:
        return f"index sidecar {index} is unreadable ({e})"
    try:
        with open_shard(shard_url(out, name)) as f:
            actual, _ = build_index(f)
    except OSError as e:
        return f"index sidecar {index} cannot be checked: the shard is unreadable ({e})"
    if actual != recorded:
        return (f"index sidecar {index} does not match the shard ({recorded.num_samples} "
                f"samples indexed, the tar has {actual.num_samples} readable)")
    return None
