"""`ringfeed shard --part I/N` (issue 50): N parts of one plan, run one after another in any
order, give the bytes of one run (shards, sidecars, manifest.json, manifest.bin) for every
source format, locally and to moto's S3; a part killed with SIGKILL and run again ends the same;
`--merge` names a part that never ran; the part comes from mpirun's, srun's and a Slurm array's
environment, and a real `mpirun -np 2`, on this host and across two network-namespace hosts,
shards one folder into one output."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import BIN, ringfeed, test_env
from shards_util import cli, make_images, tree_bytes

pytestmark = pytest.mark.integration

ROWS = [{"text": f"row {i} " + "y" * (i % 11), "label": i % 3, "a": i * 0.25, "b": i % 5,
         "color": ["red", "green", "blue"][i % 3]} for i in range(40)]
COMMON = ["--val-fraction", "0.25", "--shuffle-seed", "7", "--max-count", "3"]


def _sources(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """{name: (SRC, format options)}: each format ringfeed shard reads, tiny."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    images = make_images(root / "images", {"cat": 7, "dog": 6, "emu": 4})
    (root / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with open(root / "t.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), root / "t.parquet", row_group_size=8)
    x = np.arange(30 * 4, dtype=np.float32).reshape(30, 4)
    np.savez(root / "d.npz", x=x, y=np.arange(30) % 3)
    (root / "npy").mkdir(exist_ok=True)
    np.save(root / "npy" / "x.npy", x)
    (root / "docs").mkdir(exist_ok=True)
    for d in range(12):
        (root / "docs" / f"{d:02d}.txt").write_text(f"document {d} " * (5 + d))
    table = ["--field", "text=txt", "--field", "label=cls", "--categorical", "color"]
    return {"imagefolder": (images, ["--format", "imagefolder"]),
            "jsonl": (root / "t.jsonl", ["--format", "jsonl", *table]),
            "csv": (root / "t.csv", ["--format", "csv", *table]),
            "parquet": (root / "t.parquet", ["--format", "parquet", *table]),
            "npz": (root / "d.npz", ["--format", "npz", "--field", "y=cls"]),
            "npy": (root / "npy", ["--format", "npy"]),
            "text": (root / "docs", ["--format", "text", "--seq-len", "16"])}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _sources(tmp_path_factory.mktemp("parts") / "src")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["imagefolder", "jsonl", "csv", "parquet", "npz", "npy", "text"])
def test_parts_give_the_bytes_of_one_run(capsys, tmp_path, sources, fmt):
    src, args = sources[fmt]
    one = tmp_path / "one"
    code, _, err = cli(capsys, "shard", src, one, *args, *COMMON)
    assert code == 0, err
    expected = tree_bytes(one)
    assert sum(n.endswith(".tar") for n in expected) >= 5  # enough shards for 4 parts
    for n in (1, 2, 3, 4):
        out = tmp_path / f"parts{n}"
        order = list(range(n))[::-1] if n % 2 else list(range(n))  # any order
        for k, i in enumerate(order):
            code, stdout, err = cli(capsys, "shard", src, out, *args, *COMMON, "--part", f"{i}/{n}")
            assert code == 0, err
            assert f"part {i}/{n} (from --part)" in stdout
            last = k == n - 1
            assert ("manifest.json" in os.listdir(out)) == last, stdout
            assert ("the last part to finish writes" in stdout) != last
        assert tree_bytes(out) == expected, f"{n} parts"  # no marker, journal or work dir left


def _scans(out: Path) -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(".ringfeed-scan-")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_part_takes_the_scan_another_part_wrote(capsys, tmp_path, sources, fmt):
    """Part 0 shares its scan; part 1 reads it, not the table: a table overwritten since with
    as many zero bytes (its mtime put back) still gives the bytes of one run of the real one."""
    src, args = sources[fmt]
    copy = tmp_path / src.name
    shutil.copy2(src, copy)
    assert cli(capsys, "shard", copy, tmp_path / "one", *args, *COMMON)[0] == 0
    out = tmp_path / "out"
    assert cli(capsys, "shard", copy, out, *args, *COMMON, "--part", "0/2")[0] == 0
    assert len(_scans(out)) == 1
    st = copy.stat()
    copy.write_bytes(bytes(st.st_size))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, _, err = cli(capsys, "shard", copy, out, *args, *COMMON, "--part", "1/2")
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")  # and the shared scan is gone


@pytest.mark.timeout(120)
def test_an_image_part_takes_the_files_another_part_identified(capsys, tmp_path, sources):
    """Part 1 takes part 0's identified files (their formats, the skipped): an image of part
    0's shards made a non-image since (its size and mtime kept) would, identified again, be
    skipped, another plan, and no manifest."""
    import tarfile

    from ringfeed.shards.keys import safe_key

    src = tmp_path / "images"
    shutil.copytree(sources["imagefolder"][0], src)
    args = ["--format", "imagefolder", *COMMON]
    assert cli(capsys, "shard", src, tmp_path / "one", *args)[0] == 0
    out = tmp_path / "out"
    assert cli(capsys, "shard", src, out, *args, "--part", "0/2")[0] == 0
    assert len(_scans(out)) == 1
    with tarfile.open(sorted(out.glob("*.tar"))[0]) as tar:
        key = tar.getnames()[0].rsplit(".", 1)[0]
    image = next(p for p in src.rglob("*.*") if safe_key(str(p.relative_to(src).with_suffix(""))) == key)
    st = image.stat()
    image.write_bytes(b"not an image".ljust(st.st_size, b"!"))
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, _, err = cli(capsys, "shard", src, out, *args, "--part", "1/2")
    assert code == 0, err
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")


@pytest.mark.timeout(120)
def test_scan_step_before_parts_started_together(capsys, tmp_path, sources):
    """`--scan` leaves the scan the parts then read (as a Slurm array's tasks starting at once
    would, none finding another's): the table zeroed after it still gives one run's bytes."""
    src, args = sources["parquet"]
    copy = tmp_path / src.name
    shutil.copy2(src, copy)
    assert cli(capsys, "shard", copy, tmp_path / "one", *args, *COMMON)[0] == 0
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "shard", copy, out, *args, "--scan")
    assert code == 0, err
    assert f"scan shared in {out}/.ringfeed-scan-" in stdout and _scans(out)
    assert cli(capsys, "shard", copy, out, *args, "--scan")[0] == 0  # again: kept, no second
    st = copy.stat()
    copy.write_bytes(bytes(st.st_size))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    for i in (1, 0):
        assert cli(capsys, "shard", copy, out, *args, *COMMON, "--part", f"{i}/2")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")
    for bad in (["--format", "imagefolder"], [*args, "--part", "0/2"]):
        code, _, err = cli(capsys, "shard", copy, tmp_path / "x", *bad, "--scan")
        assert code == 2 and err.count("\n") == 1 and "--scan: for a local csv" in err, err


