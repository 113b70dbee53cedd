"""`ringfeed shard` for every input format: what lands in the tars and in manifest.json, read back
with plain tarfile, `tar tf` and webdataset.WebDataset."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import tarfile

import numpy as np
import pytest
from shards_util import cli, load_npy, make_images, manifest, members, samples, split_samples

from ringfeed.formats.manifest import Manifest
from ringfeed.formats.tarblocks import RECORD as TAR_RECORD


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("imgs") / "src", {"cat": 9, "dog": 7, "emu": 4})


def test_imagefolder_original_bytes_classes_and_manifest(capsys, tmp_path, images):
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "shard", images, out, "--format", "imagefolder",
                            "--max-count", "6")
    assert code == 0, err
    assert err == ""  # no progress bar when stderr is not a terminal
    assert stdout.count("\n") == 1 and "20 samples, 4 shards" in stdout and "MB/s" in stdout
    m = Manifest.load(out)
    assert m.class_names == ["cat", "dog", "emu"]
    assert m.fields == {"jpg": "image", "png": "image", "cls": "int"}
    assert m.source["format"] == "imagefolder" and m.source["path"] == str(images)
    assert [s.name for s in m.splits["train"].shards] == [f"train-00000{i}.tar" for i in range(4)]
    assert [s.num_samples for s in m.splits["train"].shards] == [6, 6, 6, 2]
    seen = {}
    for shard in m.splits["train"].shards:
        assert (out / shard.name).stat().st_size == shard.bytes
        assert shard.bytes % TAR_RECORD == 0
        for sample in samples(out / shard.name):
            [ext] = [e for e in sample if e not in ("__key__", "cls")]
            cls = int(sample["cls"])
            original = images / m.class_names[cls] / f"{sample['__key__'].split('_', 1)[1]}.{ext}"
            assert sample[ext] == original.read_bytes()  # no re-encode
            seen[sample["__key__"]] = cls
    assert len(seen) == 20 and sorted(seen.values()) == [0] * 9 + [1] * 7 + [2] * 4
    # fixed tar headers: a shard's bytes depend on its samples only
    with tarfile.open(out / "train-000000.tar") as tar:
        headers = {(i.mtime, i.uname, i.uid, i.gid, i.mode) for i in tar.getmembers()}
    assert headers == {(946684800, "ringfeed", 0, 0, 0o444)}


def test_imagefolder_tells_formats_by_content(capsys, tmp_path):
    """Common formats by signature, the rest by PIL's `Image.open`; a file's own image
    extension names its member, a file without one gets the format's."""
    from PIL import Image

    pixels = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), np.uint8))
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for name, fmt in [("g.gif", "GIF"), ("b.bmp", "BMP"), ("p.ppm", "PPM"), ("w.webp", "WEBP"),
                      ("t.tif", "TIFF"), ("j.jpeg", "JPEG"), ("bare", "PNG"), ("d.dat", "JPEG"),
                      ("i.ico", "ICO")]:
        pixels.save(src / name, format=fmt)
    (src / "fake.png").write_text("a png in name only")
    (src / "empty.jpg").write_bytes(b"")
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src.parent, out, "--format", "imagefolder")
    assert code == 0, err
    m = manifest(out)
    assert {s["path"].rsplit("/", 1)[1]: s["reason"] for s in m["skipped"]} == {
        "fake.png": "not an image (PIL cannot identify it)",
        "empty.jpg": "not an image (PIL cannot identify it)",
        "i.ico": "unsupported image format ICO"}
    [shard] = m["splits"]["train"]["shards"]
    stored = {name.rsplit(".", 1)[0]: name.split(".", 1)[1] for name, _ in members(out / shard["name"])
              if not name.endswith(".cls")}
    assert stored == {"a_g": "gif", "a_b": "bmp", "a_p": "ppm", "a_w": "webp", "a_t": "tiff",
                      "a_j": "jpg", "a_bare": "png", "a_d": "jpg"}


