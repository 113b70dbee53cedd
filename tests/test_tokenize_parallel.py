"""Tokenization in parallel within one large file (`ringfeed shard --format text --workers K`,
shards/sources/text.py): a .parquet file is cut into runs of row groups and a .jsonl file into
byte ranges at line starts, pieces the K workers share; the tokens are written in the file's
order, so the shards are byte-identical for any K and any --part I/N. The piece size
(text.SPLIT_BYTES, 4 MB) is made small here so that files of a few hundred KB make many
pieces; the tokenizer is this module's `Chars`, which notes the processes that ran it."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from shards_util import cli, manifest

from ringfeed.shards.sources import text

PIDS = "RINGFEED_TEST_TOKENIZER_PIDS"  # a folder: each process that encodes leaves its pid there
WORDS = ["alpha", "beta", "gamma", "delta", "import", "return", "self", "naïve", "für", "x"]


class Chars:
    """Ids from characters (vocabulary 1001, EOS 1000)."""

    vocab_size = 1001
    eos_id = 1000

    def encode(self, text: str) -> list[int]:
        if os.environ.get(PIDS):
            Path(os.environ[PIDS], str(os.getpid())).touch()
        return [ord(c) % 1000 for c in text]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 120))) for _ in range(n)]


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(text, "SPLIT_BYTES", 16 << 10)


def shard_bytes(out: Path) -> dict[str, bytes]:
    m = manifest(out)
    return {s["name"]: (out / s["name"]).read_bytes()
            for split in m["splits"].values() for s in split["shards"]}


# the row layout (40 rows of 64 tokens a shard) and flat token shards (2,560 tokens a shard)
LAYOUTS = {"rows": ["--seq-len", "64", "--max-count", "40"], "flat": ["--max-count", "2560"]}


def runs(capsys, tmp_path: Path, src: Path, *extra: str, layout: str = "rows"
         ) -> list[dict[str, bytes]]:
    """The shards of one source made with 1 worker, 2 workers and as --part 0/2 + 1/2 (2
    workers each), the manifests' text records equal."""
    common = ["--format", "text", *LAYOUTS[layout],
              "--tokenizer", "test_tokenize_parallel:Chars", *extra]
    outs = []
    for name, more in [("k1", []), ("k2", ["--workers", "2"]), ("parts", ["--part", "0/2"]),
                       ("parts", ["--part", "1/2"])]:
        code, _, err = cli(capsys, "shard", src, tmp_path / name, *common, *more)
        assert code == 0, err
        if name not in [o for o, _ in outs]:
            outs.append((name, tmp_path / name))
    texts = [manifest(out)["text"] for _, out in outs]
    assert texts[0] == texts[1] == texts[2] and texts[0]["documents"] > 100
    return [shard_bytes(out) for _, out in outs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_parquet_file_of_many_row_groups_with_a_null_row_and_val(capsys, tmp_path, small_pieces,
                                                                   layout):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents(3000)
    docs[7] = None  # a null row is no document
    src = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(3000)), "text": docs}), src, row_group_size=100)
    assert len(text._pieces(src)) > 8
    k1, k2, parts = runs(capsys, tmp_path, src, "--val-fraction", "0.05", layout=layout)
    assert len(k1) > 4 and "val-000000.tar" in k1 and k1 == k2 == parts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_large_jsonl_file_with_whole_documents_to_val(capsys, tmp_path, small_pieces, layout):
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) for d in documents(2500, seed=1)]
    lines[100:100] = ["", "   "]  # blank lines are no documents
    src.write_text("\n".join(lines) + "\n")
    pieces = text._pieces(src)
    data = src.read_bytes()
    assert len(pieces) > 8 and pieces[0].start == 0 and pieces[-1].stop is None
    assert all(data[p.start - 1] == ord("\n") and p.stop == q.start
               for p, q in zip(pieces[1:], pieces[2:], strict=False))
    k1, k2, parts = runs(capsys, tmp_path, src, "--val-fraction", "0.1", "--shuffle-seed", "3",
                         layout=layout)
    assert any(name.startswith("val-") for name in k1) and k1 == k2 == parts


def test_one_large_file_is_tokenized_by_every_worker(capsys, tmp_path, small_pieces,
                                                     monkeypatch):
    """Without pieces one file was one worker's task."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(3000, seed=2)))
    (tmp_path / "pids").mkdir()
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))
    code, _, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "text", "--seq-len",
                       "64", "--tokenizer", "test_tokenize_parallel:Chars", "--workers", "2")
    assert code == 0, err
    pids = {int(p.name) for p in (tmp_path / "pids").iterdir()}
    assert len(pids) == 2 and os.getpid() not in pids


def test_a_bad_line_in_a_later_piece_is_named_by_its_line_in_the_file(capsys, tmp_path,
                                                                      small_pieces):
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}) for d in documents(2000, seed=4)]
    lines[1733] = '{"text": 3}'
    src.write_text("\n".join(lines) + "\n")
    code, _, err = cli(capsys, "shard", src, tmp_path / "out", "--format", "text",
                       "--tokenizer", "test_tokenize_parallel:Chars", "--workers", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{src}:1734: no string field 'text'" in err
