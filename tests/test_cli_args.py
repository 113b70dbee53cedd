"""The CLI's own arguments (issue 41, item 5): a bad `ringfeed run` option or launcher and a
config path that is a directory or unreadable are one line and exit 2, never a traceback."""

from __future__ import annotations

import pytest
from helpers import ringfeed

pytestmark = pytest.mark.system  # runs the console script


@pytest.mark.parametrize("args, says", [
    (["--backoff", "-5"], "argument --backoff: must be 0 or more, got -5"),
    (["--max-restarts", "-3"], "argument --max-restarts: must be 0 or more, got -3"),
    (["--backoff-max", "soon"], "argument --backoff-max: expected a number, got 'soon'"),
])
def test_ringfeed_run_refuses_bad_numbers(args, says):
    res = ringfeed("run", *args, "--", "true", timeout=60)
    assert res.returncode == 2 and says in res.stderr, res.output
    assert "Traceback" not in res.output


def test_ringfeed_run_names_a_launcher_that_does_not_exist():
    res = ringfeed("run", "--", "horovdrun", "-np", "2", timeout=60)
    assert res.returncode == 2, res.output
    assert res.stderr.strip() == ("ringfeed: error: ringfeed run: cannot start 'horovdrun' (No "
                                  "such file or directory; check the launcher's name and PATH)")


def test_a_config_path_that_is_a_directory_or_not_text_is_one_line(tmp_path):
    res = ringfeed("train", str(tmp_path), timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ringfeed: error: {tmp_path}: is a directory; give the config file (a YAML file) "
        "itself"), res.output
    binary = tmp_path / "cfg.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    res = ringfeed("train", str(binary), timeout=60)
    assert res.returncode == 2 and "cannot read the config file" in res.stderr, res.output
    assert "Traceback" not in res.output


def test_output_dir_that_is_a_file_is_one_line_and_exit_4(tmp_path):
    """(issue 41, item 1) exit 4, which `ringfeed run` does not relaunch, not a traceback.

    Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    from train_util import toy_config, write_config, write_toy_shards

    shards = write_toy_shards(tmp_path / "shards", n_train=64, n_val=16)
    in_the_way = tmp_path / "out"
    in_the_way.write_text("a file, not a directory\n")
    cfg = write_config(tmp_path / "cfg.yaml", **toy_config(
        shards, in_the_way, checkpoint={"on_error": "warn"}, train={"max_steps": 2}))
    res = ringfeed("train", str(cfg), timeout=180)
    assert res.returncode == 4, res.output[-3000:]
    assert "Traceback" not in res.output
    assert res.stderr.strip().splitlines()[-1] == (
        f"ringfeed: error: output.dir {in_the_way}: cannot write the run's files there (File "
        "exists; choose a writable directory)")
    assert in_the_way.read_text() == "a file, not a directory\n"  # nothing written over


def test_shard_workers_die_with_a_sigkilled_parent(tmp_path):
    """(issue 41, item 4) `ringfeed shard --workers 2` SIGKILLed: no worker writes on.

    Promise: Signals (train/RECOVERY.md)."""
    import signal
    import subprocess
    import time

    import psutil
    from helpers import BIN, test_env
    from shards_util import make_images

    make_images(tmp_path / "imgs", {f"c{i}": 600 for i in range(6)}, side=32)
    proc = subprocess.Popen([str(BIN / "ringfeed"), "shard", str(tmp_path / "imgs"),
                             str(tmp_path / "out"), "--format", "imagefolder", "--workers", "2",
                             "--max-count", "50"], env=test_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, workers = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            workers = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.02)
        assert len(workers) >= 2, "the pool's workers never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in psutil.Process().children(recursive=True):
            if child.pid != proc.pid and child.cmdline()[1:2] == proc.args[:1]:
                child.kill()


@pytest.mark.parametrize("name, text, extra", [
    ("head.csv", "a,b,label\n", []),
    ("head.csv", "a,b,label\n", ["--field", "label=cls"]),
    ("empty.jsonl", "", []),
])
def test_a_table_without_rows_is_one_line_naming_the_file(tmp_path, name, text, extra):
    """(issue 41, item 3) was a KeyError traceback, or "no column 'label' (columns: )"."""
    src = tmp_path / name
    src.write_text(text)
    fmt = "csv" if name.endswith(".csv") else "jsonl"
    res = ringfeed("shard", str(src), str(tmp_path / "out"), "--format", fmt, *extra,
                   timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ringfeed: error: {src}: no rows to shard (a header alone, or empty); add rows, or "
        "check the file is the one meant"), res.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_csv_given_as_npz_is_named_for_what_it_is(tmp_path):
    """(issue 41, item 3) numpy's own error suggested allow_pickle for any non-numpy file."""
    src = tmp_path / "t.csv"
    src.write_text("a,b\n1,2\n")
    res = ringfeed("shard", str(src), str(tmp_path / "out"), "--format", "npz", timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ringfeed: error: {src}: not a .npy or .npz file (no numpy header; a table is "
        "--format csv, jsonl or parquet)"), res.output


def test_images_too_small_for_the_builtin_cnn_are_a_config_error(tmp_path):
    """(issue 41, item 2) was a shape error from inside the model, exit 1, relaunched."""
    from shards_util import make_images
    from train_util import write_config

    make_images(tmp_path / "imgs", {"a": 8, "b": 8})
    res = ringfeed("shard", str(tmp_path / "imgs"), str(tmp_path / "shards"), "--format",
                   "imagefolder", timeout=60)
    assert res.returncode == 0, res.output
    cfg = write_config(tmp_path / "cfg.yaml", model={"name": "cnn"},
                       data={"train": str(tmp_path / "shards"), "image_size": [2, 2],
                             "batch_size": 4, "val_split": None},
                       train={"max_steps": 1}, output={"dir": str(tmp_path / "run")})
    res = ringfeed("train", str(cfg), timeout=180)
    assert res.returncode == 2, res.output[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "ringfeed: error: model.name cnn needs images of at least 4 x 4 pixels (height, width, "
        "channels), got samples of shape (2, 2, 3) (set data.image_size, or use model.name "
        "mlp)") and "Traceback" not in res.output