def _keep_stat_change_content(path: Path, data: bytes) -> None:
    """`path` rewritten with `data` (its size), its mtime put back: only its content differs."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


TEXT_LAYOUTS = {"rows": ["--seq-len", "16", *COMMON],
                "flat": ["--val-fraction", "0.25", "--shuffle-seed", "7", "--max-count", "40"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["part", "scan"])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_text_parts_take_the_shared_tokens(capsys, tmp_path, sources, layout, how):
    """Text parts map the tokens the first part (or `--scan`) published instead of tokenizing:
    documents changed since in content only (size and mtime kept) still give one run's bytes
    of the documents as they were."""
    docs = tmp_path / "docs"
    shutil.copytree(sources["text"][0], docs)
    args = ["--format", "text", *TEXT_LAYOUTS[layout]]
    assert cli(capsys, "shard", docs, tmp_path / "one", *args)[0] == 0
    out = tmp_path / "out"
    first = ["--scan"] if how == "scan" else ["--part", "0/2"]
    code, stdout, err = cli(capsys, "shard", docs, out, *args, *first)
    assert code == 0, err
    assert len(_scans(out)) == 1
    for doc in docs.iterdir():
        _keep_stat_change_content(doc, doc.read_bytes().upper())
    for i in (1, 0) if how == "scan" else (1,):
        code, _, err = cli(capsys, "shard", docs, out, *args, "--part", f"{i}/2")
        assert code == 0, err
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")  # and the shared scan is gone


@pytest.mark.timeout(180)
def test_a_text_scan_is_another_for_another_tokenizer_file_or_option(capsys, tmp_path, sources):
    """The text scan's key covers the tokenizer.json's content (edited in place, its size and
    mtime kept) and each option that changes the tokens or their split."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([d.read_text() for d in sources["text"][0].iterdir()],
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = tmp_path / "tokenizer.json"
    bpe.save(str(tok))
    out = tmp_path / "out"

    def scans(*more: str) -> int:
        code, _, err = cli(capsys, "shard", sources["text"][0], out, "--format", "text",
                           "--tokenizer", str(tok), *more, "--scan")
        assert code == 0, err
        return len(_scans(out))

    assert scans() == scans() == 1  # the same key: kept
    _keep_stat_change_content(tok, tok.read_bytes().replace(b"\n  ", b"\n\t ", 1))
    assert scans() == 2
    for n, more in enumerate((["--seq-len", "16"], ["--text-field", "body"], ["--glob", "0*"],
                              ["--val-fraction", "0.25"],
                              ["--val-fraction", "0.25", "--shuffle-seed", "3"]), 3):
        assert scans(*more) == n, more


