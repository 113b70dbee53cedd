"""`SRC/<class>/<image>` (or `SRC/{train,val}/<class>/<image>`) -> {<ext>: original bytes, cls}."""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import IMAGE_EXTENSIONS
from ringfeed.formats.tarblocks import member_tar_bytes
from ringfeed.shards.keys import check_unique, safe_key
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.parallel import parallel_map
from ringfeed.shards.sources.base import (
    Part,
    SharedScan,
    Source,
    WorkDir,
    int_sizes,
    source_splits,
    visible,
)

# PIL format name -> member extension; also the spelling used for a file's own extension.
PIL_EXTS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "GIF": "gif", "BMP": "bmp",
            "WEBP": "webp", "TIFF": "tiff", "PPM": "ppm"}
PARALLEL_IDENTIFY_MIN = 5_000
CANONICAL_EXT = {"jpeg": "jpg", "tif": "tiff", "pgm": "ppm", "pbm": "ppm"}


@dataclass
class _Found:
    path: str
    rel: str         # path relative to the part folder, for messages
    key_path: str    # `rel` without the file's suffix: becomes the sample key
    label: int
    size: int
    mtime_ns: int


def _split_suffix(name: str) -> tuple[str, str]:
    """(stem, suffix without its dot) by `PurePath`'s rule, without a path object per file:
    `a.tar.gz` -> (`a.tar`, `gz`); `a.`, `.a` and `a` have no suffix."""
    dot = name.rfind(".")
    return (name[:dot], name[dot + 1:]) if 0 < dot < len(name) - 1 else (name, "")


def _identify_file(_shared: Any, path: str) -> tuple[str | None, str | None]:
    """(member ext, None) for an image, else (None, why it is skipped).

    The common formats are told by their signature in the first 16 bytes, with PIL's own
    checks (what `Image.open` tries before it parses any header): about 7 us a file against
    25 us for `Image.open`, and the scan is the serial part of a parallel run. A corrupt body
    behind a valid signature is stored as it is, as `Image.open` (which decodes nothing)
    would let it through too; the pipeline's bad-sample policy meets it at decode time."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            prefix = os.read(fd, 16)
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    fmt = _signature(prefix)
    if fmt is None:
        fmt, why = _pil_format(path)
        if why:
            return None, why
    own = _split_suffix(os.path.basename(path))[1].lower()
    if own in IMAGE_EXTENSIONS:
        return CANONICAL_EXT.get(own, own), None
    if fmt in PIL_EXTS:
        return PIL_EXTS[fmt], None
    return None, f"unsupported image format {fmt or 'unknown'}"


def _signature(prefix: bytes) -> str | None:
    """The format of PIL's common plugins (JPEG, PNG, GIF, BMP, PPM) that accepts `prefix`."""
    for fmt, accept in _common_formats():
        try:
            ok = accept(prefix)
        except (IndexError, TypeError, struct.error):  # a short file; `Image.open` skips too
            continue
        if ok and not isinstance(ok, str):  # a str: "this format, but a variant PIL refuses"
            return fmt
    return None


@functools.cache
def _common_formats() -> list[tuple[str, Callable[[bytes], Any]]]:
    from PIL import Image

    Image.preinit()  # registers the common plugins, as `Image.open` does first
    return [(fmt, Image.OPEN[fmt][1]) for fmt in Image.ID if Image.OPEN[fmt][1]]


