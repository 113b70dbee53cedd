"""`ringfeed shard` robustness: same bytes for any --workers, resume after kill -9, verify
catching damaged shards, one-line errors (exit 2) for bad input, wds-index of webdataset's own
shards, and the benchmark's quick mode."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import BIN, ringfeed, run, test_env
from shards_util import cli, make_images, manifest, tree_bytes

from ringfeed.formats.manifest import ShardInfo
from ringfeed.shards.journal import JOURNAL, Journal


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("imgs") / "src", {"a": 23, "b": 17, "c": 11})


def shard_args(src: Path, out: Path, *extra: str) -> list[str]:
    return ["shard", str(src), str(out), "--format", "imagefolder", "--max-count", "4",
            "--val-fraction", "0.2", "--shuffle-seed", "7", *extra]


@pytest.mark.system  # starts processes
@pytest.mark.system
def test_two_workers_write_the_same_bytes_as_one(capsys, tmp_path, images):
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli(capsys, *shard_args(images, one, "--workers", "1"))[0] == 0
    result = ringfeed(*shard_args(images, two, "--workers", "2"), timeout=120)
    assert result.returncode == 0, result.output
    assert result.stderr == ""  # not a terminal: no progress bar
    files = tree_bytes(one)
    # 14 shards + their 14 index sidecars + manifest.json and its binary index, same bytes
    assert len(files) == 30 and files == tree_bytes(two)
    assert sum(name.endswith(".tar.idx") for name in files) == 14


def parquet_table(path: Path, rows: int, row_group_size: int) -> Path:
    """A Parquet file of several row groups: numbers, text, a list and bytes of varying size."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    table = pa.table({
        "blob": pa.array([rng.bytes(int(n)) for n in rng.integers(1, 3000, rows)], pa.binary()),
        "emb": pa.array(list(rng.normal(size=(rows, 3)).astype(np.float32)),
                        pa.list_(pa.float32())),
        "a": pa.array(rng.normal(size=rows)), "b": pa.array(rng.integers(0, 9, rows)),
        "note": pa.array([f"row {i}" for i in range(rows)]),
        "label": pa.array(np.arange(rows) % 3)})
    pq.write_table(table, path, row_group_size=row_group_size)
    assert pq.ParquetFile(path).num_row_groups > 1
    return path


PARQUET_ARGS = ["--format", "parquet", "--field", "blob=bin", "--field", "emb=emb.npy",
                "--field", "label=cls"]


@pytest.mark.system  # starts processes
@pytest.mark.system
def test_parquet_two_workers_write_the_same_bytes_as_one(capsys, tmp_path):
    src = parquet_table(tmp_path / "t.parquet", 300, row_group_size=37)
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*PARQUET_ARGS, "--max-count", "16", "--val-fraction", "0.2", "--shuffle-seed", "5"]
    assert cli(capsys, "shard", src, one, *args, "--workers", "1")[0] == 0
    result = ringfeed("shard", str(src), str(two), *args, "--workers", "2", timeout=120)
    assert result.returncode == 0, result.output
    files = tree_bytes(one)
    assert sum(name.endswith(".tar") for name in files) == 19 and files == tree_bytes(two)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "ringfeed"), *args], env=test_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.system  # starts processes
@pytest.mark.parametrize("kind", ["imagefolder", "parquet"])
@pytest.mark.system
def test_resume_after_kill_9_is_byte_identical(capsys, tmp_path, kind):
    # many small shards, so the kill lands mid-run: 240 samples, 2 per shard
    if kind == "imagefolder":
        src, fmt = make_images(tmp_path / "src", {"x": 120, "y": 120}, side=4), ["--format", kind]
    else:
        src, fmt = parquet_table(tmp_path / "t.parquet", 240, row_group_size=50), PARQUET_ARGS
    out, reference = tmp_path / "out", tmp_path / "reference"
    args = ["shard", str(src), str(out), *fmt, "--max-count", "2",
            "--shuffle-seed", "1", "--val-fraction", "0.1"]
    assert cli(capsys, *[str(reference) if a == str(out) else a for a in args])[0] == 0
    expected = tree_bytes(reference)

    proc = _start(args)
    journal = Journal(out)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(journal.read()[1]) >= 1:  # a first shard is renamed and recorded
                break
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    _, done = journal.read()
    assert 1 <= len(done) < 120, "the kill should land mid-run"
    assert not (out / "manifest.json").exists()
    finals = [p.name for p in out.glob("*.tar")]
    assert all(tree_bytes(out)[name] == expected[name] for name in finals)  # never partial
    kept = {name: (out / name).stat().st_ino for name in done}

    result = ringfeed(*args, timeout=120)
    assert result.returncode == 0, result.output
    assert f"kept {len(done)} finished shard(s)" in result.stdout
    assert {name: (out / name).stat().st_ino for name in done} == kept  # not rewritten
    assert tree_bytes(out) == expected  # no journal, no temp files left either


