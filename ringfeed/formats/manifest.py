"""`manifest.json`: the contract between `ringfeed shard` (writer) and the pipeline (reader).

Layout on disk (format version 1):

    {
      "format": "ringfeed-shards", "version": 1, "created_by": "ringfeed 0.1.0",
      "source": {"format": "imagefolder", "path": "/data/raw", "options": {...}},
      "fields": {"png": "image", "cls": "int"},      # tar member extension -> kind
      "class_names": ["cat", "dog"] | null,
      "text": {"tokenizer": "bytes", "seq_len": 128, "dtype": "uint16",
               "eos_id": 256, "vocab_size": 257} | null,   # rows; flat token shards have
               # "layout": "flat" and "shard_tokens": {split: tokens in each of its shards}
               # instead of seq_len (ringfeed/formats/tokens.py)
      "skipped": [{"path": "...", "reason": "..."}],
      "features": {"x.npy": {"role": "features", "columns": [...], "names": [...],
                             "dtype": "float32", "shape": [30], "mean": [...], "std": [...],
                             "stats_split": "train"}, ...} | null,
      "classes": {"field": "cls", "ids": [0, 1], "counts": [212, 357], "num_classes": 2} | null,
      "splits": {
        "train": {"shards": [{"name": "train-000000.tar", "num_samples": 100,
                              "bytes": 123456, "sha256": "...",
                              "index": "train-000000.tar.idx"}]},
        "val": {...}
      }
    }

Field kinds: "image" (encoded image bytes), "int" (decimal text, e.g. .cls), "npy" (numpy .npy),
"json", "text" (utf-8), "bytes" (opaque). Shard names are relative to the manifest's directory
(or absolute URLs). Samples inside a shard are numbered 0..num_samples-1 in tar order; the
pipeline identifies a sample by (split-wide shard index, position in shard).

`features` (tables: csv, jsonl, parquet) says, per member made from columns, which columns it
holds (`role` "features": a float32 vector, one-hot `vocabulary` per categorical column;
"field": one column), its dtype and shape, and for numbers the population mean/std over the
train split (`data.normalize: auto` standardises inputs with them; a regression target's
mean/std standardise its loss). `classes` records the class ids seen in `cls` members and their
counts (`num_classes` = largest id + 1, or the number of class names). Both are null where
unknown.

`index` (optional; null or absent in manifests written before indexes, and for shards without
one) names the shard's tar index sidecar (`tarindex.py`), relative to the manifest like
`name`: `ringfeed shard` writes `<shard name>.idx` beside each shard; `--format wds-index`
writes `<shard path relative to OUT>.idx`, or `index/<sha256[:16]>-<file name>.idx` under OUT
when that path leaves OUT (`..`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ringfeed.formats.manifest_format import INDEX_NAME, SplitArrays, write_index
from ringfeed.fsutil import atomic_write_bytes

FORMAT = "ringfeed-shards"
VERSION = 1
FIELD_KINDS = ("image", "int", "npy", "json", "text", "bytes")
INDEX_SUFFIX = ".idx"  # a shard's tar index sidecar: `train-000000.tar` -> `train-000000.tar.idx`
# A shard set's files beside its shards: this manifest, and its binary index (INDEX_NAME,
# manifest_format.py), written after it.
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the file and the problem."""


@dataclass
class ShardInfo:
    name: str
    num_samples: int
    bytes: int
    sha256: str | None = None
    index: str | None = None  # the tar index sidecar, relative to the manifest (or a URL)


@dataclass
class Split:
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


@dataclass
class Manifest:
    splits: dict[str, Split]
    fields: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    class_names: list[str] | None = None
    text: dict[str, Any] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    features: dict[str, dict[str, Any]] | None = None  # tables: columns -> members, statistics
    classes: dict[str, Any] | None = None  # class ids seen in `cls` members, with counts
    created_by: str = ""
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def save(self, directory: str | Path) -> Path:
        """Write `directory/manifest.json` atomically (temp file + rename), then its compact
        binary index `manifest.bin` (manifest_format.py's layout; manifest_index.py maps it
        instead of parsing the JSON)."""
        path = Path(directory) / MANIFEST_NAME
        text = self.to_json().encode()
        atomic_write_bytes(path, text)
        write_manifest_index(self, text, path.with_name(INDEX_NAME))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"{origin}: not a ringfeed manifest (a JSON "
                                f"{type(data).__name__}, not an object)")
        if data.get("format") != FORMAT:
            raise ManifestError(f"{origin}: not a ringfeed manifest (format={data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ManifestError(
                f"{origin}: manifest version {data.get('version')} is not supported "
                f"(this ringfeed reads version {VERSION}); re-shard or upgrade ringfeed"
            )
        try:
            splits = {
                name: Split([ShardInfo(**s) for s in split["shards"]])
                for name, split in data["splits"].items()
            }
            rest = {k: v for k, v in data.items() if k != "splits"}
            return cls(splits=splits, **rest)
        except (KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"{origin}: malformed manifest ({e})") from None

    @classmethod
    def load(cls, path_or_dir: str | Path) -> Manifest:
        """Load from a local path (a file or the shard directory)."""
        path = Path(path_or_dir)
        if path.is_dir():
            path = path / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest.json (run `ringfeed shard` first)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{path}: not valid JSON ({e})") from None
        except OSError as e:  # a directory or an unreadable file in its place
            raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
        return cls.from_dict(data, origin=str(path))

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise ManifestError(f"split {name!r} not in manifest (have: {', '.join(self.splits)})")
        return self.splits[name]


def manifest_meta(manifest: Manifest) -> dict[str, Any]:
    """The manifest's fields other than its shard table (kept in the index header)."""
    meta = asdict(replace(manifest, splits={}))
    del meta["splits"]
    return meta


def write_manifest_index(manifest: Manifest, json_bytes: bytes, path: str | os.PathLike) -> Path:
    """The index of `manifest`, whose JSON text is `json_bytes`, written to `path`."""
    return write_index(path, *index_contents(manifest, json_bytes))


def index_contents(manifest: Manifest, json_bytes: bytes) -> tuple:
    """write_index's arguments for `manifest`, whose JSON text is `json_bytes`."""
    splits = {name: SplitArrays.from_shards(split.shards)
              for name, split in manifest.splits.items()}
    return (manifest_meta(manifest), splits, len(json_bytes),
            hashlib.sha256(json_bytes).hexdigest())
