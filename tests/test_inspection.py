"""`ringfeed inspect OUT` (shards/inspection.py): the report's lines (source, fields, totals, per
split spread, class balance with names, first samples previewed by kind), the warning when the
class labels do not add up to the manifest, and one line for a shard it cannot read."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from tar_util import write_tar

from ringfeed.errors import UserError
from ringfeed.formats.manifest import Manifest, ShardInfo, Split
from ringfeed.fsutil import sha256_file
from ringfeed.shards.build import created_by, shard_dataset
from ringfeed.shards.inspection import PREVIEW_CHARS, inspect_dataset
from ringfeed.shards.options import ShardOptions


@pytest.fixture
def npz_out(tmp_path: Path) -> Path:
    """`ringfeed shard` of 18 samples (x.npy, cls: i % 3), shards of at most 5, 4 to val."""
    src = tmp_path / "data.npz"
    np.savez(src, x=np.arange(54, dtype=np.float32).reshape(18, 3), y=np.arange(18) % 3)
    opts = ShardOptions(src=src, out=tmp_path / "out", format="npz", fields={"y": "cls"},
                        max_count=5, val_fraction=0.25, shuffle_seed=1, progress=False)
    return shard_dataset(opts).out


def hand_made(out: Path, samples: list[dict[str, bytes]], fields: dict[str, str],
              **manifest) -> Path:
    """One train shard of `samples` written by tarfile, with its manifest."""
    path = write_tar(out / "train-000000.tar", samples)
    Manifest({"train": Split([ShardInfo(path.name, len(samples), path.stat().st_size,
                                        sha256_file(path))])},
             fields=fields, created_by="a test", **manifest).save(out)
    return out


def test_the_report_gives_source_totals_spread_classes_and_first_samples(npz_out, tmp_path):
    lines = inspect_dataset(npz_out, samples=2).splitlines()
    assert lines[:3] == [f"{npz_out}/manifest.json: npz from {tmp_path / 'data.npz'} "
                         f"({created_by()})",
                         "fields: x.npy (npy), cls (int)",
                         "total: 18 samples in 4 shards, 61.4 KB"]
    assert lines[4].split() == ["train", "3", "14", "51.2", "KB", "4/5/5,",
                                "10.2", "KB/20.5", "KB/20.5", "KB"]
    assert lines[5].split()[:3] == ["val", "1", "4"]
    assert lines[6:8] == ["classes in train (3): 0: 4 (28.6%), 1: 5 (35.7%), 2: 5 (35.7%)",
                          "classes in val (3): 0: 2 (50.0%), 1: 1 (25.0%), 2: 1 (25.0%)"]
    assert lines[8] == "first samples of train (train-000000.tar):"
    assert [line.split()[1:] for line in lines[9:11]] == [["cls:", "0,", "x.npy:",
                                                          "float32[3]"]] * 2
    assert lines[11] == "first samples of val (val-000000.tar):" and len(lines) == 14


def test_no_samples_asked_no_samples_shown(npz_out):
    assert "first samples" not in inspect_dataset(npz_out, samples=0)


def test_class_labels_that_do_not_add_up_to_the_manifest_are_a_warning(npz_out):
    manifest = Manifest.load(npz_out)
    shard = manifest.splits["train"].shards[1]
    shard.num_samples += 1
    manifest.save(npz_out)
    warning = inspect_dataset(npz_out, samples=0).splitlines()[-1]
    assert warning == (f"warning: the class totals of train disagree with the manifest: 1 "
                       f"shard(s) hold 5 class labels where it lists 6 samples: "
                       f"{shard.name} (5 of 6); the shard is damaged or not the manifest's "
                       f"(`ringfeed verify {npz_out}` checks every shard)")


def test_class_names_are_shown_with_the_ids(tmp_path):
    samples = [{"__key__": f"k{i}", "cls": b"%d" % c} for i, c in enumerate([1, 0, 1, 1])]
    out = hand_made(tmp_path, samples, {"cls": "int"}, class_names=["cat", "dog"])
    report = inspect_dataset(out, samples=1)
    assert "classes in train (2): cat: 1 (25.0%), dog: 3 (75.0%)" in report
    assert report.splitlines()[-1] == "  k0  cls: 1 (dog)"


def png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side * 2)).save(buf, format="PNG")
    return buf.getvalue()


def test_members_are_previewed_by_their_kind(tmp_path):
    long_text = "x" * (PREVIEW_CHARS + 10)
    sample = {"__key__": "k0", "json": json.dumps({"a": 1, "b": "é"}).encode(),
              "txt": long_text.encode(), "png": png(4), "bin": b"\x00" * 2048,
              "jpg": b"not an image at all"}
    out = hand_made(tmp_path, [sample], {"json": "json", "txt": "text", "png": "image",
                                         "bin": "bytes", "jpg": "image"})
    shown = inspect_dataset(out, samples=1).splitlines()[-1]
    assert shown == (f"  k0  json: '{{\"a\": 1, \"b\": \"é\"}}', txt: '{'x' * PREVIEW_CHARS}...', "
                     f"png: PNG 4x8 RGB, {len(png(4))} B, bin: 2.0 KB, "
                     "jpg: 19 B (cannot preview as image: UnidentifiedImageError)")


def test_byte_level_token_sequences_are_previewed_as_their_text(tmp_path):
    tokens = np.frombuffer(b"hello world", np.uint8).astype(np.uint16)
    buf = io.BytesIO()
    np.save(buf, tokens)
    out = hand_made(tmp_path, [{"__key__": "000000", "tokens.npy": buf.getvalue()}],
                    {"tokens.npy": "npy"}, text={"tokenizer": "bytes", "seq_len": 11})
    report = inspect_dataset(out, samples=1)
    assert "text: tokenizer=bytes, seq_len=11" in report
    assert report.splitlines()[-1] == "  000000  tokens.npy: uint16[11] 'hello world'"


def test_skipped_inputs_are_counted_with_the_first_one(tmp_path):
    out = hand_made(tmp_path, [{"__key__": "a", "txt": b"x"}], {"txt": "text"},
                    skipped=[{"path": "src/a/x.doc", "reason": "not an image"},
                             {"path": "src/b/y.doc", "reason": "not an image"}])
    assert "skipped 2 input file(s), e.g. src/a/x.doc: not an image" in inspect_dataset(out)


def test_a_shard_that_cannot_be_read_is_one_line_pointing_to_verify(npz_out):
    (npz_out / "val-000000.tar").unlink()
    with pytest.raises(UserError) as exc:
        inspect_dataset(npz_out)
    assert str(exc.value) == (f"{npz_out}/val-000000.tar: missing; re-download or re-create "
                              f"it (`ringfeed verify {npz_out}` checks every shard)")


def test_flat_token_shards_preview_document_starts_and_token_ids(tmp_path):
    def npy(array: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, array)
        return buf.getvalue()

    tokens = np.frombuffer(b"hello world, again", np.uint8).astype(np.uint16)
    docs = np.array([0, 6, 12, 13, 14, 15, 16, 17, 18], np.int64)
    out = hand_made(tmp_path, [{"__key__": "shard", "docs.npy": npy(docs),
                                "tokens.npy": npy(tokens)}],
                    {"docs.npy": "npy", "tokens.npy": "npy"},
                    text={"tokenizer": "bytes", "layout": "flat"})
    line = inspect_dataset(out).splitlines()[-1]
    assert line == ("  shard  docs.npy: 9 document starts [0, 6, 12, 13, 14, 15, 16, 17, ...], "
                    "tokens.npy: uint16[18] ids [104, 101, 108, 108, 111, 32, 119, 111, ...] "
                    "'hello world, again'"), line
