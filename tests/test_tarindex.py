"""ringfeed.formats.tarindex: the index yields what webdataset's tar iterator yields (ringfeed's own shards
and foreign ones with pax/GNU long names, subdirectories, multi-dot and upper-case extensions,
directories and meta files), from any sample on; the writer's sidecars are build_index's;
intact_samples catches truncation, overwritten headers and indexes of other shards; damaged
tars index their readable prefix with a reason; garbage is not an index."""

from __future__ import annotations

import io
import json
import mmap
import pickle
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from shards_util import cli, make_images, manifest

from ringfeed.formats.manifest import Manifest, ShardInfo
from ringfeed.formats.tarindex import MAGIC, TarIndex, build_index
from ringfeed.formats.tarwrite import TAR_MODE, TAR_MTIME, TAR_OWNER, SampleTarWriter
from ringfeed.train.cli import main as ringfeed_main

# -- helpers --------------------------------------------------------------------------------

def shard_cli(*args: object) -> int:
    """`ringfeed ARGS` in this process; its exit code."""
    return ringfeed_main([str(a) for a in args])



def wds_read(data: bytes) -> tuple[list[dict], Exception | None]:
    """What webdataset's tar iterator (as the pipeline runs it) yields before it stops, and the
    exception that stopped it."""
    from webdataset.handlers import reraise_exception
    from webdataset.tariterators import group_by_keys, tar_file_expander

    out: list[dict] = []
    files = tar_file_expander([{"url": "mem", "stream": io.BytesIO(data)}],
                              handler=reraise_exception)
    try:
        for sample in group_by_keys(files, handler=reraise_exception):
            assert sample.pop("__url__") == "mem" and "__local_path__" not in sample
            out.append(sample)
    except Exception as e:  # noqa: BLE001 - whatever stopped it
        return out, e
    return out, None


def index_of(data: bytes) -> tuple[TarIndex, str | None]:
    return build_index(io.BytesIO(data))


def read_all(index: TarIndex, buf, start: int = 0) -> list[dict]:
    return [index.sample(buf, i) for i in range(start, index.num_samples)]


