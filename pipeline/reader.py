"""Read chosen samples (by position in tar order) from one local shard, with webdataset's tar
iterators. A corrupt or truncated tar does not raise here: the samples it takes with it come
back as `BadSample`s, and the policy (skip or fail) is applied where samples are emitted."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.cache import ShardHandle


@dataclass(frozen=True)
class BadSample:
    """A sample that could not be read or decoded; `key` is None when the tar lost it."""

    url: str
    position: int
    key: str | None
    reason: str

    def describe(self) -> str:
        where = f"sample {self.key!r}" if self.key else f"sample #{self.position}"
        return f"{self.url}: {where}: {self.reason}"


def iter_samples(handle: ShardHandle) -> Iterator[dict[str, Any]]:
    """Every sample of the shard in tar order (raw bytes per extension, plus __key__)."""
    # Imported here: webdataset imports torch when it is installed, and `import pipeline`
    # must stay free of torch/TF for TensorFlow-only users.
    from webdataset.handlers import reraise_exception
    from webdataset.tariterators import group_by_keys, tar_file_expander

    files = tar_file_expander([{"url": handle.ref.url, "stream": handle.file}],
                              handler=reraise_exception)
    return group_by_keys(files, handler=reraise_exception)


def read_positions(handle: ShardHandle, wanted: dict[int, int]
                   ) -> Iterator[tuple[int, dict[str, Any] | BadSample]]:
    """Yield (slot, sample) for each wanted position -> slot, in position order.

    Reading stops after the last wanted position (a partial shard is not read to the end).
    Positions the shard cannot deliver (corrupt tar, truncated file, fewer samples than the
    manifest says) come back as BadSample.
    """
    url, last = handle.ref.url, max(wanted)
    position, last_key = -1, None
    try:
        for position, sample in enumerate(iter_samples(handle)):
            slot = wanted.get(position)
            if slot is not None:
                yield slot, sample
            last_key = sample["__key__"]
            if position >= last:
                return
        after = f" after {last_key!r}" if last_key else ""
        reason = (f"shard ends after {position + 1} samples{after}, "
                  f"the manifest lists {handle.ref.num_samples}")
    except Exception as e:  # tarfile.ReadError, EOFError, duplicate names, ...
        after = f" after sample {last_key!r}" if last_key else " at its start"
        reason = f"corrupt or truncated tar{after} ({_first_arg(e)})"
    for pos in sorted(p for p in wanted if p > position):
        yield wanted[pos], BadSample(url, pos, None, reason)


def count_samples(handle: ShardHandle) -> int:
    return sum(1 for _ in iter_samples(handle))


def _first_arg(e: Exception) -> str:
    text = str(e.args[0]) if e.args else type(e).__name__
    return f"{type(e).__name__}: {text.split(' @ ')[0]}"