@pytest.mark.system
def test_webdataset_and_tar_read_the_shards(capsys, tmp_path, images):
    import webdataset as wds

    out = tmp_path / "out"
    assert cli(capsys, "shard", images, out, "--format", "imagefolder", "--max-count", "8")[0] == 0
    m = manifest(out)
    urls = [str(out / s["name"]) for s in m["splits"]["train"]["shards"]]
    decoded = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8"))
    assert len(decoded) == 20
    for sample in decoded:
        image = sample.get("png", sample.get("jpg"))
        assert image.shape == (8, 8, 3) and isinstance(sample["cls"], int)
    listing = subprocess.run(["tar", "tf", urls[0]], capture_output=True, text=True, check=True)
    names = listing.stdout.split()
    assert len(names) == 16 and all(n.count(".") == 1 and "/" not in n for n in names)


def test_imagefolder_val_fraction_is_stratified_and_seeded(capsys, tmp_path, images):
    def run(seed: int, out):
        args = ["shard", images, out, "--format", "imagefolder", "--val-fraction", "0.25",
                "--shuffle-seed", str(seed), "--max-count", "5"]
        assert cli(capsys, *args)[0] == 0
        return ([s["__key__"] for s in split_samples(out, "train")],
                [s["__key__"] for s in split_samples(out, "val")])

    train, val = run(0, tmp_path / "a")
    assert len(val) == 5 and len(train) == 15 and not set(train) & set(val)
    val_classes = sorted(k.split("_")[0] for k in val)
    assert val_classes == ["cat", "cat", "dog", "dog", "emu"]  # 9/7/4 * 0.25, largest remainders
    assert run(0, tmp_path / "b") == (train, val)  # same seed: same split, same order
    other_train, other_val = run(1, tmp_path / "c")
    assert (other_train, other_val) != (train, val)
    assert train != sorted(train)  # shuffled across shards, not source order


def test_imagefolder_existing_splits(capsys, tmp_path):
    src = tmp_path / "src"
    make_images(src / "train", {"a": 3, "b": 2})
    make_images(src / "validation", {"a": 1, "b": 1, "c": 1}, seed=1)
    out = tmp_path / "out"
    assert cli(capsys, "shard", src, out, "--format", "imagefolder")[0] == 0
    m = Manifest.load(out)
    assert m.class_names == ["a", "b", "c"]
    assert m.splits["train"].num_samples == 5 and m.splits["val"].num_samples == 3
    assert sorted(int(s["cls"]) for s in split_samples(out, "val")) == [0, 1, 2]
    code, _, err = cli(capsys, "shard", src, tmp_path / "o2", "--format", "imagefolder",
                       "--val-fraction", "0.1")
    assert code == 2 and "already has a val split" in err


def test_max_size_bounds_every_shard(capsys, tmp_path, images):
    out = tmp_path / "out"
    assert cli(capsys, "shard", images, out, "--format", "imagefolder", "--max-size", "20KB")[0] == 0
    shards = manifest(out)["splits"]["train"]["shards"]
    assert len(shards) > 3
    assert all(s["bytes"] <= 20_000 and (out / s["name"]).stat().st_size == s["bytes"]
               for s in shards)
    assert sum(s["num_samples"] for s in shards) == 20


def test_unsafe_file_names_become_safe_unique_keys(capsys, tmp_path):
    src = tmp_path / "src"
    make_images(src, {"a b": 1})
    first = next((src / "a b").iterdir())
    for name in ["x..y.png", "-- odd name --.jpg", "ünï.png", "z" * 150 + ".png"]:
        shutil.copy(first, src / "a b" / name)
    out = tmp_path / "out"
    assert cli(capsys, "shard", src, out, "--format", "imagefolder")[0] == 0
    names = [n for n, _ in members(out / "train-000000.tar")]
    keys = [n.split(".", 1)[0] for n in names]
    assert len(set(keys)) == 5 and len(names) == 10
    for name in names:
        assert "/" not in name and ".." not in name and name.isascii() and len(name) < 100
        assert name.count(".") == 1


def test_jsonl_fields_key_and_rest_as_json(capsys, tmp_path):
    src = tmp_path / "data.jsonl"
    rows = [{"id": f"doc-{i}", "text": f"héllo {i}", "label": i % 3, "meta": {"n": i}}
            for i in range(12)]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "jsonl", "--field", "text=txt",
                       "--field", "label=cls", "--key", "id", "--max-count", "5")
    assert code == 0, err
    m = manifest(out)
    assert m["fields"] == {"txt": "text", "cls": "int", "json": "json"}
    got = split_samples(out, "train")
    assert [s["__key__"] for s in got] == [f"doc-{i}" for i in range(12)]
    for row, s in zip(rows, got, strict=True):
        assert s["txt"].decode() == row["text"] and int(s["cls"]) == row["label"]
        assert json.loads(s["json"]) == {"id": row["id"], "meta": row["meta"]}