def assert_same_as_webdataset(data: bytes) -> TarIndex:
    expected, error = wds_read(data)
    assert error is None, error
    index, reason = index_of(data)
    assert reason is None
    got = read_all(index, data)
    assert [list(s) for s in got] == [list(s) for s in expected]  # keys and field order
    assert got == expected
    assert index.keys == [s["__key__"] for s in expected]
    assert [index.key(i) for i in range(index.num_samples)] == index.keys
    assert index.intact_samples(data, len(data)) == index.num_samples
    # from the middle: a fresh index (as loaded from a sidecar) reading i..end only
    for start in sorted({0, 1, index.num_samples // 2, index.num_samples - 1} - {-1}):
        fresh = TarIndex.from_bytes(index.to_bytes())
        assert read_all(fresh, data, start) == expected[start:]
    return index


def tar_bytes(members: list[tuple[str, bytes] | tarfile.TarInfo], fmt=tarfile.PAX_FORMAT,
              end: bool = True) -> bytes:
    """A tar of (name, data) regular files and ready-made TarInfos (directories, links)."""
    out = io.BytesIO()
    tar = tarfile.open(fileobj=out, mode="w", format=fmt)
    for m in members:
        if isinstance(m, tarfile.TarInfo):
            tar.addfile(m)
        else:
            info = tarfile.TarInfo(m[0])
            info.size, info.mtime = len(m[1]), 1_000_000_000
            tar.addfile(info, io.BytesIO(m[1]))
    if end:
        tar.close()
    else:
        tar.fileobj = io.BytesIO()  # drop the end blocks close() writes
        tar.close()
    return out.getvalue()


def member_ranges(data: bytes) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of every member, by tarfile."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar]


def wds_foreign_shard(fmt: str) -> bytes:
    """webdataset.TarWriter output with the awkward cases, plus entries TarWriter cannot make."""
    import webdataset as wds

    out = io.BytesIO()
    with wds.TarWriter(out, format=fmt, mtime=0) as w:
        w.write({"__key__": "plain", "txt": b"a", "cls": b"1"})
        w.write({"__key__": "k" * 130, "txt": b"long key", "json": b"{}"})  # > 100 chars
        w.write({"__key__": "dir/sub/key", "txt": b"in a folder", "tokens.npy": b"\x93NUMPY.."})
        w.write({"__key__": "UPPER", "JPG": b"\xff\xd8jpeg", "Tokens.NPY": b"npy", "TXT": b"t"})
        w.write({"__key__": "a.b/c", "txt": b"dot in a folder name"})
        w.write({"__key__": "empty", "txt": b"", "bin": bytes(range(256)) * 3})
        directory = tarfile.TarInfo("dir")
        directory.type = tarfile.DIRTYPE
        w.tarstream.addfile(directory)
        link = tarfile.TarInfo("link.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "plain.txt"
        w.tarstream.addfile(link)
        for name, data in (("__meta__", b"skipped"), ("__x__/y.txt", b"skipped too"),
                           ("README", b"no extension: skipped")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            w.tarstream.addfile(info, io.BytesIO(data))
        w.write({"__key__": "plain", "txt": b"the key again, not adjacent: another sample"})
        w.write({"__key__": "bad", "txt": b"x"})
        flag = tarfile.TarInfo("bad.__bad__")  # a __bad__ member with bytes drops its sample
        flag.size = 1
        w.tarstream.addfile(flag, io.BytesIO(b"1"))
        w.write({"__key__": "last", "txt": b"z" * 5000})
    return out.getvalue()


# -- the index reads what webdataset reads --------------------------------------------------

@pytest.fixture(scope="module")
def ringfeed_shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rf")
    images = make_images(tmp / "imgs", {"a": 9, "b": 7})
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": "é" * i, "label": i % 3, "n": [i]}) + "\n"
                            for i in range(40)))
    outs = []
    for args in (["--format", "imagefolder", "--max-count", "5", "--val-fraction", "0.2",
                  "--shuffle-seed", "3"],
                 ["--format", "jsonl", "--field", "text=txt", "--field", "label=cls",
                  "--max-count", "16"]):
        out = tmp / f"out{len(outs)}"
        src = images if "imagefolder" in args else rows
        assert shard_cli("shard", src, out, *args, "--no-progress") == 0
        outs.append(out)
    return outs


def _shards(out: Path) -> list[dict]:
    return [s for split in manifest(out)["splits"].values() for s in split["shards"]]


def test_ringfeed_shards_index_as_webdataset_reads_them(ringfeed_shards):
    checked = 0
    for out in ringfeed_shards:
        for shard in _shards(out):
            assert shard["index"] == shard["name"] + ".idx"
            data = (out / shard["name"]).read_bytes()
            sidecar = TarIndex.load(out / shard["index"])
            index = assert_same_as_webdataset(data)
            assert sidecar == index and sidecar.to_bytes() == index.to_bytes()
            assert sidecar.num_samples == shard["num_samples"]
            checked += 1
    assert checked == 7  # 3 train + 1 val image shards, 3 jsonl shards


def test_foreign_shards_with_awkward_names(tmp_path):
    for fmt in ("PAX_FORMAT", "GNU_FORMAT"):
        data = wds_foreign_shard(fmt)
        names = [n for n, _, _ in member_ranges(data)]
        assert "k" * 130 + ".txt" in names and "dir" in names and "__meta__" in names
        index = assert_same_as_webdataset(data)
        assert index.keys == ["plain", "k" * 130, "dir/sub/key", "UPPER", "a.b/c", "empty",
                              "plain", "last"]
        # TarWriter writes fields in sorted order: JPG, TXT, Tokens.NPY
        assert list(index.sample(data, 3)) == ["__key__", "jpg", "txt", "tokens.npy"]
        assert set(index.fields) == {"cls", "txt", "json", "tokens.npy", "jpg", "bin"}
        # an mmap of the file serves the same bytes
        path = tmp_path / f"{fmt}.tar"
        path.write_bytes(data)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            assert index.intact_samples(mm, len(data)) == index.num_samples
            assert read_all(index, mm) == read_all(index, data)
        with open(path, "rb") as f:  # a real file: the header blocks come from an mmap
            assert build_index(f) == (index, None)


def test_webdataset_grouping_rules():
    cases = [
        # a __bad__ member with bytes drops its sample; an empty one is a field like any other
        [("a.txt", b"1"), ("a.__bad__", b"x"), ("b.txt", b"2"), ("b.__bad__", b""), ("c.txt", b"3")],
        # non-ASCII (pax) key, empty members, a name ending in '.', dotted folders
        [("ключ.txt", b"k"), ("ключ.cls", b""), ("x.", b"dot"), ("d.e/f.g.h", b"deep")],
        # upper-case field names are lower-cased; keys keep their case
        [("Key.TXT", b"u"), ("key.txt", b"l"), ("KEY.Txt", b"m")],
    ]
    for members in cases:
        assert_same_as_webdataset(tar_bytes(members))
    index = assert_same_as_webdataset(tar_bytes(cases[0]))
    assert index.keys == ["b", "c"]
    assert index.sample(tar_bytes(cases[0]), 0) == {"__key__": "b", "txt": b"2", "__bad__": b""}


def test_duplicate_member_ends_the_index_like_webdataset():
    for dup in ("a.TXT", "a.__key__"):
        data = tar_bytes([("z.txt", b"0"), ("a.txt", b"1"), ("a.cls", b"2"), (dup, b"3"),
                          ("b.txt", b"4")])
        expected, error = wds_read(data)
        assert isinstance(error, ValueError) and len(expected) == 1
        index, reason = index_of(data)
        assert read_all(index, data) == expected  # 'a' is lost, 'b' never reached
        assert reason.startswith("corrupt or truncated tar after sample 'z' (ValueError: ")
        assert "duplicate" in reason


# -- the writer's sidecar -------------------------------------------------------------------

def test_writer_records_build_index_and_tarfile_bytes():
    samples = [{"__key__": f"{i:06d}", "txt": "héllo" * i, "cls": str(i), "x.npy": bytes(i * 100),
                "__meta": "left out"} for i in range(30)]
    out = io.BytesIO()
    with SampleTarWriter(out) as writer:
        for s in samples:
            writer.write(s)
    data = out.getvalue()
    assert writer.index() == build_index(io.BytesIO(data))[0]
    assert writer.index().to_bytes() == build_index(io.BytesIO(data))[0].to_bytes()
    # the bytes tarfile's addfile/close would write
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for s in samples:
            for ext in sorted(k for k in s if not k.startswith("_")):
                value = s[ext].encode() if isinstance(s[ext], str) else s[ext]
                info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                info.size, info.mtime, info.mode = len(value), TAR_MTIME, TAR_MODE
                info.uname = info.gname = TAR_OWNER
                tar.addfile(info, io.BytesIO(value))
    assert data == ref.getvalue()
    assert read_all(writer.index(), data) == wds_read(data)[0]


# -- intact_samples -------------------------------------------------------------------------

def _expected_intact(index: TarIndex, cut: int) -> int:
    """Leading samples whose every member's data ends inside the first `cut` bytes."""
    ends = index.member_offset + index.member_size
    for i in range(index.num_samples):
        lo, hi = index.sample_start[i], index.sample_start[i + 1]
        if (ends[lo:hi] > cut).any():
            return i
    return index.num_samples


def test_intact_samples_of_truncated_files(ringfeed_shards):
    shard = _shards(ringfeed_shards[0])[0]
    data = (ringfeed_shards[0] / shard["name"]).read_bytes()
    index = TarIndex.load(ringfeed_shards[0] / shard["index"])
    assert index.intact_samples(data, len(data)) == index.num_samples == 5
    counts = set()
    for cut in range(0, len(data), 97):
        truncated = data[:cut]
        n = index.intact_samples(truncated, len(truncated))
        assert n == _expected_intact(index, cut), cut
        assert index.intact_samples(data, cut) == n  # the file size given is what counts
        counts.add(n)
    assert counts == set(range(6))


def test_intact_samples_stops_at_garbage_over_a_header():
    data = wds_foreign_shard("PAX_FORMAT")
    index, _ = index_of(data)
    rng = np.random.default_rng(0)
    for member in range(index.num_members):
        sample = int(np.searchsorted(index.sample_start, member, side="right")) - 1
        header = int(index.member_offset[member]) - 512
        damaged = bytearray(data)
        damaged[header:header + 512] = rng.integers(0, 256, 512, dtype=np.uint8).tobytes()
        assert index.intact_samples(bytes(damaged), len(data)) == sample
        one_bit = bytearray(data)
        one_bit[header + 5] ^= 0x01  # a name changed: the checksum no longer holds
        assert index.intact_samples(bytes(one_bit), len(data)) == sample
    flipped = bytearray(data)
    flipped[int(index.member_offset[-1])] ^= 0xFF  # data is not checked (the sha256 is)
    assert index.intact_samples(bytes(flipped), len(data)) == index.num_samples


def test_intact_samples_with_an_index_of_another_shard(tmp_path):
    # token shards: every sample the same size, so the two shards' members sit at the same
    # offsets with the same sizes; only the names (keys) tell them apart
    (tmp_path / "doc.txt").write_text("".join(f"line {i}\n" for i in range(400)))
    out = tmp_path / "out"
    assert shard_cli("shard", tmp_path / "doc.txt", out, "--format", "text", "--seq-len", "32",
                     "--max-count", "10", "--no-progress") == 0
    first, second = _shards(out)[:2]
    a = (out / first["name"]).read_bytes()
    index_a = TarIndex.load(out / first["index"])
    index_b = TarIndex.load(out / second["index"])
    assert np.array_equal(index_a.member_offset, index_b.member_offset)
    assert np.array_equal(index_a.member_size, index_b.member_size)
    assert index_b.intact_samples(a, len(a)) == 0
    assert index_a.intact_samples(a, len(a)) == 10
    # two tars that agree up to a point: the other index holds up to where they diverge
    shared = [(f"s{i}.txt", bytes([i]) * 700) for i in range(6)]
    x = tar_bytes(shared + [("x6.txt", b"x" * 700), ("x7.txt", b"x")])
    y = tar_bytes(shared + [("y6.txt", b"y" * 900), ("y7.txt", b"y")])
    assert index_of(y)[0].intact_samples(x, len(x)) == 6
    image_shard = tar_bytes([("img.jpg", b"j" * 3000), ("img.cls", b"1")])
    assert index_of(image_shard)[0].intact_samples(x, len(x)) == 0


def _rewrite_header(data: bytes, offset_data: int, edit) -> bytes:
    """Apply `edit(header: bytearray)` to the header before `offset_data`, then store the
    checksum tarfile computes (unsigned) unless `edit` returns one to store."""
    out = bytearray(data)
    header = bytearray(out[offset_data - 512:offset_data])
    chksum = edit(header)
    if chksum is None:
        header[148:156] = b" " * 8
        chksum = sum(header)
    header[148:156] = b"%06o\0 " % chksum
    out[offset_data - 512:offset_data] = header
    return bytes(out)


def test_intact_samples_reads_header_fields_as_tarfile_does():
    data = tar_bytes([("a.txt", b"x" * 1000), ("b.txt", b"y" * 10)], fmt=tarfile.USTAR_FORMAT)
    index, _ = index_of(data)
    off = int(index.member_offset[0])

    def trailing_space(h):  # old tars end number fields with a space
        h[124:136] = b"%011o " % 1000

    def padded(h):
        h[124:136] = b"  1750\0\0\0\0\0\0"

    def signed(h):  # Sun/NeXT tars sum signed chars; the name has bytes >= 128
        h[0:100] = "é.txt".encode().ljust(100, b"\0")
        h[148:156] = b" " * 8
        return 256 + sum(b - 256 if b >= 128 else b for b in h) - 256

    def base256(h):  # what GNU tar writes for members over 8 GB
        h[124:136] = b"\x80" + (1000).to_bytes(11, "big")

    def wrong_size(h):
        h[124:136] = b"%011o\0" % 999

    # (edit, size tarfile reads, samples intact for an index built from the edited tar)
    for edit, size, intact in ((trailing_space, 1000, 2), (padded, 1000, 2), (signed, 1000, 2),
                               (base256, 1000, 0), (wrong_size, 999, 2)):
        edited = _rewrite_header(data, off, edit)
        with tarfile.open(fileobj=io.BytesIO(edited)) as tar:  # tarfile accepts each
            assert tar.next().size == size, edit.__name__
        rebuilt, reason = index_of(edited)
        assert reason is None and rebuilt.num_samples == 2, edit.__name__
        assert rebuilt.intact_samples(edited, len(edited)) == intact, edit.__name__
        # the original index no longer matches the edited header
        assert index.intact_samples(edited, len(edited)) == 0, edit.__name__


# -- damaged tars ---------------------------------------------------------------------------

def test_build_index_of_truncated_tars_is_webdatasets_prefix():
    data = wds_foreign_shard("GNU_FORMAT")
    full, _ = index_of(data)
    reasons = truncations = 0
    for cut in list(range(0, len(data), 131)) + list(range(512, len(data), 512)):
        truncated = data[:cut]
        expected, error = wds_read(truncated)
        index, reason = index_of(truncated)
        got = read_all(index, truncated)
        if reason is not None and error is None:  # a lost header: its sample may be partial
            assert got == expected[:len(got)] and len(got) >= len(expected) - 1, cut
            expected = got
        assert got == expected, cut
        if error is not None:
            assert reason is not None and reason.startswith("corrupt or truncated tar"), cut
            after = f"after sample {expected[-1]['__key__']!r}" if expected else "at its start"
            assert after in reason, (cut, reason)
            reasons += 1
        if reason is None:  # clean: cut where the tar could have ended
            assert error is None
        else:  # a cut inside a header is the end of the archive to tarfile, not to the index
            truncations += error is None
        assert full.intact_samples(truncated, cut) == _expected_intact(full, cut)
    assert reasons > 20 and truncations > 5


def test_build_index_of_corrupt_tars():
    data = tar_bytes([(f"s{i}.txt", bytes([65 + i]) * 600) for i in range(5)])
    ranges = member_ranges(data)
    # garbage over the third header: tarfile (and so webdataset) takes it for the end
    damaged = bytearray(data)
    damaged[ranges[2][1] - 512:ranges[2][1]] = b"\x07" * 512
    expected, error = wds_read(bytes(damaged))
    assert error is None and len(expected) == 2  # webdataset stops silently ...
    index, reason = index_of(bytes(damaged))
    assert read_all(index, bytes(damaged)) == expected[:1]  # (s1 may have lost a member)
    assert reason == (f"corrupt or truncated tar after sample 's0' (invalid tar header at "
                      f"offset {ranges[2][1] - 512})")  # ... the index says why
    # a tar that is garbage from its start, an empty file, a gzip file
    for bad, text in ((b"\x01" * 4096, "at its start (ReadError: "),
                      (b"", "at its start (ReadError: empty file)"),
                      (zlib.compress(data, wbits=31), "gzip-compressed tar")):
        index, reason = index_of(bad)
        assert index.num_samples == 0 and text in reason, reason
    # the end-of-archive blocks missing, or a tar of nothing: not an error, as for tarfile
    assert index_of(tar_bytes([("a.txt", b"1")], end=False))[1] is None
    assert index_of(tar_bytes([])) == (index_of(b"\0" * 10240)[0], None)
    # trailing bytes that are not a tar header
    index, reason = index_of(tar_bytes([("a.txt", b"1")], end=False) + b"junk")
    assert index.keys == [] and "ends inside a tar header" in reason  # (a may be partial)


@pytest.mark.system
def test_sparse_members_are_not_indexable(tmp_path):
    import subprocess

    (tmp_path / "a.txt").write_bytes(b"before")
    with open(tmp_path / "sparse.bin", "wb") as f:
        f.seek(1 << 20)
        f.write(b"end")
    tar = tmp_path / "s.tar"
    result = subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tar), "-C",
                             str(tmp_path), "a.txt", "sparse.bin"], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"no GNU tar here ({result.stderr!r})")
    with tarfile.open(tar) as t:
        if not t.getmember("sparse.bin").issparse():
            pytest.skip("tar did not write a sparse member here")
    with open(tar, "rb") as f:
        index, reason = build_index(f)
    assert index.num_samples == 0  # 'a' is lost with the member after it, as in webdataset
    assert reason == ("corrupt or truncated tar at its start (member 'sparse.bin' is a sparse "
                      "file, which cannot be indexed)")