def test_resume_rehashes_kept_shards_and_replaces_partial_ones(capsys, tmp_path, images):
    out, reference = tmp_path / "out", tmp_path / "reference"
    assert cli(capsys, *shard_args(images, reference))[0] == 0
    shutil.copytree(reference, out)
    # the state a killed run leaves: a journal naming the plan and the shards it finished
    m = manifest(out)
    shards = [ShardInfo(**s) for split in m["splits"].values() for s in split["shards"]]
    Journal(out).start(_plan_id(shard_args(images, out)), {s.name: s for s in shards[:6]})
    (out / "manifest.json").unlink()
    flipped = out / shards[1].name
    data = bytearray(flipped.read_bytes())
    data[700] ^= 0xFF
    flipped.write_bytes(bytes(data))                     # recorded, but content changed
    (out / shards[2].name).write_bytes(b"partial")        # recorded, but truncated
    (out / shards[3].name).unlink()                       # recorded, but gone
    (out / shards[8].name).write_bytes(b"partial tar")    # not recorded: written again
    (out / f".{shards[9].name}.k3x9_a.tmp").write_bytes(b"half a shard")  # a killed write
    (out / f".{shards[9].index}.k3x9_b.tmp").write_bytes(b"half an index")
    (out / shards[4].index).unlink()                      # kept, but its sidecar is gone
    (out / shards[5].index).write_bytes(b"stale")         # kept, but its sidecar is damaged
    inode0 = (out / shards[0].name).stat().st_ino
    sidecar_inode0 = (out / shards[0].index).stat().st_ino

    code, stdout, err = cli(capsys, *shard_args(images, out))
    assert code == 0, err
    assert "kept 3 finished shard(s)" in stdout  # shards 0, 4, 5
    assert (out / shards[0].name).stat().st_ino == inode0
    assert (out / shards[0].index).stat().st_ino == sidecar_inode0  # a good sidecar is kept
    assert tree_bytes(out) == tree_bytes(reference)  # sidecars 4 and 5 rebuilt