@pytest.mark.timeout(120)
def test_a_stale_scan_is_not_read(capsys, tmp_path, sources):
    """A scan of the table as it was (then changed) is not taken: the parts give the bytes of
    one run of the changed table."""
    src, args = sources["csv"]
    copy = tmp_path / "t.csv"
    shutil.copy2(src, copy)
    out = tmp_path / "out"
    assert cli(capsys, "shard", copy, out, *args, *COMMON, "--part", "0/2")[0] == 0
    copy.write_text(copy.read_text().replace("row 1", "row 9"))
    assert cli(capsys, "shard", copy, tmp_path / "one", *args, *COMMON)[0] == 0
    for i in (0, 1):
        code, _, err = cli(capsys, "shard", copy, out, *args, *COMMON, "--part", f"{i}/2",
                           "--overwrite")
        assert code == 0, err
        assert len(_scans(out)) == (0 if i else 2)  # the stale one and this table's, then none
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")


@pytest.mark.timeout(120)
def test_merge_names_a_part_that_never_ran_and_completes_the_set(capsys, tmp_path, sources):
    src, args = sources["jsonl"]
    assert cli(capsys, "shard", src, tmp_path / "one", *args, *COMMON)[0] == 0
    out = tmp_path / "out"
    for i in (0, 2):
        assert cli(capsys, "shard", src, out, *args, *COMMON, "--part", f"{i}/3")[0] == 0
    code, _, err = cli(capsys, "shard", "--merge", out)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{out}: part 1/3 never ran" in err and "--part 1/3" in err
    # a part that began (its journal is there) is told apart
    (out / ".ringfeed-journal-part-1-of-3.jsonl").write_text('{"plan": "x"}\n')
    code, _, err = cli(capsys, "shard", "--merge", out)
    assert code == 2 and "part 1/3 began but did not finish" in err
    code, _, err = cli(capsys, "shard", src, out, *args, *COMMON, "--part", "1/3")
    assert code == 2 and "holds an unfinished run with other input or options" in err
    (out / ".ringfeed-journal-part-1-of-3.jsonl").unlink()
    assert cli(capsys, "shard", src, out, *args, *COMMON, "--part", "1/3")[0] == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")
    code, stdout, _ = cli(capsys, "shard", "--merge", out)  # a merge step after the parts
    assert code == 0 and f"-> {out}/manifest.json" in stdout

    # the merge writes it when no part did (as when the last was killed after its marker)
    out2 = tmp_path / "out2"
    assert cli(capsys, "shard", src, out2, *args, *COMMON, "--part", "0/2")[0] == 0
    marker = out2 / ".ringfeed-part-0-of-2.json"
    marker.rename(tmp_path / "aside")
    assert cli(capsys, "shard", src, out2, *args, *COMMON, "--part", "1/2")[0] == 0
    assert not (out2 / "manifest.json").exists()
    (tmp_path / "aside").rename(marker)
    code, stdout, err = cli(capsys, "shard", "--merge", out2)
    assert code == 0, err
    assert tree_bytes(out2) == tree_bytes(tmp_path / "one")
    code, _, err = cli(capsys, "shard", "--merge", tmp_path / "none")
    assert code == 2 and "no part has finished" in err