# -- serialisation --------------------------------------------------------------------------

def test_save_load_and_from_bytes_rejects_garbage(tmp_path):
    index, _ = index_of(wds_foreign_shard("PAX_FORMAT"))
    path = tmp_path / "x.tar.idx"
    index.save(path)
    assert TarIndex.load(path) == index and path.read_bytes() == index.to_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tar.idx"]  # no temp file left
    empty, _ = index_of(tar_bytes([]))
    assert TarIndex.from_bytes(empty.to_bytes()) == empty and empty.num_samples == 0

    good = index.to_bytes()
    body = good[:-4]
    version_at = len(MAGIC)
    other_version = bytearray(body)
    other_version[version_at:version_at + 4] = struct.pack("<I", 2)
    other_version = bytes(other_version) + struct.pack("<I", zlib.crc32(bytes(other_version)))
    bad_arrays = bytearray(body)  # a consistent crc over inconsistent content
    bad_arrays[-len(index.key_blob) - 1] ^= 0x7F
    bad_arrays = bytes(bad_arrays) + struct.pack("<I", zlib.crc32(bytes(bad_arrays)))
    cases = {
        "empty": b"",
        "garbage": bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)),
        "pickle": pickle.dumps({"fields": ["txt"], "keys": ["a"]}),
        "npz": _npz_bytes(),
        "json": json.dumps({"fields": []}).encode(),
        "truncated": good[:-100],
        "one bit": good[:200] + bytes([good[200] ^ 1]) + good[201:],
        "a key changed": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],  # only the crc tells
        "longer": good + b"\0",
        "version 2": other_version,
        "bad arrays": bad_arrays,
    }
    for name, data in cases.items():
        with pytest.raises(ValueError) as e:
            TarIndex.from_bytes(data)
        if name == "version 2":
            assert "version 2 is not supported" in str(e.value)
        if name == "a key changed":
            assert "crc32" in str(e.value)
    path.write_bytes(cases["pickle"])
    with pytest.raises(ValueError, match=f"{path}: not a ringfeed tar index"):
        TarIndex.load(path)


