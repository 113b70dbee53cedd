"""Tables to trained models with nothing but `model: {name: mlp}` (issue 14), end to end: real
ringfeed processes on real tables from scikit-learn's bundled datasets.

- breast cancer (569 rows, 30 features) through CSV and through Parquet, PyTorch and TensorFlow,
  1 rank and 2: with 5 epochs, validation accuracy >= 0.9 and within 0.03 of a linear model's
  (scikit-learn's LogisticRegression on the same standardised train/val split: 0.982; majority
  class 0.623), and >= 0.9 after the default single epoch (the README recipe test);
- diabetes (442 rows, a float target) regressed with MSE: validation MSE below 0.8 x the MSE of
  predicting the train mean;
- wds-index shards train with no num_classes given;
- every recipe of the README's "Your own data" runs as written (the CSV and Parquet ones to
  the end; the others capped at a few steps);
- a Parquet file larger than the memory budget shards in bounded memory (peak RSS measured).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import BIN, REPO, horovodrun, ringfeed, run
from shards_util import load_npy, make_images, split_samples
from tabular_util import write_csv, write_parquet

pytestmark = pytest.mark.system
RINGFEED = BIN / "ringfeed"


def shard(src: Path, out: Path, fmt: str, *fields: str) -> Path:
    res = ringfeed("shard", str(src), str(out), "--format", fmt, *fields, "--val-fraction", "0.2",
                   "--shuffle-seed", "0", timeout=120)
    assert res.returncode == 0, res.output
    return out


def train(tmp: Path, shards: Path, name: str, *overrides: str, ranks: int = 1) -> dict:
    """`ringfeed train` with the smallest config: model mlp, the shards, an output dir."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "mlp"}, "data": {"train": str(shards)},
                                   "output": {"dir": str(tmp / name)}}))
    args = ["train", str(cfg), *[a for o in overrides for a in ("--set", o)]]
    res = (horovodrun(ranks, [RINGFEED, *args], timeout=300) if ranks > 1
           else ringfeed(*args, timeout=300))
    assert res.returncode == 0, res.output[-4000:]
    assert res.stderr.count("ringfeed: error") == 0
    return json.loads((tmp / name / "summary.json").read_text())


def split_arrays(out: Path, split: str, target: str) -> tuple[np.ndarray, np.ndarray]:
    samples = split_samples(out, split)
    x = np.stack([load_npy(s["x.npy"]) for s in samples]).astype(np.float64)
    y = np.array([int(s[target]) if target == "cls" else load_npy(s[target]).item()
                  for s in samples])
    return x, y


@pytest.fixture(scope="module")
def cancer(tmp_path_factory) -> dict:
    """Breast cancer shards from CSV and from Parquet, and a linear model's val accuracy."""
    from sklearn.linear_model import LogisticRegression

    tmp = tmp_path_factory.mktemp("cancer")
    shards = {
        "csv": shard(write_csv(tmp / "t.csv", "breast_cancer"), tmp / "csv", "csv",
                     "--field", "label=cls"),
        "parquet": shard(write_parquet(tmp / "t.parquet", "breast_cancer"), tmp / "pq",
                         "parquet", "--field", "label=cls"),
    }
    x, y = split_arrays(shards["csv"], "train", "cls")
    vx, vy = split_arrays(shards["csv"], "val", "cls")
    mean, std = x.mean(0), x.std(0)
    linear = LogisticRegression(max_iter=5000).fit((x - mean) / std, y)
    return {"tmp": tmp, "shards": shards, "linear": linear.score((vx - mean) / std, vy),
            "majority": max(np.mean(vy), 1 - np.mean(vy))}