def test_jsonl_folder_with_split_files(capsys, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps({"t": f"a{i}"}) + "\n" for i in range(4)))
    (src / "val.jsonl").write_text(json.dumps({"t": "b"}) + "\n")
    out = tmp_path / "out"
    assert cli(capsys, "shard", src, out, "--format", "jsonl", "--field", "t=txt")[0] == 0
    assert [s["txt"] for s in split_samples(out, "val")] == [b"b"]
    assert len(split_samples(out, "train")) == 4


def test_csv_quoted_multiline_cells_and_image_paths(capsys, tmp_path, images):
    src = tmp_path / "table.csv"
    files = sorted(images.rglob("*.png"))[:5]
    with open(src, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["caption", "label", "path", "score", "note"])
        for i, p in enumerate(files):
            w.writerow([f'line {i}, "quoted"\nsecond line', i, str(p), i / 2, f"n{i}"])
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "csv", "--field", "caption=txt",
                       "--field", "label=cls", "--field", "path=png", "--shuffle-seed", "3",
                       "--workers", "2", "--max-count", "2")
    assert code == 0, err
    got = {int(s["cls"]): s for s in split_samples(out, "train")}
    assert sorted(got) == list(range(5))
    for i, p in enumerate(files):
        assert got[i]["txt"].decode() == f'line {i}, "quoted"\nsecond line'
        assert got[i]["png"] == p.read_bytes()
        # the numeric column no --field names is a feature; the text column goes to json
        np.testing.assert_array_equal(load_npy(got[i]["x.npy"]), np.float32([i / 2]))
        assert json.loads(got[i]["json"]) == {"note": f"n{i}"}
    assert manifest(out)["fields"] == {"txt": "text", "cls": "int", "png": "image",
                                       "x.npy": "npy", "json": "json"}


def test_npz_arrays_and_npy_folder(capsys, tmp_path):
    x = np.arange(30 * 6, dtype=np.float32).reshape(30, 2, 3)
    y = np.arange(30) % 4
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "out"
    assert cli(capsys, "shard", tmp_path / "d.npz", out, "--format", "npz", "--field", "y=cls",
               "--max-count", "7", "--val-fraction", "0.2")[0] == 0
    m = manifest(out)
    assert m["fields"] == {"x.npy": "npy", "cls": "int"}
    got = split_samples(out, "train") + split_samples(out, "val")
    assert len(got) == 30 and len(split_samples(out, "val")) == 6
    for s in got:
        i = int(s["__key__"])
        np.testing.assert_array_equal(load_npy(s["x.npy"]), x[i])
        assert int(s["cls"]) == y[i]

    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y.astype(np.int16))
    out2 = tmp_path / "out2"
    assert cli(capsys, "shard", folder, out2, "--format", "npy")[0] == 0
    assert manifest(out2)["fields"] == {"x.npy": "npy", "y.npy": "npy"}
    first = split_samples(out2, "train")[3]
    np.testing.assert_array_equal(load_npy(first["x.npy"]), x[3])
    assert load_npy(first["y.npy"]).dtype == np.int16 and load_npy(first["y.npy"]) == y[3]


def test_text_bytes_tokenizer_packs_documents_with_eos(capsys, tmp_path):
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    docs = {"a.txt": "first document\n", "sub/b.txt": "zweites Dokument, ü\n" * 7,
            "c.jsonl": json.dumps({"text": "third"}) + "\n" + json.dumps({"text": "fourth"})}
    for name, text in docs.items():
        (src / name).write_text(text)
    (src / ".hidden").write_text("never read")
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "text", "--seq-len", "16",
                       "--max-count", "4")
    assert code == 0, err
    m = manifest(out)
    stream = []  # documents in sorted path order (a, c, sub/b), a .jsonl file per line
    for doc in [docs["a.txt"].encode(), b"third", b"fourth", docs["sub/b.txt"].encode()]:
        stream += list(doc) + [256]
    n = len(stream) // 16
    assert m["fields"] == {"tokens.npy": "npy"}
    assert m["text"] == {"tokenizer": "bytes", "dtype": "uint16", "eos_id": 256, "vocab_size": 257,
                         "seq_len": 16, "documents": 4, "tokens": len(stream),
                         "dropped_tokens": len(stream) - n * 16}
    seqs = [load_npy(s["tokens.npy"]) for s in split_samples(out, "train")]
    assert len(seqs) == n and all(s.dtype == np.uint16 and s.shape == (16,) for s in seqs)
    assert np.concatenate(seqs).tolist() == stream[: n * 16]
    assert not (out / ".ringfeed-work").exists()