@pytest.fixture
def small_disk(tmp_path):
    """A 48 KiB tmpfs (root only): room for a few of the test's ~10 KB shards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.system  # starts processes
@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.system
def test_disk_full_is_one_line_keeps_finished_shards_and_resumes(capsys, tmp_path, images,
                                                                 small_disk, workers):
    reference, out = tmp_path / "reference", small_disk / "out"
    assert cli(capsys, *shard_args(images, reference))[0] == 0
    code, stdout, err = cli(capsys, *shard_args(images, out, "--workers", workers))
    assert code == 2 and stdout == "", err
    assert err.count("\n") == 1 and "No space left on device; fix that and run the same " \
        "command again (finished shards are kept)" in err, err
    finished = {name: data for name, data in tree_bytes(out).items() if name.endswith(".tar")}
    assert finished and not [n for n in tree_bytes(out) if n.endswith(".tmp")]
    assert all(data == (reference / name).read_bytes() for name, data in finished.items())

    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)
    code, stdout, err = cli(capsys, *shard_args(images, out))
    assert code == 0, err
    assert f"kept {len(finished)} finished shard(s)" in stdout
    assert tree_bytes(out) == tree_bytes(reference)


def _plan_id(args: list[str]) -> str:
    """The plan fingerprint `ringfeed ARGS` writes first into its journal."""
    from ringfeed.shards.cli import options_from_args
    from ringfeed.shards.packing import fingerprint, plan_shards
    from ringfeed.shards.sources import open_source
    from ringfeed.train.cli import build_parser

    opts = options_from_args(build_parser().parse_args(args))
    source = open_source(opts)
    try:
        return fingerprint(source, opts, plan_shards(source, opts))
    finally:
        source.close()


def test_unfinished_run_of_other_options_needs_overwrite(capsys, tmp_path, images):
    out = tmp_path / "out"
    assert cli(capsys, *shard_args(images, out))[0] == 0
    Journal(out).start("some-other-plan", {})
    code, _, err = cli(capsys, *shard_args(images, out, "--max-count", "5"))
    assert code == 2 and "unfinished run with other input or options" in err
    code, stdout, _ = cli(capsys, *shard_args(images, out, "--max-count", "5", "--overwrite"))
    assert code == 0 and not (out / JOURNAL).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "manifest.bin"] + [n for sp in manifest(out)["splits"].values()
                             for s in sp["shards"] for n in (s["name"], s["index"])]
    )  # the old 4-per-shard files and their sidecars are gone


def test_verify_names_every_bad_shard(capsys, tmp_path, images):
    out = tmp_path / "out"
    assert cli(capsys, *shard_args(images, out))[0] == 0
    code, stdout, _ = cli(capsys, "verify", out, "--workers", "2")
    assert code == 0 and "14 shards, 51 samples" in stdout and "all OK" in stdout

    flipped, truncated, gone = out / "train-000002.tar", out / "train-000005.tar", out / "val-000001.tar"
    data = bytearray(flipped.read_bytes())
    data[600] ^= 0x01  # one bit inside the first member's data
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1500])
    gone.unlink()
    shutil.copy(out / "train-000003.tar.idx", out / "train-000001.tar.idx")  # another's index
    (out / "train-000008.tar.idx").unlink()
    shutil.copy(truncated, out / "train-000099.tar")  # a stray file the manifest does not list
    m = manifest(out)
    m["splits"]["train"]["shards"][7]["num_samples"] += 1  # a manifest that lies about a count
    (out / "manifest.json").write_text(json.dumps(m))

    code, stdout, _ = cli(capsys, "verify", out)
    assert code == 2
    bad = [line for line in stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 6
    assert bad[0].startswith("BAD train/train-000001.tar: index sidecar train-000001.tar.idx "
                             "does not match the shard")
    assert bad[1].startswith("BAD train/train-000002.tar: sha256 differs")
    assert ";" not in bad[1]  # its headers are intact: the index still matches
    assert bad[2].startswith("BAD train/train-000005.tar:") and "1500 bytes" in bad[2]
    assert "not a readable tar (the file ends inside a tar header" in bad[2]  # cut at 1500
    assert "4 samples, manifest says 5" in bad[3] and "train-000007.tar" in bad[3]
    assert bad[4] == "BAD train/train-000008.tar: index sidecar train-000008.tar.idx is missing"
    assert bad[5] == "BAD val/val-000001.tar: missing"
    assert "6 BAD" in stdout
    assert "note: 1 .tar file(s)" in stdout and "(e.g. train-000099.tar)" in stdout


def _write_file(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _bad_inputs(tmp: Path, images: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (ringfeed args, text the one error line must contain)."""
    empty = tmp / "empty"
    empty.mkdir()
    jsonl = _write_file(tmp / "rows.jsonl", json.dumps({"text": "hi", "label": 1}) + "\n")
    csvf = _write_file(tmp / "rows.csv", "text,label\nhi,1\n")
    junk = tmp / "junk"
    shutil.copytree(images, junk)
    _write_file(junk / "a" / "notes.txt", "not an image")
    dangling = tmp / "dangling"
    shutil.copytree(images, dangling)
    (dangling / "b" / "gone.png").symlink_to(tmp / "nowhere.png")
    twins = tmp / "twins"
    shutil.copytree(images, twins)
    shutil.copy(next((twins / "a").glob("*.png")), twins / "a" / "img000.png")  # img000.jpg too
    full = tmp / "full"
    _write_file(full / "notes.txt")
    done = tmp / "done"
    _write_file(done / "manifest.json", "{}")
    out = str(tmp / "out")
    return {
        "missing SRC": (["shard", str(tmp / "nope"), out, "--format", "imagefolder"],
                        "nope: no such file or folder"),
        "empty SRC": (["shard", str(empty), out, "--format", "imagefolder"], "no image files found"),
        "empty jsonl": (["shard", str(_write_file(tmp / "e.jsonl", "\n")), out, "--format", "jsonl"],
                        "no rows"),
        "unknown format": (["shard", str(images), out, "--format", "xlsx"],
                           "unknown --format 'xlsx'"),
        "jsonl field": (["shard", str(jsonl), out, "--format", "jsonl", "--field", "caption=txt"],
                        "rows.jsonl:1: no field 'caption' (fields: text, label)"),
        "csv column": (["shard", str(csvf), out, "--format", "csv", "--field", "lbl=cls"],
                       "rows.csv: no column 'lbl' (columns: text, label)"),
        "bad class value": (["shard", str(jsonl), out, "--format", "jsonl", "--field", "text=cls"],
                            "field 'text': cannot store 'hi' as .cls"),
        "non-image, strict": (["shard", str(junk), out, "--format", "imagefolder", "--strict"],
                              "notes.txt: not an image"),
        "unreadable, strict": (["shard", str(dangling), out, "--format", "imagefolder", "--strict"],
                               "gone.png: unreadable"),
        "text val of one document": (["shard", str(_write_file(tmp / "one.txt", "a doc")), out,
                                      "--format", "text", "--val-fraction", "0.5"],
                                     "of 1 documents leaves no train documents"),
        "key collision": (["shard", str(twins), out, "--format", "imagefolder"],
                          "a/img000.jpg and a/img000.png both become sample key 'a_img000'"),
        "OUT not empty": (["shard", str(images), str(full), "--format", "imagefolder"],
                          "is not empty (1 entries, e.g. 'notes.txt')"),
        "OUT has shards": (["shard", str(images), str(done), "--format", "imagefolder"],
                           "already holds shards (manifest.json); pass --overwrite"),
        "OUT inside SRC": (["shard", str(images), str(images / "out"), "--format", "imagefolder"],
                           "is inside SRC"),
        "bad size": (["shard", str(images), out, "--format", "imagefolder", "--max-size", "lots"],
                     "--max-size: not a size: 'lots'"),
        "flag of another format": (["shard", str(images), out, "--format", "imagefolder",
                                    "--key", "id"], "--key does not apply to --format imagefolder"),
        "verify without manifest": (["verify", str(empty)], "no manifest.json"),
    }


