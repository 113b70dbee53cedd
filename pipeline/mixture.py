"""Weighted mixtures: several sources read as one, each contributing a share of every epoch.

A mixture of sources s = 0..S-1 (weights w_s, sizes m_s samples) has epochs of E samples
(`epoch_samples`, default sum m_s); source s gives n_s of them, w_s / sum w of E rounded by
largest remainder (so sum n_s = E exactly). Weights are shares of *samples*; token shards hold
one fixed-length sequence per sample, so for them sample shares are token shares too.

Each source is an endless sequence of its own passes (pass r: its shards in an order drawn
from rng(seed, "mix", s, r), tar order within), and epoch e takes that sequence's samples
[e n_s, (e+1) n_s). A source whose share of E exceeds its size repeats within the epoch
(Streaming's `repeat`); one below its size is subsampled, and the next epoch carries on where
this one stopped (`choose`, without ever re-reading a sample before the pass ends).

The epoch list L interleaves the sources: it is cut into C = ceil(E / BLOCK) blocks, block c
holding floor((c+1) n_s / C) - floor(c n_s / C) samples of source s, in an order drawn from
rng(seed, epoch, "mix", c). So any stretch of L is within one sample per block of the weights,
and a position of L maps to its sample with O(S) arithmetic plus one block's shuffle: the
planner (plan.py) treats L like one source's epoch order - ranks, workers, shuffle buffers,
pad/drop and resume at any world size apply unchanged. Global ids are the sources' ids laid end
to end (source s's shards follow source s-1's), so `__index__` says which source a sample is.
"""

from __future__ import annotations

import functools
import os
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringfeed.pipeline.config import WeightedSource
from ringfeed.pipeline.errors import PipelineError
from ringfeed.pipeline.plan import EpochOrder, Layout, _prefix_sums
from ringfeed.pipeline.source import ShardRef, sample_counts

BLOCK = 4096  # samples per interleaving block of a mixture's epoch
_MIX = 0x6D6978  # "mix": keeps a mixture's random streams apart from a single source's


def as_mixture(source: Any) -> list[WeightedSource] | None:
    """The mixture a pipeline source describes (a list of {path, weight} entries), or None for
    a single source (a path, URL, brace pattern or list of shard URLs)."""
    if isinstance(source, (str, os.PathLike)) or not isinstance(source, Sequence):
        return None
    entries = list(source)
    if not entries or not all(isinstance(e, (dict, WeightedSource)) for e in entries):
        if any(isinstance(e, (dict, WeightedSource)) for e in entries):
            raise PipelineError("a mixture lists {path, weight} entries only (a plain list "
                                "is shard URLs)")
        return None
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(entry if isinstance(entry, WeightedSource)
                       else WeightedSource.model_validate(entry))
        except ValueError as e:
            first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
            where = ".".join(str(p) for p in first["loc"])
            raise PipelineError(f"source [{i}]{'.' + where if where else ''}: "
                                f"{first['msg']}") from None
    return out


def source_names(sources: Sequence[WeightedSource]) -> list[str]:
    """A short unique name per source: its `name`, else the last part of its path."""
    names: list[str] = []
    for i, s in enumerate(sources):
        name = s.name or posixpath.basename(str(s.path).rstrip("/")) or f"source{i}"
        names.append(name if name not in names else f"{name}_{i}")
    return names


def check_weights(sources: Sequence[WeightedSource]) -> None:
    """Every source has a weight, or none has (then each source's share is its size)."""
    if any(s.weight is None for s in sources) and any(s.weight is not None for s in sources):
        raise PipelineError("mixture: give every source a weight, or none (then each "
                            "source's share is its size)")


def mixture_of(sources: Sequence[WeightedSource], layouts: Sequence[Layout],
               epoch_samples: int | None) -> Mixture:
    """The Mixture of `sources` laid out as `layouts`: their weights (or, with none given,
    their sizes) and epochs of `epoch_samples` (default: all their samples)."""
    check_weights(sources)
    sizes = [lay.num_samples for lay in layouts]
    weights = (tuple(float(n) for n in sizes) if sources[0].weight is None
               else tuple(float(s.weight) for s in sources))  # type: ignore[arg-type]
    return Mixture(tuple(layouts), weights, epoch_samples or sum(sizes))