def _npz_bytes() -> bytes:
    out = io.BytesIO()
    np.savez(out, keys=np.array(["a"], dtype=object))
    return out.getvalue()


def test_old_manifest_without_index_loads(tmp_path):
    m = Manifest(splits={})
    data = json.loads(m.to_json())
    data["splits"] = {"train": {"shards": [{"name": "a.tar", "num_samples": 1, "bytes": 10240,
                                            "sha256": None}]}}
    loaded = Manifest.from_dict(data)
    assert loaded.splits["train"].shards == [ShardInfo("a.tar", 1, 10240, None, None)]


# -- wds-index ------------------------------------------------------------------------------

def test_wds_index_writes_sidecars_equal_to_build_index(tmp_path):
    import webdataset as wds

    shards = tmp_path / "wds"
    shards.mkdir()
    with wds.ShardWriter(str(shards / "train-%04d.tar"), maxcount=7, verbose=0) as sink:
        for i in range(17):
            sink.write({"__key__": f"s{i:03d}", "txt": f"sample {i}", "x.npy": np.arange(i)})
    (shards / "sub").mkdir()
    shutil.copy(shards / "train-0000.tar", shards / "sub" / "val-0000.tar")

    assert shard_cli("shard", shards, "--format", "wds-index", "--no-progress") == 0
    listed = _shards(shards)
    assert [(s["name"], s["index"]) for s in listed] == [
        (f"train-000{i}.tar", f"train-000{i}.tar.idx") for i in range(3)]
    for s in listed:
        data = (shards / s["name"]).read_bytes()
        assert (shards / s["index"]).read_bytes() == index_of(data)[0].to_bytes()
        assert read_all(TarIndex.load(shards / s["index"]), data) == wds_read(data)[0]

    elsewhere = tmp_path / "elsewhere"
    assert shard_cli("shard", f"{shards}/{{train-0000,sub/val-0000}}.tar", elsewhere,
                     "--format", "wds-index", "--no-progress") == 0
    listed = _shards(elsewhere)
    assert [s["name"] for s in listed] == ["../wds/train-0000.tar", "../wds/sub/val-0000.tar"]
    for s in listed:
        assert s["index"] == f"index/{s['sha256'][:16]}-{Path(s['name']).name}.idx"
        data = (elsewhere / s["name"]).read_bytes()
        assert (elsewhere / s["index"]).read_bytes() == index_of(data)[0].to_bytes()
    inside = tmp_path / "wds" / "sub"  # OUT above the shards: paths without '..'
    assert shard_cli("shard", shards / "sub", shards, "--format", "wds-index", "--overwrite",
                     "--no-progress") == 0
    [s] = _shards(shards)
    assert s["name"] == "sub/val-0000.tar" and s["index"] == "sub/val-0000.tar.idx"
    assert (inside / "val-0000.tar.idx").is_file()
    assert shard_cli("verify", shards) == 0