@pytest.mark.system
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, images):
    cases = _bad_inputs(tmp_path, images)
    for name, (args, expected) in cases.items():
        before = tree_bytes(tmp_path)
        code, stdout, err = cli(capsys, *args)
        assert code == 2, f"{name}: exit {code}, {err}"
        assert err.count("\n") == 1 and err.startswith("ringfeed: error: "), f"{name}: {err!r}"
        assert expected in err, f"{name}: {err!r}"
        assert tree_bytes(tmp_path) == before, f"{name}: wrote something"
        assert not (tmp_path / "out").exists(), name


@pytest.mark.system  # starts processes
@pytest.mark.system
def test_sharding_does_not_import_torch(tmp_path, images):
    # importing webdataset imports torch: ~2 s of CPU per process, for a job that needs none
    code = ("import sys; from ringfeed.train.cli import main; "
            f"code = main(['shard', {str(images)!r}, {str(tmp_path / 'out')!r}, "
            "'--format', 'imagefolder', '--no-progress']); "
            "print(code, sorted(m for m in ('torch', 'tensorflow', 'webdataset') if m in sys.modules))")
    result = run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"


@pytest.mark.system  # starts processes
@pytest.mark.system
def test_bad_input_through_the_console_script(tmp_path):
    result = ringfeed("shard", str(tmp_path / "missing"), str(tmp_path / "out"), "--format",
                      "imagefolder", timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"ringfeed: error: {tmp_path}/missing: no such file or folder\n"


def test_non_images_are_skipped_counted_and_listed(capsys, tmp_path, images):
    src = tmp_path / "src"
    shutil.copytree(images, src)
    _write_file(src / "a" / "notes.txt", "not an image")
    _write_file(src / "b" / "broken.png", "not a png either")
    _write_file(src / "README", "top-level file")
    out = tmp_path / "out"
    code, stdout, _ = cli(capsys, "shard", src, out, "--format", "imagefolder")
    assert code == 0 and "skipped 3 input file(s)" in stdout
    m = manifest(out)
    assert {(Path(s["path"]).name, s["reason"].split(" (")[0]) for s in m["skipped"]} == {
        ("README", "not inside a class folder"), ("notes.txt", "not an image"),
        ("broken.png", "not an image")}
    assert sum(s["num_samples"] for s in m["splits"]["train"]["shards"]) == 51


def test_wds_index_of_compressed_webdataset_shards_reads_every_sample(capsys, tmp_path):
    """webdataset writes and reads .tar.gz / .tgz shards: they get a manifest (counted and
    hashed, no tar index: they are streamed), verify, and the pipeline reads each sample once.
    Something that only has a tar's name is one line naming it, not a traceback."""
    import numpy as np
    import webdataset as wds

    from ringfeed.pipeline import ShardPipeline

    shards = tmp_path / "gz"
    shards.mkdir()
    ids = iter(range(1000))
    for name, n in (("train-0000.tar.gz", 9), ("train-0001.tgz", 7), ("val-0000.tar.gz", 4)):
        with wds.TarWriter(str(shards / name), compress=True) as sink:
            for _ in range(n):
                i = next(ids)
                sink.write({"__key__": f"s{i:04d}", "cls": i % 3, "x.npy": np.array([i])})
    assert (shards / "train-0001.tgz").read_bytes()[:2] == b"\x1f\x8b"  # gzip, really
    code, _, err = cli(capsys, "shard", shards, "--format", "wds-index", "--no-progress")
    assert code == 0, err
    m = manifest(shards)
    train = m["splits"]["train"]["shards"]
    assert [(s["name"], s["num_samples"], s.get("index")) for s in train] == [
        ("train-0000.tar.gz", 9, None), ("train-0001.tgz", 7, None)]
    assert m["classes"]["counts"] and m["fields"] == {"cls": "int", "x.npy": "npy"}
    assert cli(capsys, "verify", shards)[0] == 0
    pipe = ShardPipeline(shards, batch_size=4, balance="pad", cache_dir=tmp_path / "cache")
    seen = [int(x[0]) for batch in pipe
            for x, valid in zip(batch["x.npy"], batch["__valid__"], strict=True) if valid]
    assert sorted(seen) == list(range(16))

    (shards / "train-0002.tar.gz").write_bytes(b"not gzip at all" * 40)
    code, _, err = cli(capsys, "shard", shards, "--format", "wds-index", "--overwrite",
                       "--no-progress")
    assert code == 2 and "train-0002.tar.gz: not a readable tar" in err, err
    assert "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(capsys, "shard", empty, "--format", "wds-index")
    assert code == 2 and "no tar shards found (.tar, .tar.gz, .tgz" in err


def test_wds_index_of_webdataset_shardwriter_output(capsys, tmp_path):
    import webdataset as wds

    shards = tmp_path / "wds"
    shards.mkdir()
    for split, n in (("train", 25), ("val", 7)):
        with wds.ShardWriter(str(shards / f"{split}-%04d.tar"), maxcount=10, verbose=0) as sink:
            for i in range(n):
                sink.write({"__key__": f"{split}{i:03d}", "txt": f"sample {i}", "cls": i % 2,
                            "x.npy": __import__("numpy").arange(i)})
    code, stdout, err = cli(capsys, "shard", shards, "--format", "wds-index", "--workers", "2")
    assert code == 0, err
    m = manifest(shards)
    assert m["fields"] == {"cls": "int", "txt": "text", "x.npy": "npy"}
    assert [(s["name"], s["num_samples"]) for s in m["splits"]["train"]["shards"]] == [
        ("train-0000.tar", 10), ("train-0001.tar", 10), ("train-0002.tar", 5)]
    assert [s["num_samples"] for s in m["splits"]["val"]["shards"]] == [7]
    assert cli(capsys, "verify", shards)[0] == 0
    code, _, err = cli(capsys, "shard", shards, "--format", "wds-index")
    assert code == 2 and "manifest.json exists; pass --overwrite" in err

    elsewhere = tmp_path / "index"  # a manifest in another folder points back at the shards
    assert cli(capsys, "shard", shards, elsewhere, "--format", "wds-index", "--split", "all")[0] == 0
    names = [s["name"] for s in manifest(elsewhere)["splits"]["all"]["shards"]]
    assert names[0] == "../wds/train-0000.tar" and len(names) == 4
    assert cli(capsys, "verify", elsewhere)[0] == 0
    urls = [str(elsewhere / n) for n in names]
    assert len(list(wds.WebDataset(urls, shardshuffle=False))) == 32


def test_written_files_start_their_write_back_as_they_grow(tmp_path, monkeypatch):
    """HashingIO(write_behind=N) hands each N bytes written to the disk (the real
    sync_file_range), so the publishing fsync only waits for the tail; bytes and hash as
    without it."""
    import hashlib

    from ringfeed import fsutil

    calls = []
    real = fsutil.start_writeback

    def spy(fd: int, offset: int, length: int) -> bool:
        calls.append((offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(fsutil, "start_writeback", spy)
    data = os.urandom(10 << 20)
    with open(tmp_path / "f", "wb") as f:
        out = fsutil.HashingIO(f, write_behind=4 << 20)
        for start in range(0, len(data), 1 << 20):
            out.write(data[start:start + (1 << 20)])
    assert calls == [(0, 4 << 20), (4 << 20, 4 << 20)]
    assert out.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "f").read_bytes() == data
    if sys.platform == "linux":  # the call exists: the hint is given, not skipped
        with open(tmp_path / "f", "rb") as f:
            assert real(f.fileno(), 0, 1) is True
