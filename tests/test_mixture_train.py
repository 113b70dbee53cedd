"""Weighted mixtures through `ringfeed train` (issue 23): a 3-source mixture trains on 2 ranks
with the achieved shares reported (summary, metrics.jsonl) and validation per source; stopped
mid-epoch and resumed on 3 ranks, the resumed run trains on exactly the samples the
uninterrupted run trained on after that step (samples.jsonl's [source, id] pairs); a 2-source
token (LM) mixture trains; sources that disagree on a field are one line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import horovodrun, ringfeed
from train_util import toy_config, write_config, write_toy_shards

pytestmark = pytest.mark.system  # each test starts processes (tests/conftest.py)

WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}
B, EPOCH, STOP = 4, 600, 15  # 2 ranks: 75 steps/epoch; 600 - 2*15*4 = 480 = 3 ranks x 40 x 4


def write_source(out: Path, draw: int) -> Path:
    """A source: toy_arrays' problem drawn again (its own samples), 480 train and 40 val."""
    return write_toy_shards(out, n_train=480, n_val=40, per_shard=120, draw=draw)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("mixture")
    return [{"path": str(write_source(root / name, seed)), "weight": w}
            for seed, (name, w) in enumerate(WEIGHTS.items(), start=10)]


def config(tmp_path: Path, mixture: list[dict], name: str, **train) -> Path:
    cfg = toy_config(Path("unused"), tmp_path / name,
                     data={"train": mixture, "batch_size": B, "epoch_samples": EPOCH},
                     train={"epochs": 1, "log_every": 10, **train},
                     output={"dir": str(tmp_path / name), "sample_log": True})
    return write_config(tmp_path / f"{name}.yaml", **cfg)


def logged_samples(run: Path, after: int = 0) -> Counter:
    """The [source, id] pairs samples.jsonl records for the steps after `after`."""
    seen: Counter = Counter()
    for line in (run / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] > after:
            seen.update(tuple(pair) for rank in record["ids"] for pair in rank)
    return seen


@pytest.mark.timeout(600)
def test_a_mixture_trains_reports_its_shares_and_resumes_exactly_on_more_ranks(
        tmp_path, mixture):
    # the uninterrupted run: 2 ranks, one epoch of 600 samples drawn 0.6 / 0.3 / 0.1
    full = horovodrun(2, ["ringfeed", "train", config(tmp_path, mixture, "full")], timeout=300)
    assert full.returncode == 0, full.output[-3000:]
    done = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert done["step"] == EPOCH // (2 * B)
    for name, w in WEIGHTS.items():  # a whole epoch: the shares are the weights exactly
        assert done["mixture"][name] == {"weight": pytest.approx(w), "share": pytest.approx(w)}
    assert "mixture shares     web 0.600 (weight 0.600)" in full.output
    for key in ("accuracy", "loss", "web/accuracy", "code/accuracy", "books/loss"):
        assert key in done["val"], done["val"]
    # overall = the count-weighted mean of the sources' (40 val samples each)
    assert done["val"]["accuracy"] == pytest.approx(
        np.mean([done["val"][f"{n}/accuracy"] for n in WEIGHTS]))
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    shares = [r for r in rows if "share/web" in r]
    assert shares and {"share/code", "share/books"} <= set(shares[0])
    per_source = Counter(s for s, _ in logged_samples(tmp_path / "full").elements())
    assert [per_source[s] for s in range(3)] == [360, 180, 60]

    # stopped at step 15 on 2 ranks, then resumed on 3 with --resume auto
    first = horovodrun(2, ["ringfeed", "train", config(tmp_path, mixture, "part",
                                                      max_steps=STOP, epochs=None)],
                       timeout=300)
    assert first.returncode == 0, first.output[-3000:]
    part = json.loads((tmp_path / "part" / "summary.json").read_text())
    n = STOP * 2 * B  # the first 120 samples: each source within 3 sigma of its weight
    for name, w in WEIGHTS.items():
        assert abs(part["mixture"][name]["share"] - w) <= 3 * np.sqrt(w * (1 - w) / n)
    resumed = horovodrun(3, ["ringfeed", "train", config(tmp_path, mixture, "part"),
                             "--resume", "auto"], timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {tmp_path / 'part' / 'checkpoints'}" in resumed.output
    after = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert after["step"] == STOP + (EPOCH - n) // (3 * B)
    assert logged_samples(tmp_path / "part", STOP) == logged_samples(tmp_path / "full", STOP)
    assert logged_samples(tmp_path / "part", 0) == logged_samples(tmp_path / "full", 0)


@pytest.mark.timeout(300)
def test_a_two_source_token_mixture_trains(tmp_path):
    texts = {"prose": "the quick brown fox jumps over the lazy dog. ",
             "code": "def f(x):\n    return x * 2\n"}
    sources = []
    for name, text in texts.items():
        lines = [json.dumps({"text": f"{i} " + text * (3 + i % 5)}) for i in range(40)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        res = ringfeed("shard", str(tmp_path / f"{name}.jsonl"), str(tmp_path / name),
                       "--format", "text", "--seq-len", "32", "--val-fraction", "0.1")
        assert res.returncode == 0, res.output
        sources.append({"path": str(tmp_path / name), "weight": 0.5})
    cfg = write_config(tmp_path / "lm.yaml", model={"name": "gpt"},
                       data={"train": sources, "batch_size": 4},
                       train={"max_steps": 6, "log_every": 3},
                       output={"dir": str(tmp_path / "lm")})
    res = horovodrun(2, ["ringfeed", "train", cfg], timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    done = json.loads((tmp_path / "lm" / "summary.json").read_text())
    assert done["status"] == "finished" and np.isfinite(done["final_loss"])
    assert set(done["mixture"]) == {"prose", "code"}
    assert {"loss", "prose/loss", "code/loss"} <= set(done["val"])


def test_sources_that_disagree_on_a_field_are_one_line(tmp_path, mixture):
    odd = tmp_path / "odd"
    write_source(odd, 5)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["fields"]["y.npy"] = "int"
    (odd / "manifest.json").write_text(json.dumps(manifest))
    (odd / "manifest.bin").unlink(missing_ok=True)
    cfg = config(tmp_path, [mixture[0], {"path": str(odd), "weight": 0.5}], "odd")
    res = ringfeed("train", str(cfg), timeout=120)
    assert res.returncode != 0
    assert "mixture source 'odd': field 'y.npy' is 'int' there but 'npy' in 'web'" in res.output
    assert "Traceback" not in res.output
