"""Input formats of `ringfeed shard`; `open_source` scans one into a `Source`."""

from __future__ import annotations

from ringfeed.errors import UserError
from ringfeed.shards.options import FORMATS, ShardOptions
from ringfeed.shards.sources.base import Part, Source, require_exists


def open_source(opts: ShardOptions) -> Source:
    """Scan `opts.src` as `opts.format`: every bad input raises a UserError before any write."""
    if opts.format in FORMATS:
        require_exists(opts.src)
    if opts.format in ("jsonl", "csv"):
        from ringfeed.shards.sources.tabular import Tabular
        return Tabular(opts).scan()
    if opts.format == "parquet":
        from ringfeed.shards.sources.parquet import Parquet
        return Parquet(opts).scan()
    if opts.format in ("npz", "npy"):
        from ringfeed.shards.sources.arrays import Arrays
        return Arrays(opts)
    if opts.format == "imagefolder":
        from ringfeed.shards.sources.imagefolder import ImageFolder
        return ImageFolder(opts)
    if opts.format == "text":
        from ringfeed.shards.sources.text import Text
        return Text(opts)
    raise UserError(f"unknown --format {opts.format!r} (choose from: {', '.join(FORMATS)})")


__all__ = ["Part", "Source", "open_source"]