def shares(weights: Sequence[float], total: int) -> np.ndarray:
    """`total` split by `weights`: floor shares, then the largest remainders get one more
    (ties to the earlier source), so the parts sum to `total` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    parts = np.floor(exact).astype(np.int64)
    short = int(total - parts.sum())
    if short:
        parts[np.argsort(-(exact - parts), kind="stable")[:short]] += 1
    return parts


@dataclass(frozen=True)
class Mixture:
    """The sources' layouts, their weights and the epoch size: what plans a mixture's epochs."""

    layouts: tuple[Layout, ...]
    weights: tuple[float, ...]
    epoch_samples: int
    starts: np.ndarray = field(init=False)  # int64 [S + 1]: first global id of each source
    per_epoch: np.ndarray = field(init=False)  # int64 [S]: n_s

    def __post_init__(self) -> None:
        sizes = np.array([lay.num_samples for lay in self.layouts], dtype=np.int64)
        object.__setattr__(self, "starts", _prefix_sums(sizes))
        object.__setattr__(self, "per_epoch", shares(self.weights, self.epoch_samples))
        if (self.per_epoch > 0).any() and (sizes[self.per_epoch > 0] == 0).any():
            raise PipelineError("a source of the mixture has no samples")

    def source_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global ids -> (source index, id within the source)."""
        ids = np.asarray(ids, dtype=np.int64)
        source = np.searchsorted(self.starts, ids, side="right") - 1
        return source, ids - self.starts[source]

    def describe(self) -> dict[str, Any]:
        """What a pipeline state records, so a resume checks it is the same mixture."""
        return {"sizes": [int(lay.num_samples) for lay in self.layouts],
                "weights": [float(w) for w in self.weights],
                "epoch_samples": int(self.epoch_samples)}

    def order(self, seed: int, epoch: int, shuffle: bool) -> MixtureOrder:
        return MixtureOrder(self, seed, epoch, shuffle)


class MixtureOrder:
    """L of one epoch of a mixture (see the module docstring): `Positions` for the planner."""

    def __init__(self, mixture: Mixture, seed: int, epoch: int, shuffle: bool) -> None:
        self.mixture, self.seed, self.epoch, self.shuffle = mixture, seed, epoch, shuffle
        n = mixture.per_epoch
        self.blocks = max(1, -(-mixture.epoch_samples // BLOCK))
        c = np.arange(self.blocks + 1, dtype=np.int64)
        self.block_starts = np.zeros(self.blocks + 1, dtype=np.int64)
        for n_s in n.tolist():  # one source at a time: O(C) memory whatever S is
            self.block_starts += c * n_s // self.blocks

    def __len__(self) -> int:
        return int(self.mixture.epoch_samples)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        block = np.searchsorted(self.block_starts, positions, side="right") - 1
        source = np.empty(len(positions), dtype=np.int64)
        seq = np.empty(len(positions), dtype=np.int64)  # index in the source's sequence
        for c in np.unique(block).tolist():
            sel = np.flatnonzero(block == c)
            labels, before = self._block(c)
            at = positions[sel] - self.block_starts[c]
            source[sel], seq[sel] = labels[at], before[at]
        out = np.empty(len(positions), dtype=np.int64)
        m = self.mixture
        for s in np.unique(source).tolist():
            sel = np.flatnonzero(source == s)
            j = int(self.epoch) * int(m.per_epoch[s]) + seq[sel]
            size = m.layouts[s].num_samples
            passes, within = np.divmod(j, size)
            for r in np.unique(passes).tolist():
                part = sel[passes == r]
                out[part] = m.starts[s] + self._pass(s, r).ids(within[passes == r])
        return out

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one order per epoch, few blocks each
    def _block(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """Block c's source labels in order, and for each its index in its source's sequence
        for this epoch."""
        n, blocks = self.mixture.per_epoch, self.blocks
        lo, hi = c * n // blocks, (c + 1) * n // blocks
        labels = np.repeat(np.arange(len(n), dtype=np.int64), hi - lo)
        if self.shuffle:
            labels = np.random.default_rng([self.seed, self.epoch, _MIX, c]).permutation(labels)
        # the k-th sample of source s in this block is that source's sample lo_s + k
        rank = np.empty(len(labels), dtype=np.int64)
        by_source = np.argsort(labels, kind="stable")
        counts = hi - lo
        rank[by_source] = np.arange(len(labels)) - np.repeat(
            _prefix_sums(counts)[:-1], counts)
        return labels, lo[labels] + rank

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def _pass(self, s: int, r: int) -> EpochOrder:
        """Pass r over source s: its own shard order (manifest order without shuffle)."""
        return EpochOrder(self.mixture.layouts[s], self.seed, r, self.shuffle,
                          key=(_MIX, s))


class ConcatRefs(Sequence[ShardRef]):
    """The sources' shard lists laid end to end (shard i of the mixture is shard
    i - first[s] of source s)."""

    def __init__(self, parts: Sequence[Sequence[ShardRef]]) -> None:
        self.parts = list(parts)
        self.first = _prefix_sums(np.array([len(p) for p in self.parts], dtype=np.int64))

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        s = int(np.searchsorted(self.first, i, side="right")) - 1
        return self.parts[s][i - int(self.first[s])]

    def __iter__(self) -> Iterator[ShardRef]:
        for part in self.parts:
            yield from part

    @property
    def counts(self) -> np.ndarray:
        return np.concatenate([sample_counts(p) for p in self.parts])

    @property
    def all_local(self) -> bool:
        return all(getattr(p, "all_local", None) or all(r.is_local for r in p)
                   for p in self.parts)
