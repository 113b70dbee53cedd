"""The `horovod:` config section (train/backends/horovod_env.py): Horovod's own knobs set before
hvd.init() on every rank, and proof from Horovod's own outputs that it used them - the
timeline (rank 0's Chrome trace of every collective) and the autotuner's log (the parameter
values it ran each sample with). Bad values are one line naming the field."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from helpers import BIN, horovodrun, read_timeline, run
from train_util import toy_config, write_config, write_toy_shards

from ringfeed.errors import UserError
from ringfeed.train.backends.horovod_env import (
    apply_horovod_env,
    check_controller,
    horovod_env,
    launch_problem,
)
from ringfeed.train.cli import main
from ringfeed.train.config import HorovodSection

RINGFEED = BIN / "ringfeed"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_toy_shards(tmp_path_factory.mktemp("toy") / "shards")


def config(tmp_path: Path, shards: Path, horovod: dict, steps: int = 30, **overrides) -> Path:
    return write_config(tmp_path / "run.yaml", **toy_config(
        shards, tmp_path / "out", horovod=horovod,
        train={"max_steps": steps, "log_every": 10}, checkpoint={"every_steps": None},
        **overrides))


def timeline_events(path: Path) -> tuple[set[str], set[str]]:
    """(activity names such as ALLREDUCE or MEMCPY_IN_FUSION_BUFFER, tensor names)."""
    events = read_timeline(path)
    activities = {e["name"] for e in events if e.get("ph") in ("B", "X") and "name" in e}
    tensors = {e["args"]["name"] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    return activities, tensors


def autotune_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]


# -- the variables, the launch check, precedence: in-process ---------------------------------
def test_section_becomes_horovods_variables(tmp_path):
    section = HorovodSection(fusion_threshold_mb=0.5, cycle_time_ms=2.5,
                             hierarchical_allreduce=True, autotune=True,
                             autotune_log=str(tmp_path / "tune.csv"), autotune_warmup_samples=0,
                             autotune_steps_per_sample=2, timeline="tl.json", controller="gloo")
    env = horovod_env(section)
    assert env == {
        "HOROVOD_FUSION_THRESHOLD": str(MIB // 2), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(tmp_path / "tune.csv"),
        "HOROVOD_TIMELINE": str(Path("tl.json").absolute()),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    assert horovod_env(HorovodSection()) == {}  # nothing set: the launcher's choices stand


def test_config_wins_over_the_launcher_and_says_so_on_rank_0(tmp_path):
    environ = {"HOROVOD_RANK": "0", "HOROVOD_CYCLE_TIME": "1", "HOROVOD_FUSION_THRESHOLD": "0"}
    said: list[str] = []
    apply_horovod_env(HorovodSection(cycle_time_ms=5, fusion_threshold_mb=0,
                                     timeline=str(tmp_path / "new" / "tl.json")), environ,
                      said.append)
    assert environ["HOROVOD_CYCLE_TIME"] == "5" and environ["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert said == ["ringfeed: horovod config sets HOROVOD_CYCLE_TIME=5 (the launcher or "
                    "environment had 1)"]
    assert (tmp_path / "new").is_dir()  # the timeline's directory is made
    environ["HOROVOD_RANK"] = "1"
    apply_horovod_env(HorovodSection(cycle_time_ms=9), environ, said.append)
    assert environ["HOROVOD_CYCLE_TIME"] == "9" and len(said) == 1  # other ranks stay quiet


def test_a_controller_the_launch_cannot_give_is_refused():
    gloo_launch = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_SIZE": "2"}
    mpi_launch = {"OMPI_COMM_WORLD_SIZE": "2"}
    assert "horovodrun started this process with Gloo" in launch_problem(
        HorovodSection(controller="mpi"), gloo_launch)
    assert "mpirun started this process" in launch_problem(
        HorovodSection(controller="gloo"), mpi_launch)
    for environ in (gloo_launch, mpi_launch, {}):
        assert launch_problem(HorovodSection(), environ) is None
    assert launch_problem(HorovodSection(controller="mpi"), mpi_launch) is None
    assert launch_problem(HorovodSection(controller="gloo"), {}) is None  # one plain process
    with pytest.raises(UserError, match="horovod.controller: mpi asked for, but Horovod runs "
                                        "gloo"):
        check_controller(HorovodSection(controller="mpi"), mpi_enabled=False, gloo_enabled=True)


@pytest.mark.parametrize("override, expected", [
    ("horovod.cycle_time_ms=-1", "horovod.cycle_time_ms: Input should be greater than or "
                                 "equal to 0 (got -1)"),
    ("horovod.fusion_threshold_mb=lots", "horovod.fusion_threshold_mb: Input should be a "
                                         "valid number"),
    ("horovod.controller=nccl", "horovod.controller: Input should be 'auto', 'gloo' or 'mpi'"),
    ("horovod.cycle_time=5", "horovod.cycle_time: unknown key (did you mean 'cycle_time_ms'?)"),
    ("horovod.autotune_log=tune.csv", "horovod.autotune_log: takes effect only with "
                                      "horovod.autotune: true"),
    ("horovod.timeline=' '", "horovod.timeline: expected a file path"),
])
def test_bad_values_are_one_line_naming_the_field(tmp_path, shards, capsys, override, expected):
    cfg = config(tmp_path, shards, {})
    assert main(["train", str(cfg), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ringfeed: error: "), err
    assert expected in err, err


# -- Horovod itself: 2-rank runs ------------------------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(400)
def test_torch_timeline_and_autotune_log_show_horovod_used_the_settings(tmp_path, shards):
    """Fusion off and a 7 ms cycle: the timeline holds the gradients' allreduces and no fusion
    buffer copy, and the autotuner logs every sample with cycle 7 ms and threshold 0 MB (values
    it treats as fixed because they were set)."""
    timeline, tune_log = tmp_path / "trace" / "timeline.json", tmp_path / "autotune.csv"
    cfg = config(tmp_path, shards, {
        "timeline": str(timeline), "fusion_threshold_mb": 0, "cycle_time_ms": 7,
        "autotune": True, "autotune_log": str(tune_log), "autotune_warmup_samples": 0,
        "autotune_steps_per_sample": 1})
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=380)
    assert res.returncode == 0, res.output[-4000:]
    activities, tensors = timeline_events(timeline)
    assert "allreduce.net.1.weight" in tensors  # a gradient (DistributedOptimizer's name)
    assert {"ALLREDUCE", "GLOO_ALLREDUCE"} <= activities
    assert "MEMCPY_IN_FUSION_BUFFER" not in activities  # fusion off: each tensor alone
    rows = autotune_rows(tune_log)
    assert rows, tune_log.read_text()
    assert {(r["cycle_time_ms"], r["tensor_fusion_threshold"]) for r in rows} == {("7", "0")}


@pytest.mark.system
@pytest.mark.timeout(400)
def test_tensorflow_fusion_on_fuses_the_grouped_gradients(tmp_path, shards):
    """The same knobs from the TF backend: a 32 MB threshold and 3 ms cycle reach the
    autotuner, and the grouped gradient allreduce goes through the fusion buffer."""
    timeline, tune_log = tmp_path / "timeline.json", tmp_path / "autotune.csv"
    cfg = config(tmp_path, shards, {
        "timeline": str(timeline), "fusion_threshold_mb": 32, "cycle_time_ms": 3,
        "autotune": True, "autotune_log": str(tune_log), "autotune_warmup_samples": 0,
        "autotune_steps_per_sample": 1}, framework="tensorflow")
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=380)
    assert res.returncode == 0, res.output[-4000:]
    activities, tensors = timeline_events(timeline)
    assert any(name.startswith("HorovodGroupedAllreduce_") for name in tensors), tensors
    assert {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"} <= activities
    rows = autotune_rows(tune_log)
    assert rows and {(r["cycle_time_ms"], r["tensor_fusion_threshold"]) for r in rows} \
        == {("3", "32")}


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.skipif(not shutil.which("mpicxx"), reason="Horovod is built with MPI only where an "
                    "MPI compiler exists at make setup (install libopenmpi-dev, then make setup)")
def test_controller_picks_the_library_horovod_reduces_with(tmp_path, shards):
    """One plain process: controller gloo -> Gloo allreduces, mpi -> MPI ones (this Horovod
    has both); under horovodrun's Gloo launch, mpi is refused before Horovod starts."""
    for controller in ("gloo", "mpi"):
        timeline = tmp_path / f"{controller}.json"
        cfg = config(tmp_path, shards, {"controller": controller, "timeline": str(timeline)},
                     steps=3, output={"dir": str(tmp_path / controller)})
        res = run([RINGFEED, "train", cfg], timeout=120)
        assert res.returncode == 0, res.output[-4000:]
        activities, _ = timeline_events(timeline)
        assert f"{controller.upper()}_ALLREDUCE" in activities, activities
    cfg = config(tmp_path, shards, {"controller": "mpi"}, steps=3)
    res = horovodrun(2, [RINGFEED, "train", cfg], timeout=120)
    assert res.returncode != 0 and "Exit code: 2" in res.output, res.output[-3000:]
    assert "horovod.controller: mpi, but horovodrun started this process with Gloo" \
        in res.output