TOKENIZER_MODULE = '''
class WideTokenizer:
    """Word ids above 65535, so tokens need uint32."""
    vocab_size = 70_000
    eos_token_id = 0

    def encode(self, text):
        return [65_536 + (sum(map(ord, w)) % 4000) for w in text.split()]
'''


def test_text_tokenizer_from_a_module(capsys, tmp_path, monkeypatch):
    (tmp_path / "wide_tok.py").write_text(TOKENIZER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    src = tmp_path / "doc.txt"
    src.write_text("alpha beta gamma delta " * 10)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "text", "--seq-len", "8",
                       "--tokenizer", "wide_tok:WideTokenizer", "--workers", "2")
    assert code == 0, err
    m = manifest(out)
    assert m["text"]["tokenizer"] == "wide_tok:WideTokenizer" and m["text"]["dtype"] == "uint32"
    assert m["text"]["eos_id"] == 0 and m["text"]["vocab_size"] == 70_000
    seqs = [load_npy(s["tokens.npy"]) for s in split_samples(out, "train")]
    expected = [65_536 + sum(map(ord, w)) % 4000 for w in ["alpha", "beta", "gamma", "delta"] * 10]
    assert np.concatenate(seqs).tolist() == (expected + [0])[:40]
    assert seqs[0].dtype == np.uint32

    code, _, err = cli(capsys, "shard", src, tmp_path / "o2", "--format", "text",
                       "--tokenizer", "no_such_module_xyz:Tok")
    assert code == 2 and err.count("\n") == 1 and "cannot import no_such_module_xyz" in err


TIKTOKEN_MODULE = r'''
import tiktoken

_ranks = {bytes([i]): i for i in range(256)}
for _merge in [b"th", b"he", b"the", b" the", b"in", b"ing"]:
    _ranks[_merge] = len(_ranks)
# a real tiktoken Encoding, built here instead of downloaded: byte ranks plus a few merges
tiny = tiktoken.Encoding(
    name="tiny", mergeable_ranks=_ranks, special_tokens={"<|endoftext|>": len(_ranks)},
    pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
'''