# CSV's shards here; the Parquet shards train with nothing else set in the two-rank test below
# (one launch per framework and format costs ~7 CPU-s of imports on the 2-core box)
@pytest.mark.parametrize("source", ["csv"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_breast_cancer_trains_with_nothing_else_set(cancer, source, framework):
    done = train(cancer["tmp"], cancer["shards"][source], f"{source}-{framework}",
                 f"framework={framework}", "train.epochs=5")
    accuracy = done["val"]["accuracy"]
    print(f"{source} {framework}: val accuracy {accuracy:.4f} (linear model "
          f"{cancer['linear']:.4f}, majority class {cancer['majority']:.4f})")
    assert accuracy >= 0.9 and accuracy >= cancer["linear"] - 0.03, (accuracy, cancer["linear"])


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_breast_cancer_on_two_ranks(cancer, framework):
    done = train(cancer["tmp"], cancer["shards"]["parquet"], f"two-{framework}",
                 f"framework={framework}", ranks=2)
    assert done["world_size"] == 2 and done["val"]["accuracy"] >= 0.9, done["val"]


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("diabetes")
    shards = {
        "csv": shard(write_csv(tmp / "d.csv", "diabetes"), tmp / "csv", "csv",
                     "--field", "progression=y.npy"),
        "parquet": shard(write_parquet(tmp / "d.parquet", "diabetes"), tmp / "pq", "parquet",
                         "--field", "progression=y.npy"),
    }
    _, y = split_arrays(shards["csv"], "train", "y.npy")
    _, vy = split_arrays(shards["csv"], "val", "y.npy")
    return {"tmp": tmp, "shards": shards, "baseline": float(np.mean((vy - y.mean()) ** 2))}


@pytest.mark.parametrize("source, framework", [("csv", "torch"), ("parquet", "tensorflow")])
def test_diabetes_regresses_below_the_mean_baseline(diabetes, source, framework):
    done = train(diabetes["tmp"], diabetes["shards"][source], f"{source}-{framework}",
                 f"framework={framework}")
    val = done["val"]
    print(f"{source} {framework}: val mse {val['mse']:.1f}, mae {val['mae']:.1f} (predicting "
          f"the train mean: mse {diabetes['baseline']:.1f})")
    assert set(val) == {"loss", "mse", "mae"}  # no accuracy for a regression
    assert val["mse"] < 0.8 * diabetes["baseline"], (val, diabetes["baseline"])


def test_wds_index_shards_train_without_num_classes(tmp_path):
    import webdataset as wds

    shards = tmp_path / "wds"
    shards.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 200), ("val", 40)):
        with wds.ShardWriter(str(shards / f"{split}-%04d.tar"), maxcount=64, verbose=0) as sink:
            for i in range(n):
                label = i % 3
                x = rng.normal(size=6).astype(np.float32)
                x[label] += 3.0
                sink.write({"__key__": f"{split}{i:04d}", "x.npy": x, "cls": label})
    res = ringfeed("shard", str(shards), "--format", "wds-index", timeout=60)
    assert res.returncode == 0, res.output
    done = train(tmp_path, shards, "wds", "train.epochs=3")
    assert done["val"]["accuracy"] > 0.8, done["val"]


# -- the README recipes, as written --------------------------------------------------------
def readme_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Your own data", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def recipe_data(cwd: Path) -> None:
    """The inputs the recipes name, made here: photos/, table.csv, table.parquet, docs.jsonl,
    wds/ (webdataset ShardWriter shards), wds-gz/ (the same, gzipped by ShardWriter for a
    .tar.gz name, and a .tar beside them), arrays.npz."""
    import webdataset as wds

    make_images(cwd / "photos", {"cat": 24, "dog": 24})
    write_csv(cwd / "table.csv", "breast_cancer")
    write_parquet(cwd / "table.parquet", "breast_cancer")
    lines = [json.dumps({"text": f"document {i}: " + "ringfeed shards data. " * (5 + i % 7)})
             for i in range(60)]
    (cwd / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (cwd / "wds").mkdir()
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(cwd / "wds" / "train-%04d.tar"), maxcount=50, verbose=0) as sink:
        for i in range(120):
            sink.write({"__key__": f"s{i:04d}", "x.npy": rng.normal(size=4).astype(np.float32),
                        "cls": i % 2})
    (cwd / "wds-gz").mkdir()
    with wds.ShardWriter(str(cwd / "wds-gz" / "train-%04d.tar.gz"), maxcount=50,
                         verbose=0) as sink:
        for i in range(120):
            sink.write({"__key__": f"s{i:04d}", "x.npy": rng.normal(size=4).astype(np.float32),
                        "cls": i % 2})
    assert (cwd / "wds-gz" / "train-0000.tar.gz").read_bytes()[:2] == b"\x1f\x8b"  # gzip
    shutil.copy(cwd / "wds" / "train-0002.tar", cwd / "wds-gz" / "train-0003.tar")  # plain
    np.savez(cwd / "arrays.npz", x=rng.normal(size=(100, 5)).astype(np.float32),
             y=np.arange(100) % 4)


