"""`ringfeed inspect OUT`: what a person wants to see at a glance about a sharded dataset (plain
and compressed shards alike; a shard it cannot read is one error line naming it)."""

from __future__ import annotations

import io
import json
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of
from ringfeed.formats.manifest import Manifest
from ringfeed.formats.tarread import TarReadError, read_ints, scan_tar, shard_url
from ringfeed.formats.tokens import DOCS_MEMBER, FLAT, TOKENS_MEMBER
from ringfeed.remote import RetryPolicy
from ringfeed.shards.parallel import parallel_map
from ringfeed.shards.progress import human_bytes
from ringfeed.shards.remote import is_url, storage_call, storage_defaults
from ringfeed.shards.verify import load_manifest

PREVIEW_CHARS = 60


def inspect_dataset(out: str | Path, samples: int = 3, workers: int = 1,
                    storage_options: dict[str, Any] | None = None,
                    policy: RetryPolicy | None = None) -> str:
    """The report, as text. OUT is a folder or a URL (`s3://bucket/prefix`); storage calls are
    retried under `policy` (default: ringfeed/remote.py's)."""
    policy = policy or RetryPolicy()
    m = load_manifest(out, storage_options, policy)
    out = str(out).rstrip("/") if is_url(out) else out
    names = [str(out), *(s.name for split in m.splits.values() for s in split.shards)]
    with storage_defaults(names, storage_options or {}):
        return _report(m, out, samples, workers, policy)


def _report(m: Manifest, out: str | Path, samples: int, workers: int,
            policy: RetryPolicy) -> str:
    lines = [f"{out}/manifest.json: {m.source.get('format')} from {m.source.get('path')} "
             f"({m.created_by or 'unknown writer'})"]
    lines.append("fields: " + ", ".join(f"{ext} ({kind})" for ext, kind in m.fields.items()))
    total_shards = sum(len(s.shards) for s in m.splits.values())
    total_samples = sum(s.num_samples for s in m.splits.values())
    total_bytes = sum(s.num_bytes for s in m.splits.values())
    lines.append(f"total: {total_samples:,} samples in {total_shards} shards, "
                 f"{human_bytes(total_bytes)}")
    lines.append(f"{'split':<8}{'shards':>7}{'samples':>11}{'size':>11}   "
                 "per shard: samples min/median/max, size min/median/max")
    for name, split in m.splits.items():
        counts = [s.num_samples for s in split.shards]
        sizes = [s.bytes for s in split.shards]
        lines.append(f"{name:<8}{len(counts):>7}{sum(counts):>11,}{human_bytes(sum(sizes)):>11}   "
                     f"{_spread(counts, str)}, {_spread(sizes, human_bytes)}")
    if m.text:
        lines.append("text: " + ", ".join(f"{k}={v}" for k, v in m.text.items()))
    if m.skipped:
        lines.append(f"skipped {len(m.skipped)} input file(s), e.g. {m.skipped[0]['path']}: "
                     f"{m.skipped[0]['reason']}")
    if "cls" in m.fields:
        lines.extend(_class_balance(m, out, workers, policy))
    lines.extend(_samples(m, out, samples, policy))
    return "\n".join(lines)


def _spread(values: list[int], fmt: Any) -> str:
    if not values:
        return "-"
    return "/".join(fmt(int(v)) for v in (min(values), np.median(values), max(values)))


def _count_classes(shared: tuple[str, RetryPolicy], name: str) -> Counter:
    out, policy = shared
    url = shard_url(out, name)
    try:
        return storage_call(lambda: read_ints(url, "cls"), url, "count its classes", policy)
    except (TarReadError, OSError) as e:
        raise _unreadable(out, url, e) from None
    except ValueError as e:  # int() of a cls member
        raise UserError(f"{url}: a cls member is not a class index ({e})") from None


def _unreadable(out: str, url: str, e: Exception) -> UserError:
    """A shard inspect cannot read: one line naming it and what to do."""
    what = "missing" if isinstance(e, FileNotFoundError) else str(e)
    return UserError(f"{url}: {what}; re-download or re-create it (`ringfeed verify {out}` "
                     "checks every shard)")