def test_text_with_a_real_tiktoken_encoding(capsys, tmp_path, monkeypatch):
    (tmp_path / "tiny_tiktoken.py").write_text(TIKTOKEN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tiny_tiktoken

    enc = tiny_tiktoken.tiny
    docs = ["the thing in the ring", "nothing <|endoftext|> here: just text", "sing " * 30]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    code, _, err = cli(capsys, "shard", src, out, "--format", "text", "--seq-len", "8",
                       "--tokenizer", "tiny_tiktoken:tiny")
    assert code == 0, err
    m = manifest(out)
    assert m["text"]["eos_id"] == enc.eot_token == 262 and m["text"]["vocab_size"] == enc.n_vocab
    stream = [t for d in docs for t in [*enc.encode_ordinary(d), enc.eot_token]]
    seqs = sorted(split_samples(out, "train"), key=lambda s: s["__key__"])
    assert np.concatenate([load_npy(s["tokens.npy"]) for s in seqs]).tolist() == \
        stream[: len(stream) // 8 * 8]
    assert enc.decode(stream[: stream.index(enc.eot_token)]) == docs[0]


ODD_TOKENIZERS_MODULE = '''
class AddedTokens:
    """Shaped like a Hugging Face tokenizer: `vocab_size` leaves out the added special tokens
    (its EOS among them), `len()` counts them."""
    vocab_size, eos_token_id = 300, 305

    def __len__(self):
        return 310

    def encode(self, text):
        return [7] * len(text.split())


class Failing(AddedTokens):
    def encode(self, text):
        raise RuntimeError("cannot encode this")
'''


def test_text_tokenizer_size_with_added_tokens_and_its_failures(capsys, tmp_path, monkeypatch):
    (tmp_path / "odd_tok.py").write_text(ODD_TOKENIZERS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    src = tmp_path / "doc.txt"
    src.write_text("one two three " * 20)
    code, _, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "text", "--seq-len",
                       "8", "--tokenizer", "odd_tok:AddedTokens")
    assert code == 0, err
    assert manifest(tmp_path / "out")["text"]["vocab_size"] == 310
    code, _, err = cli(capsys, "shard", src, tmp_path / "o2", "--format", "text", "--tokenizer",
                       "odd_tok:Failing")
    assert code == 2 and err.count("\n") == 1
    assert f"{src}: tokenizer odd_tok:Failing failed (RuntimeError: cannot encode this)" in err
    assert not (tmp_path / "o2").exists()


BYTE_TOKENIZER_MODULE = '''
class ByteTokenizer:
    """The bytes of the text (ids 0-255, EOS 256), but through the module-tokenizer path."""
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text):
        return list(text.encode())
'''


def _stream(out, split: str) -> list[int]:
    """The split's tokens in packing order (sequence keys are numbered in that order)."""
    seqs = sorted(split_samples(out, split), key=lambda s: s["__key__"])
    return np.concatenate([load_npy(s["tokens.npy"]) for s in seqs]).tolist()


@pytest.mark.parametrize("tokenizer", ["bytes", "byte_tok:ByteTokenizer"])
def test_text_val_fraction_draws_whole_documents(capsys, tmp_path, monkeypatch, tokenizer):
    from ringfeed.shards.split import choose_val

    (tmp_path / "byte_tok.py").write_text(BYTE_TOKENIZER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = [f"<document {i:02d}> ".encode() + b"words " * (1 + i % 5) for i in range(40)]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d.decode()}) + "\n" for d in docs))

    def shard(out, seed):
        code, _, err = cli(capsys, "shard", src, out, "--format", "text", "--seq-len", "32",
                           "--val-fraction", "0.25", "--shuffle-seed", str(seed), "--max-count",
                           "3", "--tokenizer", tokenizer, "--workers", "2")
        assert code == 0, err
        return _stream(out, "train"), _stream(out, "val"), manifest(out)

    def packed(documents):  # each split packs its own documents, in source order
        stream = [t for d in documents for t in [*d, 256]]
        return stream[: len(stream) // 32 * 32]

    train, val, m = shard(tmp_path / "out", 5)
    drawn = choose_val(40, None, 0.25, np.random.default_rng([5, 0]))  # the seeded draw
    assert m["text"]["documents"] == 40 and m["text"]["val_documents"] == drawn.sum() == 10
    assert val == packed([d for d, v in zip(docs, drawn, strict=True) if v])
    assert train == packed([d for d, v in zip(docs, drawn, strict=True) if not v])
    assert shard(tmp_path / "again", 5)[:2] == (train, val)
    assert shard(tmp_path / "other", 6)[1] != val  # another seed draws other documents


def test_progress_bar_when_asked(capsys, tmp_path, images):
    code, _, err = cli(capsys, "shard", images, tmp_path / "out", "--format", "imagefolder",
                       "--progress")
    assert code == 0 and "sample" in err and "MB/s" in err


def test_inspect_shows_counts_classes_and_samples(capsys, tmp_path, images):
    out = tmp_path / "out"
    assert cli(capsys, "shard", images, out, "--format", "imagefolder", "--val-fraction", "0.2",
               "--max-count", "6")[0] == 0
    code, report, _ = cli(capsys, "inspect", out, "--samples", "2")
    assert code == 0
    assert "total: 20 samples in 4 shards" in report
    assert "classes in train (3): cat: 7 (43.8%), dog: 6 (37.5%), emu: 3 (18.8%)" in report
    assert "classes in val (3): cat: 2 (50.0%), dog: 1 (25.0%), emu: 1 (25.0%)" in report
    assert "first samples of val (val-000000.tar):" in report
    assert "cls: 0 (cat)" in report and "8x8 RGB" in report
    shutil.rmtree(out)
    code, _, err = cli(capsys, "inspect", out)
    assert code == 2 and "no manifest.json" in err