def _pil_format(path: str) -> tuple[str | None, str | None]:
    """Any other format, by `Image.open` (every plugin, headers parsed): (format, None), or
    (None, why it is not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.format, None
    except UnidentifiedImageError:
        return None, "not an image (PIL cannot identify it)"
    except Image.DecompressionBombError:  # a real image, only very large: stored as it is
        return None, None
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"


class ImageFolder(Source):
    format = "imagefolder"

    def __init__(self, opts: ShardOptions, class_names: list[str] | None = None):
        """`class_names`: an existing set's (its ids kept), for SRC as its split `opts.split`
        (shards/addsplit.py); else the sorted class folders of SRC."""
        super().__init__(opts)
        if not opts.src.is_dir():
            raise UserError(f"{opts.src}: not a folder (imagefolder expects SRC/<class>/<image files>)")
        part_dirs = ({opts.split: opts.src} if class_names is not None
                     else self._split_dirs(opts.src) or {"train": opts.src})
        classes = {part: [d for d in visible(path) if d.is_dir()] for part, path in part_dirs.items()}
        found_names = sorted({d.name for dirs in classes.values() for d in dirs})
        self.class_names = found_names if class_names is None else class_names
        label_of = {name: i for i, name in enumerate(self.class_names)}
        if unknown := [name for name in found_names if name not in label_of]:
            raise UserError(f"{opts.src / unknown[0]}: class {unknown[0]!r} is not one of the "
                            f"{len(label_of)} classes of the train split ({len(unknown)} such "
                            "folder(s)); remove or rename it to one of the train split's")
        found: dict[str, list[_Found]] = {}
        for part, path in part_dirs.items():
            self.skipped += [{"path": str(f), "reason": "not inside a class folder"}
                             for f in visible(path) if not f.is_dir()]
            found[part] = [f for d in classes[part] for f in self._walk(d, path, label_of[d.name])]
        exts = self._identify(found, opts)
        self._paths: dict[str, list[str]] = {}
        self._exts: dict[str, list[str]] = {}
        self._sizes: dict[str, np.ndarray] = {}
        for part, files in found.items():
            self._add_part(part, part_dirs[part], [f for f in files if f.path in exts], exts)
        self.fields = {ext: "image" for ext in sorted(set(exts.values()))} | {"cls": "int"}

    def _identify(self, found: dict[str, list[_Found]], opts: ShardOptions) -> dict[str, str]:
        """{path: member ext} of the files PIL recognises; the others are skipped (or fatal)."""
        every = [f.path for files in found.values() for f in files]
        if not every:
            raise UserError(f"{opts.src}: no image files found (expected SRC/<class>/<image files>)")
        shared = None if opts.part is None or opts.src_url else SharedScan(opts.out, self.scan_key(
            [(f.path, f.size, f.mtime_ns) for files in found.values() for f in files]))
        facts = shared.facts() if shared is not None else None
        if shared is not None and facts is not None and len(facts.get("exts", ())) == len(every):
            results = list(zip(facts["exts"], facts["why"], strict=True))  # another part's
            self.shared = shared.path
        else:
            # ~7 us a file on a local disk, where a pool gains nothing even at 20,000 files
            # (measured); on a network filesystem each open waits, and K processes wait together
            workers = opts.workers if len(every) >= PARALLEL_IDENTIFY_MIN else 1
            results = list(parallel_map(_identify_file, every, workers, None, 256))
            if shared is not None:
                self._share(shared, results, WorkDir(opts.out, opts.work_name))
        exts = {}
        for path, (ext, why) in zip(every, results, strict=True):
            if ext is None:
                self.skipped.append({"path": path, "reason": why})
            else:
                exts[path] = ext
        if self.skipped and opts.strict:
            first = self.skipped[0]
            raise UserError(f"{first['path']}: {first['reason']}; {len(self.skipped)} file(s) "
                            "cannot be used (remove them, or drop --strict to skip and list them)")
        return exts

    def _share(self, shared: SharedScan, results: list[tuple[str | None, str | None]],
               work: WorkDir) -> None:
        """Publish what identifying every file found (a part's scan: an open and 16 bytes a
        file) for the other parts, which then only list the folder."""
        if shared.publish(work.make(), {"exts": [ext for ext, _ in results],
                                        "why": [why for _, why in results]}):
            self.shared = shared.path
        work.remove()

    def _add_part(self, part: str, folder: Path, files: list[_Found], exts: dict[str, str]) -> None:
        if not files:
            raise UserError(f"{folder}: no usable image files")
        keys = [safe_key(f.key_path) for f in files]
        check_unique(keys, lambda i: files[i].rel, str(folder))
        labels = np.array([f.label for f in files], dtype=np.int64)
        sizes = int_sizes([f.size for f in files])
        cls_len = [len(str(int(label))) for label in labels]
        tar_bytes = [member_tar_bytes(int(s)) + member_tar_bytes(c)
                     for s, c in zip(sizes, cls_len, strict=True)]
        self.parts[part] = Part(keys, int_sizes(tar_bytes), labels)
        self._paths[part] = [f.path for f in files]
        self._exts[part] = [exts[f.path] for f in files]
        self._sizes[part] = sizes
        self.inputs.extend((f.path, f.size, f.mtime_ns) for f in files)

    @staticmethod
    def _split_dirs(src: Path) -> dict[str, Path] | None:
        """`SRC/train/<class>/...`: split folders that hold class folders, not images."""
        splits = source_splits(src)
        if not splits or not all(p.is_dir() for p in splits.values()):
            return None
        if any(not e.is_dir() for p in splits.values() for e in visible(p)):
            return None
        return splits

    def _walk(self, class_dir: Path, part_dir: Path, label: int) -> list[_Found]:
        found = []
        for root, dirs, files in os.walk(class_dir, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            # os.path.join's result, concatenated: every part repeats this walk, per file
            root_, rel_root = root + os.sep, os.path.relpath(root, part_dir) + os.sep
            for name in sorted(files):
                if name.startswith("."):
                    continue
                path = root_ + name
                try:
                    st = os.stat(path)
                except OSError as e:
                    self.skipped.append({"path": path, "reason": f"unreadable ({e.strerror})"})
                    continue
                found.append(_Found(path, rel_root + name, rel_root + _split_suffix(name)[0],
                                    label, st.st_size, st.st_mtime_ns))
        return found

    def sample(self, part: str, index: int) -> dict[str, Any]:
        path = self._paths[part][index]
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != self._sizes[part][index]:
            raise UserError(f"{path} changed while sharding (was {self._sizes[part][index]} "
                            f"bytes, now {len(data)}); run the same command again")
        label = int(self.parts[part].labels[index])
        return {"__key__": self.parts[part].keys[index], self._exts[part][index]: data,
                "cls": b"%d" % label}