@pytest.mark.timeout(60)
def test_the_part_comes_from_the_launchers_environment(capsys, tmp_path, sources, monkeypatch):
    src, args = sources["npz"]
    assert cli(capsys, "shard", src, tmp_path / "one", *args, *COMMON)[0] == 0
    out = tmp_path / "out"
    launches = [  # (environment, part, the line's source)
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"}, "0/4",
         "srun's SLURM_PROCID/SLURM_STEP_NUM_TASKS"),
        ({"SLURM_ARRAY_TASK_ID": "11", "SLURM_ARRAY_TASK_MIN": "10",
          "SLURM_ARRAY_TASK_COUNT": "4"}, "1/4", "the Slurm array's"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "0",
          "SLURM_NTASKS": "1"}, "2/4", "mpirun's OMPI_COMM_WORLD_RANK"),
        ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
          "OMPI_COMM_WORLD_SIZE": "4"}, "3/4", "--part"),  # an explicit --part wins
    ]
    for env, part, where in launches:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            extra = ["--part", "3/4"] if where == "--part" else []
            code, stdout, err = cli(capsys, "shard", src, out, *args, *COMMON, *extra)
        assert code == 0, err
        assert f"ringfeed shard: part {part} (from {where}" in stdout
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "1")  # an array of one: a whole run
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")  # an sbatch script itself (no step): a whole run
    monkeypatch.setenv("SLURM_NTASKS", "4")
    code, stdout, _ = cli(capsys, "shard", src, tmp_path / "whole", *args, *COMMON)
    assert code == 0 and "ringfeed shard: part" not in stdout
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "9")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")  # --array=0-15:3: not contiguous
    code, _, err = cli(capsys, "shard", src, tmp_path / "x", *args)
    assert code == 2 and "SLURM_ARRAY_TASK_ID" in err and "'9/4'" in err
    code, _, err = cli(capsys, "shard", src, tmp_path / "x", *args, "--part", "4/4")
    assert code == 2 and "--part '4/4': expected I/N with 0 <= I < N" in err


