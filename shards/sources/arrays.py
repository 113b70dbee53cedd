"""`npz` / `npy`: arrays sharing a leading sample axis -> one `<name>.npy` member per array.

SRC is an .npz file, an .npy file, a folder of .npy files (one array each, named by the file), or
a folder of such per split (`train.npz` + `val.npz`, `train/` + `val/`). `--field y=cls` stores
array `y` as another member kind (here a class index) instead of `y.npy`.
"""

from __future__ import annotations

import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.errors import UserError
from ringfeed.formats.kinds import kind_of
from ringfeed.formats.members import encode
from ringfeed.formats.tarblocks import member_tar_bytes
from ringfeed.shards.keys import NumberedKeys, check_ext, safe_key
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.base import (
    Part,
    Source,
    class_record,
    int_sizes,
    source_splits,
    visible,
)

NPY_MAGIC = b"\x93NUMPY"  # how every .npy file begins
CHUNK = 1 << 20  # samples per numpy pass over a class array


class Arrays(Source):
    def __init__(self, opts: ShardOptions):
        super().__init__(opts)
        self.options = {"fields": dict(opts.fields)}
        self._arrays: dict[str, dict[str, np.ndarray]] = {}
        self._exts: dict[str, str] = {}
        splits = source_splits(opts.src)
        for part, path in (splits or {"train": opts.src}).items():
            arrays = self._load(path)
            unknown = set(opts.fields) - set(arrays)
            if unknown:
                raise UserError(f"{path}: no array {sorted(unknown)[0]!r} "
                                f"(arrays: {', '.join(arrays)})")
            lengths = {name: (a.shape[0] if a.ndim else None) for name, a in arrays.items()}
            if len(set(lengths.values())) != 1 or None in lengths.values():
                shapes = ", ".join(f"{n}{tuple(a.shape)}" for n, a in arrays.items())
                raise UserError(f"{path}: arrays must share their first (sample) axis: {shapes}")
            n = next(iter(lengths.values()))
            if n == 0:
                raise UserError(f"{path}: the arrays hold no samples (first axis is 0)")
            for name in arrays:
                ext = opts.fields.get(name) or f"{safe_key(name).lower()}.npy"
                self._exts[name] = check_ext(ext.lower(), f"{path}: array {name!r}")
            if len(set(self._exts.values())) != len(self._exts):
                raise UserError(f"{path}: two arrays map to the same member ({self._exts}); "
                                "rename them or use --field")
            sizes = np.zeros(n, dtype=np.int64)
            for name, array in arrays.items():
                sizes += self._member_sizes(name, array, f"{path}: array {name!r}")
            labels = next((np.asarray(arrays[name], dtype=np.int64) for name, ext in
                           self._exts.items() if ext == "cls"), None)  # for a stratified val split
            self.parts[part] = Part(NumberedKeys(n), int_sizes(sizes), labels)
            self._arrays[part] = arrays
        self.fields = {ext: kind_of(ext) for ext in self._exts.values()}
        # class ids seen in a cls member: the trainer's num_classes
        self.classes = class_record(Counter(v for p in self.parts.values()
                                            if p.labels is not None for v in p.labels.tolist()))

    def _load(self, path: Path) -> dict[str, np.ndarray]:
        if path.is_dir():
            files = [p for p in visible(path) if p.suffix == ".npy"]
            if not files:
                raise UserError(f"{path}: no .npy files in this folder")
            return {p.stem: self._load_npy(p) for p in files}
        if path.suffix == ".npz" or zipfile.is_zipfile(path):
            self.record_input(path)
            mapped = _stored_npz(path)
            if mapped:
                return mapped
            try:
                with np.load(path, allow_pickle=False) as npz:
                    # read once: an NpzFile re-reads (and inflates) an array on every access
                    arrays = {name: npz[name] for name in npz.files}
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise UserError(f"{path}: not a readable .npz file ({e})") from None
            if not arrays:
                raise UserError(f"{path}: the .npz holds no arrays")
            return arrays
        return {path.stem: self._load_npy(path)}

    def _load_npy(self, path: Path) -> np.ndarray:
        self.record_input(path)
        try:
            with open(path, "rb") as f:
                magic = f.read(len(NPY_MAGIC))
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror})") from None
        if magic != NPY_MAGIC:  # numpy would try it as a pickle, and suggest allow_pickle
            raise UserError(f"{path}: not a .npy or .npz file (no numpy header; a table is "
                            "--format csv, jsonl or parquet)")
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable .npy file ({e})") from None

    def _member_sizes(self, name: str, array: np.ndarray, where: str) -> np.ndarray:
        ext = self._exts[name]
        if array.dtype.hasobject:
            raise UserError(f"{where}: object arrays are not supported (use numeric or string dtypes)")
        if kind_of(ext) == "npy":  # every sample has the same shape, so the same .npy size
            return np.full(len(array), member_tar_bytes(len(encode(ext, array[0], where))))
        if kind_of(ext) == "int" and array.ndim == 1 and array.dtype.kind in "iu":
            return _int_member_sizes(array)
        return int_sizes([member_tar_bytes(len(encode(ext, v, f"{where}[{i}]")))
                          for i, v in enumerate(array)])

    def sample(self, part: str, index: int) -> dict[str, Any]:
        arrays = self._arrays[part]
        where = f"{self.path} sample {index}"
        return {"__key__": self.parts[part].keys[index],
                **{self._exts[n]: encode(self._exts[n], a[index], where) for n, a in arrays.items()}}


def _int_member_sizes(array: np.ndarray) -> np.ndarray:
    """Tar bytes of each integer's `cls` member (its decimal digits, as encode writes it),
    counted by numpy in chunks: a part repeats this over every sample."""
    sizes = np.empty(len(array), np.int64)
    for at in range(0, len(array), CHUNK):
        digits = np.char.str_len(np.asarray(array[at:at + CHUNK]).astype(str))
        lengths, inverse = np.unique(digits, return_inverse=True)
        sizes[at:at + len(digits)] = np.array(
            [member_tar_bytes(int(n)) for n in lengths], np.int64)[inverse.reshape(-1)]
    return sizes


def _stored_npz(path: Path) -> dict[str, np.ndarray] | None:
    """An .npz whose arrays are stored uncompressed (np.savez) as memory maps of them, so a
    part reads only its samples' pages; None for any other (np.load reads it whole)."""
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as f:
            arrays = {}
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                    return None
                f.seek(info.header_offset)
                local = f.read(30)  # the local file header: name and extra field lengths last
                f.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little")
                       + int.from_bytes(local[28:30], "little"))
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    return None
                shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                         else np.lib.format.read_array_header_2_0(f))
                if dtype.hasobject:
                    return None
                arrays[info.filename[:-4]] = np.memmap(
                    path, dtype, "r", f.tell(), shape, "F" if fortran else "C")
            return arrays or None
    except (OSError, ValueError, zipfile.BadZipFile):
        return None  # np.load says what is wrong
