"""The settings of one `ringfeed shard` run, as the command line gives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringfeed.remote import RetryPolicy

FORMATS = ("imagefolder", "jsonl", "csv", "parquet", "npz", "npy", "text", "wds-index")
TABLE_FORMATS = ("jsonl", "csv", "parquet")  # one sample per row of typed columns
DEFAULT_MAX_SIZE = 256_000_000  # used when neither --max-size nor --max-count is given


@dataclass
class ShardOptions:
    src: Path
    out: Path
    format: str
    fields: dict[str, str] = field(default_factory=dict)  # source field -> member ext
    key_field: str | None = None
    # tables: (COLS spec, member ext) per --features; COLS is a comma list of names, globs or
    # `numeric`. None: every numeric column no --field names goes into x.npy.
    features: list[tuple[str, str]] | None = None
    categorical: list[str] = field(default_factory=list)  # columns whose values map to ids
    fill: float | None = None  # value for missing numeric cells (None: a missing cell is an error)
    max_size: int | None = None
    max_count: int | None = None
    val_fraction: float = 0.0
    shuffle_seed: int | None = None
    workers: int = 1
    strict: bool = False
    overwrite: bool = False
    # text: tokens per row of the row layout (one `tokens.npy` member each); None: flat
    # token shards (ringfeed/formats/tokens.py), the context chosen at train time
    seq_len: int | None = None
    tokenizer: str = "bytes"
    text_field: str = "text"
    glob: str = "*"
    split: str | None = None  # wds-index: every shard's split; imagefolder: the split SRC adds
    # --part I/N (or the launcher's rank/size): this process writes part I of N of the plan's
    # shards (parts.py); None: all of them, and the manifest
    part: tuple[int, int] | None = None
    # --scan: only scan, and leave the scan in OUT for the parts (tables; sources/base.py)
    scan_only: bool = False
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    # object storage (remote.py): OUT and/or SRC given as URLs. Then `out` (for a remote OUT)
    # and `src` (for a remote SRC, once fetched) are local paths under `staging`.
    out_url: str | None = None
    src_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec's, as the pipeline's
    staging: Path | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)  # --retry-budget's, for every call

    @property
    def work_name(self) -> str:
        """The scan's scratch folder under OUT: one per part, since parts may share OUT."""
        return ".ringfeed-work" + (f"/part-{self.part[0]}-of-{self.part[1]}" if self.part else "")

    @property
    def flat_text(self) -> bool:
        """--format text without --seq-len: flat token shards."""
        return self.format == "text" and self.seq_len is None

    def size_limits(self) -> tuple[int | None, int | None]:
        """(max bytes, max samples; flat text: max tokens) per shard, as given; None = no limit."""
        if self.max_size is None and self.max_count is None:
            return DEFAULT_MAX_SIZE, None
        return self.max_size, self.max_count

    def limits(self) -> tuple[int | None, int | None]:
        """(max bytes, max samples) per shard for the packing; None = no limit. A flat token
        shard is one sample that the text source cut to size_limits()."""
        return (None, 1) if self.flat_text else self.size_limits()

    def plan_options(self) -> dict:
        """What decides the shards' bytes (not --workers): recorded in the manifest."""
        max_size, max_count = self.size_limits()
        return {"max_size": max_size, "max_count": max_count, "val_fraction": self.val_fraction,
                "shuffle_seed": self.shuffle_seed}