@pytest.mark.system  # starts the CLI, kills it
@pytest.mark.timeout(180)
def test_a_part_killed_with_sigkill_and_rerun_ends_byte_identical(capsys, tmp_path):
    rows = tmp_path / "t.jsonl"
    rows.write_text("".join(json.dumps({"text": "z" * (i % 50), "label": i % 3}) + "\n"
                            for i in range(1600)))
    args = ["--format", "jsonl", "--field", "text=txt", "--field", "label=cls",
            "--shuffle-seed", "1", "--max-count", "2"]  # 800 shards, 400 a part
    assert cli(capsys, "shard", rows, tmp_path / "one", *args)[0] == 0
    out = tmp_path / "out"
    assert cli(capsys, "shard", rows, out, *args, "--part", "0/2")[0] == 0
    journal = out / ".ringfeed-journal-part-1-of-2.jsonl"
    command = ["shard", str(rows), str(out), *args, "--part", "1/2"]
    proc = subprocess.Popen([str(BIN / "ringfeed"), *command], env=test_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if journal.exists() and journal.read_text().count("\n") >= 4:  # 3 shards journaled
                break
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    done = journal.read_text().count("\n") - 1
    assert 3 <= done < 400, "the kill should land mid-part"
    assert not (out / "manifest.json").exists()
    result = ringfeed(*command, timeout=120, env=test_env())
    assert result.returncode == 0, result.output
    assert f"resumed: kept {done} finished shard(s)" in result.stdout
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")


@pytest.mark.timeout(120)
def test_parts_to_s3(capsys, tmp_path, sources, s3_server):
    s3fs = pytest.importorskip("s3fs")
    src, args = sources["parquet"]
    flags = ["--storage-option", f"endpoint_url={s3_server}"]
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("bucket")
    assert cli(capsys, "shard", src, tmp_path / "one", *args, *COMMON)[0] == 0
    for i in (2, 0):
        code, _, err = cli(capsys, "shard", src, "s3://bucket/p", *args, *COMMON, *flags,
                           "--part", f"{i}/3", "--staging", tmp_path / "staging")
        assert code == 0, err
    code, _, err = cli(capsys, "shard", "--merge", "s3://bucket/p", *flags)
    assert code == 2 and "s3://bucket/p: part 1/3 never ran" in err
    code, stdout, err = cli(capsys, "shard", src, "s3://bucket/p", *args, *COMMON, *flags,
                            "--part", "1/3", "--staging", tmp_path / "staging")
    assert code == 0 and "-> s3://bucket/p/manifest.json" in stdout, err
    code, stdout, err = cli(capsys, "shard", "--merge", "s3://bucket/p", *flags)  # a no-op now
    assert code == 0 and "40 samples" in stdout, err
    fs.invalidate_cache()
    got = {p[len("bucket/p/"):]: fs.cat_file(p) for p in fs.find("bucket/p/")}
    expected = tree_bytes(tmp_path / "one")
    manifest = json.loads(got.pop("manifest.json"))
    assert manifest == json.loads(expected.pop("manifest.json"))
    got.pop("manifest.bin"), expected.pop("manifest.bin")  # the manifest's index
    assert got == expected  # shards and sidecars; no marker or journal left


@pytest.mark.timeout(120)
def test_a_part_takes_the_scan_another_part_left_in_the_bucket(capsys, tmp_path, sources,
                                                               s3_server):
    """Part 0 (one machine's staging folder) uploads its scan beside the shards; part 1 (another
    staging folder) downloads and reads it, not the table (zeroed since, its mtime put back);
    the scan's objects are gone with the markers."""
    s3fs = pytest.importorskip("s3fs")
    src, args = sources["csv"]
    copy = tmp_path / src.name
    shutil.copy2(src, copy)
    flags = ["--storage-option", f"endpoint_url={s3_server}"]
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("scans")
    assert cli(capsys, "shard", copy, tmp_path / "one", *args, *COMMON)[0] == 0
    code, _, err = cli(capsys, "shard", copy, "s3://scans/p", *args, *COMMON, *flags,
                       "--part", "0/2", "--staging", tmp_path / "a")
    assert code == 0, err
    fs.invalidate_cache()
    assert [p for p in fs.find("scans/p/") if p.endswith("/facts.json")]
    st = copy.stat()
    copy.write_bytes(bytes(st.st_size))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, stdout, err = cli(capsys, "shard", copy, "s3://scans/p", *args, *COMMON, *flags,
                            "--part", "1/2", "--staging", tmp_path / "b")
    assert code == 0 and "-> s3://scans/p/manifest.json" in stdout, err
    fs.invalidate_cache()
    got = {p[len("scans/p/"):]: fs.cat_file(p) for p in fs.find("scans/p/")}
    expected = tree_bytes(tmp_path / "one")
    assert json.loads(got.pop("manifest.json")) == json.loads(expected.pop("manifest.json"))
    got.pop("manifest.bin"), expected.pop("manifest.bin")
    assert got == expected  # no scan, marker or journal left
    assert not list((tmp_path / "b").rglob(".ringfeed-scan-*"))  # nor in the staging folder

    # --scan into the bucket before parts that start together
    shutil.copy2(src, copy)
    code, stdout, err = cli(capsys, "shard", copy, "s3://scans/q", *args, *flags, "--scan",
                            "--staging", tmp_path / "s")
    assert code == 0 and "scan shared in s3://scans/q/.ringfeed-scan-" in stdout, err
    st = copy.stat()
    copy.write_bytes(bytes(st.st_size))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    for i in (1, 0):
        code, _, err = cli(capsys, "shard", copy, "s3://scans/q", *args, *COMMON, *flags,
                           "--part", f"{i}/2", "--staging", tmp_path / f"q{i}")
        assert code == 0, err
    fs.invalidate_cache()
    got = {p[len("scans/q/"):]: fs.cat_file(p) for p in fs.find("scans/q/")}
    got.pop("manifest.json"), got.pop("manifest.bin")
    assert got == expected


@pytest.mark.timeout(120)
def test_a_text_part_takes_the_tokens_another_part_left_in_the_bucket(capsys, tmp_path, sources,
                                                                      s3_server):
    """Part 0 (one staging folder) uploads its tokens beside the shards; part 1 (another)
    downloads and maps them: documents changed since in content only give one run's bytes."""
    s3fs = pytest.importorskip("s3fs")
    docs = tmp_path / "docs"
    shutil.copytree(sources["text"][0], docs)
    args = ["--format", "text", *TEXT_LAYOUTS["flat"], "--storage-option",
            f"endpoint_url={s3_server}"]
    fs = s3fs.S3FileSystem(endpoint_url=s3_server)
    fs.mkdir("textscan")
    assert cli(capsys, "shard", docs, tmp_path / "one", *args[:-2])[0] == 0
    for i, staging in ((0, "a"), (1, "b")):
        code, _, err = cli(capsys, "shard", docs, "s3://textscan/p", *args, "--part", f"{i}/2",
                           "--staging", tmp_path / staging)
        assert code == 0, err
        for doc in docs.iterdir():  # after part 0: only the shared tokens give one run's bytes
            _keep_stat_change_content(doc, doc.read_bytes().upper())
    fs.invalidate_cache()
    got = {p[len("textscan/p/"):]: fs.cat_file(p) for p in fs.find("textscan/p/")}
    expected = tree_bytes(tmp_path / "one")
    assert json.loads(got.pop("manifest.json")) == json.loads(expected.pop("manifest.json"))
    got.pop("manifest.bin"), expected.pop("manifest.bin")
    assert got == expected  # no scan, marker or journal left


@pytest.mark.system
@pytest.mark.timeout(180)
def test_mpirun_np_2_shards_one_folder(capsys, tmp_path, sources):
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    src, args = sources["imagefolder"]
    assert cli(capsys, "shard", src, tmp_path / "one", *args, *COMMON)[0] == 0
    out = tmp_path / "out"
    result = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
         str(BIN / "ringfeed"), "shard", str(src), str(out), *args, *COMMON],
        env=test_env(), capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    for i in range(2):
        assert f"part {i}/2 (from mpirun's OMPI_COMM_WORLD_RANK" in result.stdout
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")


