"""data.synthetic (issue 46): `ringfeed train` with no data at all, as Horovod's
pytorch_synthetic_benchmark.py: one batch of the config's shape made once, trained on at every
step; the summary holds samples/s per rank with its 95% interval. Both frameworks; 2 ranks take
the same steps; a synthetic run resumes from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from fault_util import read_jsonl
from helpers import horovodrun, ringfeed
from train_util import write_config

from ringfeed.train.cli import main
from ringfeed.train.config import load_config
from ringfeed.train.data import SyntheticPipeline, synthetic_spec


def synthetic_config(tmp_path: Path, name: str = "s", framework: str = "torch",
                     **train) -> Path:
    """A synthetic run of the tiny cnn on 12 x 10 images, 5 classes; no data.train."""
    return write_config(
        tmp_path / f"{name}.yaml", framework=framework,
        model={"name": "cnn", "args": {"width": 4, "hidden": 8, "num_classes": 5}},
        data={"synthetic": True, "image_size": [12, 10], "batch_size": 4},
        train={"max_steps": 6, "log_every": 2, **train},
        output={"dir": str(tmp_path / name), "loggers": [], "sample_log": True})


# -- the config: the spec from it alone; one line for what does not go with it --------------
def test_the_spec_comes_from_the_config_alone(tmp_path):
    cfg = load_config(synthetic_config(tmp_path))
    spec = synthetic_spec(cfg)
    assert (spec.task, spec.input_shape, spec.num_classes) == ("classify", (12, 10, 3), 5)
    assert cfg.data.train is None and cfg.val_source is None  # no data, no validation
    plain = load_config(synthetic_config(tmp_path), ["model.args={}", "data.image_size=null",
                                                     "data.channels=1"])
    assert synthetic_spec(plain).input_shape == (224, 224, 1)  # the benchmark's size
    assert synthetic_spec(plain).num_classes == 1000


@pytest.mark.parametrize("sets, says", [
    (["train.max_steps=null", "train.epochs=1"], "data.synthetic: set train.max_steps"),
    (["data.val=shards/x"], "data.val: a synthetic run does not validate"),
    (["model.name=gpt"], "data.synthetic: makes images and class ids, not tokens"),
    (["data.synthetic=false"], "data.train: required key is missing"),
])
def test_what_does_not_go_with_it_is_one_line(tmp_path, capsys, sets, says):
    argv = ["train", str(synthetic_config(tmp_path))]
    for item in sets:
        argv += ["--set", item]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err, err


def test_the_batch_is_made_once_in_the_specs_shape_and_counted(tmp_path):
    import torch

    cfg = load_config(synthetic_config(tmp_path), ["train.accumulate=2"])
    pipes = [SyntheticPipeline(cfg, rank, 2) for rank in (0, 1)]
    assert [p.batches_per_epoch for p in pipes] == [12, 12]  # max_steps x accumulate, per rank
    loader = pipes[0].loader(SimpleNamespace(device=torch.device("cpu")), "torch")
    batches = list(loader)
    assert len(batches) == 12 and pipes[0].batches_remaining == 0
    x, y = batches[0]["jpg"], batches[0]["cls"]
    assert isinstance(x, torch.Tensor) and x.shape == (4, 12, 10, 3) and x.dtype == torch.float32
    assert y.shape == (4,) and int(y.min()) >= 0 and int(y.max()) < 5
    assert all(b["jpg"] is x for b in batches)  # one device tensor, never copied again
    other = pipes[1].example_batch()["jpg"]
    assert not np.array_equal(other, x.numpy())  # each rank its own batch
    state = pipes[0].state_dict()
    pipes[1].load_state_dict(state)
    assert pipes[1].batches_remaining == 0


# -- runs: no data dir; the interval in the summary; 2 ranks, equal steps; resume ---------------
def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.system
def test_two_ranks_train_without_data_and_report_the_interval_then_resume(tmp_path):
    cfg = synthetic_config(tmp_path, "r")
    first = horovodrun(2, ["ringfeed", "train", str(cfg), "--set", "train.stop_after_step=3"],
                       timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.output[-3000:]
    assert "classify on synthetic jpg (12, 10, 3)" in first.output
    run_dir = tmp_path / "r"
    assert summary_of(run_dir)["step"] == 3
    second = horovodrun(2, ["ringfeed", "train", str(cfg), "--resume", "auto"], timeout=300,
                        cwd=tmp_path)
    assert second.returncode == 0, second.output[-3000:]
    assert "resumed from" in second.output and "at step 3" in second.output
    summary = summary_of(run_dir)
    assert summary["step"] == 6 and summary["val"] == {}
    rate = summary["synthetic"]
    assert rate["timed_steps"] == 2  # steps 5 and 6: step 4, the first after the resume, warms up
    assert rate["samples_per_s_per_rank"] > 0 and rate["ci95_per_rank"] >= 0
    assert "samples/s per rank (95%, 2 timed steps); on 2 rank(s):" in second.output
    # every step was trained by both ranks, each on its own batch of 4
    steps = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]] for s in steps)


@pytest.mark.system
def test_tensorflow_trains_without_data_too(tmp_path):
    cfg = synthetic_config(tmp_path, "tf", framework="tensorflow", max_steps=4)
    result = ringfeed("train", str(cfg), timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    summary = summary_of(tmp_path / "tf")
    assert summary["step"] == 4 and summary["synthetic"]["timed_steps"] == 3
    assert "samples/s per rank (95%, 3 timed steps)" in result.output