def _class_balance(m: Manifest, out: str | Path, workers: int,
                   policy: RetryPolicy) -> list[str]:
    lines, warnings = [], []
    for split_name, split in m.splits.items():
        names = [s.name for s in split.shards]
        per_shard = list(parallel_map(_count_classes, names, workers, (str(out), policy), 1))
        counts = sum(per_shard, Counter())
        total = sum(counts.values()) or 1
        labels = m.class_names or []
        shown = ", ".join(
            f"{labels[c] if 0 <= c < len(labels) else c}: {n} ({100 * n / total:.1f}%)"
            for c, n in sorted(counts.items()))
        lines.append(f"classes in {split_name} ({len(counts)}): {shown}")
        warnings.extend(_count_mismatches(out, split_name, split.shards, per_shard))
    return lines + warnings


def _count_mismatches(out: str | Path, split_name: str, shards: list[Any],
                      per_shard: list[Counter]) -> list[str]:
    """Warnings for the shards whose class labels do not add up to the samples the manifest
    lists: a shard cut short or damaged (a flipped bit can hide a tar member without an error),
    or a manifest that is not the shards'. The class totals above then disagree with it."""
    wrong = [(s.name, s.num_samples, sum(c.values()))
             for s, c in zip(shards, per_shard, strict=True) if sum(c.values()) != s.num_samples]
    if not wrong:
        return []
    listed = sum(n for _, n, _ in wrong)
    found = sum(n for _, _, n in wrong)
    named = ", ".join(f"{name} ({have} of {n})" for name, n, have in wrong[:3])
    more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    return [f"warning: the class totals of {split_name} disagree with the manifest: "
            f"{len(wrong)} shard(s) hold {found} class labels where it lists {listed} samples: "
            f"{named}{more}; the shard is damaged or not the manifest's (`ringfeed verify "
            f"{out}` checks every shard)"]


def _samples(m: Manifest, out: str | Path, count: int, policy: RetryPolicy) -> list[str]:
    lines = []
    for split_name, split in m.splits.items():
        if not split.shards or count <= 0:
            continue
        first = split.shards[0].name
        lines.append(f"first samples of {split_name} ({first}):")
        url = shard_url(str(out), first)
        try:
            shown = storage_call(partial(scan_tar, url, keep_first=count), url,
                                 "read its first samples", policy).first
        except (TarReadError, OSError) as e:
            raise _unreadable(str(out), url, e) from None
        for sample in shown:
            members = ", ".join(f"{ext}: {_preview(ext, data, m)}"
                                for ext, data in sample.items() if ext != "__key__")
            lines.append(f"  {sample['__key__']}  {members}")
    return lines


def _preview(ext: str, data: bytes, m: Manifest) -> str:
    kind = m.fields.get(ext) or kind_of(ext)
    try:
        if kind == "int":
            value = int(data)
            names = m.class_names or []
            return f"{value} ({names[value]})" if ext == "cls" and 0 <= value < len(names) else str(value)
        if kind in ("text", "json"):
            text = data.decode()
            if kind == "json":
                text = json.dumps(json.loads(text), ensure_ascii=False)
            return repr(text[:PREVIEW_CHARS] + ("..." if len(text) > PREVIEW_CHARS else ""))
        if kind == "npy":
            return _preview_npy(ext, np.load(io.BytesIO(data), allow_pickle=False), m)
        if kind == "image":
            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                return f"{im.format} {im.width}x{im.height} {im.mode}, {human_bytes(len(data))}"
    except Exception as e:  # a preview must not stop the report; say what went wrong instead
        return f"{human_bytes(len(data))} (cannot preview as {kind}: {type(e).__name__})"
    return human_bytes(len(data))


def _preview_npy(ext: str, array: np.ndarray, m: Manifest) -> str:
    """An array's dtype and shape; a flat token shard's document offsets as offsets, and token
    ids as ids (ringfeed/formats/tokens.py), decoded when the tokenizer is bytes."""
    shown = f"{array.dtype}{list(array.shape)}"
    text = m.text or {}
    if text.get("layout") == FLAT and ext == DOCS_MEMBER:
        return f"{len(array):,} document starts {_head(array)}"
    tokens = array.ndim == 1 and (ext == TOKENS_MEMBER or text.get("layout") != FLAT)
    if tokens and text.get("layout") == FLAT:
        shown += f" ids {_head(array)}"
    if tokens and text.get("tokenizer") == "bytes":
        head = bytes(int(t) for t in array[:PREVIEW_CHARS] if t < 256)
        shown += f" {head.decode(errors='replace')!r}"
    return shown


def _head(array: np.ndarray, count: int = 8) -> str:
    """The first `count` values, as a list ending in ... when there are more."""
    values = ", ".join(str(int(v)) for v in array[:count])
    return f"[{values}{', ...' if len(array) > count else ''}]"