def test_wds_index_refuses_a_tar_it_cannot_index(capsys, tmp_path):
    shards = tmp_path / "wds"
    shards.mkdir()
    data = tar_bytes([(f"s{i}.txt", b"x" * 600) for i in range(3)])
    ranges = member_ranges(data)
    damaged = bytearray(data)
    damaged[ranges[1][1] - 512:ranges[1][1]] = b"\x07" * 512  # webdataset would stop silently
    (shards / "train-0.tar").write_bytes(bytes(damaged))
    code, _, err = cli(capsys, "shard", shards, "--format", "wds-index", "--no-progress")
    assert code == 2 and "train-0.tar: cannot be indexed: corrupt or truncated tar at its " \
        "start (invalid tar header at offset" in err  # (s0 may have lost a member)
    assert sorted(p.name for p in shards.iterdir()) == ["train-0.tar"]  # nothing written


@pytest.mark.parametrize("fmt", ["GNU_FORMAT", "PAX_FORMAT"])
def test_tar_samples_are_webdatasets_without_importing_it(fmt):
    from ringfeed.formats.tarread import tar_samples

    def ours(data: bytes) -> tuple[list[dict], Exception | None]:
        out: list[dict] = []
        try:
            for sample in tar_samples(io.BytesIO(data), "mem"):
                assert sample.pop("__url__") == "mem"
                out.append(sample)
        except Exception as e:  # noqa: BLE001 - whatever stopped it
            return out, e
        return out, None

    data = wds_foreign_shard(fmt)
    for cut in [len(data), *range(0, len(data), 173)]:
        expected, error = wds_read(data[:cut])
        got, our_error = ours(data[:cut])
        assert got == expected and type(our_error) is type(error), cut
    twice = tar_bytes([("a.txt", b"1"), ("a.txt", b"2")])
    assert isinstance(ours(twice)[1], ValueError) and isinstance(wds_read(twice)[1], ValueError)


@pytest.mark.system
def test_tar_commands_do_not_import_torch(tmp_path):
    import subprocess
    import sys

    (tmp_path / "train-0.tar").write_bytes(tar_bytes([("a.txt", b"1"), ("a.cls", b"0")]))
    for command in (["shard", str(tmp_path), "--format", "wds-index"], ["verify", str(tmp_path)],
                    ["inspect", str(tmp_path)]):
        code = (f"import sys; from ringfeed.train.cli import main; rc = main({command!r}); "
                "loaded = [m for m in ('torch', 'webdataset') if m in sys.modules]; "
                "assert not loaded, loaded; sys.exit(rc)")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, (command, result.stderr[-2000:])