def test_readme_recipes_run_as_written(tmp_path):
    blocks = readme_blocks()
    assert len(blocks) == 9 and blocks[0].startswith("cat > mine.yaml")
    recipe_data(tmp_path)
    summaries = {}
    for block in blocks:
        tables = "--format csv" in block or "--format parquet" in block
        if not tables:  # the others just have to run: a few steps
            block = re.sub(r"^(ringfeed train .*)$", r"\1 --set train.max_steps=3",
                           block.replace("\\\n", " "), flags=re.M)
        res = run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, timeout=300)
        assert res.returncode == 0, f"{block}\n{res.output[-4000:]}"
        assert "ringfeed: error" not in res.output, res.output
        if "ringfeed train" in block:
            out = re.search(r"output\.dir=(\S+)", block).group(1)
            summaries[out] = json.loads((tmp_path / out / "summary.json").read_text())
    assert set(summaries) == {"runs/photos", "runs/table", "runs/table-pq", "runs/docs",
                              "runs/wds", "runs/wds-gz", "runs/arrays", "runs/mix"}
    for out in ("runs/table", "runs/table-pq"):  # trained to the end, with nothing else set
        assert summaries[out]["status"] == "finished" and summaries[out]["val"]["accuracy"] >= 0.9
    assert summaries["runs/docs"]["step"] == 3
    assert summaries["runs/wds-gz"]["step"] == 3
    gz = json.loads((tmp_path / "wds-gz" / "manifest.json").read_text())["splits"]["train"]
    assert [s["name"] for s in gz["shards"]] == [
        "train-0000.tar.gz", "train-0001.tar.gz", "train-0002.tar.gz", "train-0003.tar"]
    mix = summaries["runs/mix"]  # 3 steps of the 70/30 mixture of the two tables
    assert set(mix["mixture"]) == {"table", "table-pq"} and "table-pq/accuracy" in mix["val"]


# -- bounded memory ------------------------------------------------------------------------
# The child's own peak RSS: VmHWM of its address space (getrusage's ru_maxrss would carry the
# parent's peak across fork + exec).
PEAK = ("import re, sys; from ringfeed.train.cli import main; code = main(sys.argv[1:]); "
        "status = open('/proc/self/status').read(); "
        "print('maxrss_kb', re.search(r'VmHWM:\\s*(\\d+)', status).group(1)); sys.exit(code)")
BUDGET_MB = 120  # over the interpreter's own peak (imports, a tiny table)


def big_parquet(path: Path, rows: int, row_bytes: int) -> Path:
    """`rows` rows of `row_bytes` random (incompressible) bytes, written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    schema = pa.schema([("blob", pa.binary()), ("a", pa.float64()), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for start in range(0, rows, 40):
            n = min(40, rows - start)
            writer.write_table(pa.table({
                "blob": pa.array([rng.bytes(row_bytes) for _ in range(n)], pa.binary()),
                "a": pa.array(rng.normal(size=n)),
                "label": pa.array(np.arange(start, start + n) % 2)}, schema=schema))
    return path


def peak_rss_mb(src: Path, out: Path) -> float:
    res = run([sys.executable, "-c", PEAK, "shard", str(src), str(out), "--format", "parquet",
               "--field", "blob=bin", "--field", "label=cls", "--max-size", "32MB",
               "--shuffle-seed", "0"], timeout=600)
    assert res.returncode == 0, res.output[-3000:]
    return int(res.stdout.split("maxrss_kb")[1].split()[0]) / 1024


def test_parquet_larger_than_the_memory_budget_shards_in_bounded_memory(tmp_path):
    small = big_parquet(tmp_path / "small.parquet", rows=40, row_bytes=1000)
    big = big_parquet(tmp_path / "big.parquet", rows=1200, row_bytes=250_000)  # 300 MB
    file_mb = big.stat().st_size / 2**20
    baseline = peak_rss_mb(small, tmp_path / "small-out")
    peak = peak_rss_mb(big, tmp_path / "big-out")
    print(f"{file_mb:.0f} MB Parquet file: peak RSS {peak:.0f} MB, a tiny table's "
          f"{baseline:.0f} MB; budget {BUDGET_MB} MB over that")
    assert file_mb > 2 * BUDGET_MB
    assert peak - baseline < BUDGET_MB, (peak, baseline)
    shards = sorted((tmp_path / "big-out").glob("train-*.tar"))
    assert len(shards) >= 9 and sum(p.stat().st_size for p in shards) > 300e6
    res = ringfeed("verify", str(tmp_path / "big-out"), timeout=300)
    assert res.returncode == 0, res.output
    subprocess.run(["rm", "-rf", str(tmp_path)], check=False)  # 900 MB: not kept for later