@pytest.mark.system
@pytest.mark.timeout(240)
def test_mpirun_across_two_netns_hosts_shards_one_folder(capsys, tmp_path, sources):
    """Two "hosts" (network namespaces joined by a veth link, sshd in each, as in
    test_multinode.py, own prefix and subnet so both may run at once) and one OUT on the
    filesystem they share: `mpirun -np 2 -H A:1,B:1` starts part 0 in A and part 1 in B."""
    import sys

    from helpers import REPO
    from netns_sshd import SSHD, root_sshd

    sys.path.insert(0, str(REPO / "benchmarks"))
    import netns_hosts

    reason = netns_hosts.missing_prerequisite("rfsp", ("ip", "ssh", "ssh-keygen", "mpirun"))
    if reason or not os.access(SSHD, os.X_OK):
        pytest.skip(reason or f"{SSHD} not found")
    src, args = sources["imagefolder"]
    assert cli(capsys, "shard", src, tmp_path / "one", *args, *COMMON)[0] == 0
    out, addresses = tmp_path / "out", ("192.168.79.1", "192.168.79.2")
    with netns_hosts.two_hosts("rfsp", addresses) as pair, \
            root_sshd(pair, addresses, tmp_path / "ssh") as wrapper_dir:
        env = test_env(PATH=f"{wrapper_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}")
        deadline = time.monotonic() + 30
        while subprocess.run(["ip", "netns", "exec", pair[0], "ssh", addresses[1], "true"],
                             env=env, capture_output=True, timeout=15).returncode != 0:
            assert time.monotonic() < deadline, "no ssh from host A to host B"
            time.sleep(0.5)
        result = subprocess.run(
            ["ip", "netns", "exec", pair[0], "mpirun", "--allow-run-as-root", "-np", "2",
             "-H", f"{addresses[0]}:1,{addresses[1]}:1", "--mca", "oob_tcp_if_include", "eth0",
             "-x", "PATH", "-x", "PYTHONPATH", str(BIN / "ringfeed"), "shard", str(src),
             str(out), *args, *COMMON],
            env=env, capture_output=True, text=True, timeout=180)
        logins = (tmp_path / "ssh" / f"sshd-{pair[1]}.log").read_text()
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert logins.count("Accepted publickey") >= 2  # the probe's, then mpirun's (part 1) on B
    for i in range(2):
        assert f"part {i}/2 (from mpirun's OMPI_COMM_WORLD_RANK" in result.stdout
    assert tree_bytes(out) == tree_bytes(tmp_path / "one")


def test_array_sources_size_classes_and_map_npz_as_a_part_repeats_it(tmp_path):
    """What every part repeats for npz/npy, vectorised: a class array's member sizes are
    encode's (signs, widths, unsigned), and an uncompressed .npz is mapped, not read whole
    (the arrays np.load gives: C and Fortran order, strings); a compressed one is np.load's."""
    from ringfeed.formats.members import encode
    from ringfeed.formats.tarblocks import member_tar_bytes
    from ringfeed.shards.sources.arrays import _int_member_sizes, _stored_npz

    for a in (np.array([0, -1, 7, 10, -100, 2**62, -2**63], np.int64),
              np.arange(3000, dtype=np.uint16)):
        expected = [member_tar_bytes(len(encode("cls", v, "here"))) for v in a]
        assert _int_member_sizes(a).tolist() == expected
    arrays = {"x": np.arange(12.0).reshape(3, 4), "y": np.asfortranarray(np.arange(6).reshape(2, 3)),
              "s": np.array(["ab", "c"])}
    np.savez(tmp_path / "d.npz", **arrays)
    mapped = _stored_npz(tmp_path / "d.npz")
    assert mapped is not None and all(isinstance(a, np.memmap) for a in mapped.values())
    for name, a in arrays.items():
        assert mapped[name].dtype == a.dtype and np.array_equal(mapped[name], a)
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    assert _stored_npz(tmp_path / "c.npz") is None
