"""Bad input and faults, property-based (issue 41): config values, `--set`s, garbage YAML, the
CLI's arguments and corrupted shards, tar indexes, manifests and checkpoint metas, plus the
faults that need real processes and file systems (a user model that raises under `ringfeed
run`, a disk that fills mid-run, SIGKILLed commands). For every case: an exit code from the
documented table, no traceback unless it is the user's code, one line naming the culprit, and
nothing previously written changed.

Most cases call the CLI's main(argv) in this process (no interpreter start, no import of torch
or TensorFlow); Hypothesis is derandomized, so a run is the same cases every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import string
import subprocess
import time
from pathlib import Path

import pytest
from fault_util import mounted_tmpfs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringfeed.errors import EXIT_STATUSES, markers_in, relaunches
from ringfeed.train.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTED = {s.code for s in EXIT_STATUSES}
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# -- the table -------------------------------------------------------------------------------
def recovery_table() -> list[tuple[int, str, str, bool]]:
    """train/RECOVERY.md's exit-code table as (code, line, meaning, relaunched)."""
    text = (ROOT / "train" / "RECOVERY.md").read_text()
    section = text.split("### Exit codes", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        code, shown, meaning, run = cells
        assert run in ("done", "stops", "relaunches"), line
        rows.append((int(code), shown.strip("`"), meaning, run == "relaunches"))
    return rows


def test_the_exit_code_table_is_the_one_in_recovery_md():
    """Promise: Exit codes (train/RECOVERY.md)."""
    assert recovery_table() == [(s.code, s.line, s.meaning, s.relaunch) for s in EXIT_STATUSES]


def test_ringfeed_run_relaunches_exactly_the_rows_marked_so():
    """Promise: Exit codes (train/RECOVERY.md)."""
    for s in EXIT_STATUSES:
        if s.line:  # the line decides, whatever a launcher made of the code
            assert relaunches(s.code, markers_in(f"[1,0]<stderr>:{s.line} x")) == s.relaunch, s
    assert not relaunches(2, set()) and not relaunches(3, set()) and not relaunches(4, set())
    assert relaunches(1, set()) and relaunches(75, set()) and relaunches(143, set())
    assert relaunches(137, set())  # a rank killed by SIGKILL: not in the table, a crash
    # a not-restartable line from one rank beats a restartable one from another
    assert not relaunches(1, {"ringfeed: error in your code at step", "ringfeed: error:"})


# -- running the CLI in this process ---------------------------------------------------------
def cli(*argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `ringfeed ARGV` run in this process. An exception other
    than SystemExit escapes: a traceback from ringfeed's own code fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


def check_failure(code: int, err: str, *culprits: str) -> str:
    """A documented exit code and, for a failure, a last line of stderr from ringfeed that
    names one of `culprits`; no traceback. Returns that line."""
    assert code in DOCUMENTED, (code, err)
    assert "Traceback" not in err, err
    if code == 0:
        return ""
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert last.startswith(("ringfeed: ", "ringfeed ")), err
    if culprits:
        assert any(c in last for c in culprits), (culprits, last)
    return last


def digest(*roots: Path) -> dict[str, str]:
    """Every file under `roots` and its sha256: what a command must leave as it was."""
    found = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Toy shards (x.npy/y.npy), image shards with classes (sidecar indexes), a CSV, a config."""
    from shards_util import make_images
    from train_util import toy_config, write_config, write_toy_shards

    base = tmp_path_factory.mktemp("fuzz")
    shards = write_toy_shards(base / "shards", n_train=40, n_val=10, per_shard=20)
    make_images(base / "imgs", {"a": 12, "b": 12}, side=8)
    code, _, err = cli("shard", base / "imgs", base / "images", "--format", "imagefolder",
                       "--max-count", "8")
    assert code == 0, err
    (base / "table.csv").write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(30)))
    cfg = write_config(base / "cfg.yaml", **toy_config(shards, base / "out",
                                                        train={"max_steps": 2}))
    return {"base": base, "shards": shards, "images": base / "images", "cfg": cfg,
            "csv": base / "table.csv"}


# -- config values ----------------------------------------------------------------------------
def config_keys() -> list[str]:
    """Every dotted key of a run's config (train/config.py's sections)."""
    from pydantic import BaseModel

    from ringfeed.train.config import RunConfig

    keys: list[str] = []

    def walk(model: type, prefix: str) -> None:
        for name, field in model.model_fields.items():
            keys.append(prefix + name)
            kind = field.annotation
            for candidate in (kind, *getattr(kind, "__args__", ())):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    walk(candidate, f"{prefix}{name}.")

    walk(RunConfig, "")
    return keys


yaml_scalars = st.one_of(
    st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str),
    st.sampled_from(["null", "true", "no", "[]", "{}", "[1, 2]", "[2, 2]", "-1", "0", "1e400",
                     "nan", "'", "{a: [", "!!python/object:os.system", "*x", "&a 1", "---",
                     "a: b", "10GB", "cuda", "torch", "tensorflow", "auto", "none"]),
    st.text(string.printable, max_size=12))


@pytest.mark.integration
@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_set_overrides_are_applied_or_named(world, data):
    """`--set KEY=VALUE` over every config key, unknown keys and malformed items: the config
    prints, or one line naming the key (exit 2)."""
    keys = config_keys()
    key = data.draw(st.one_of(st.sampled_from(keys), st.sampled_from(keys).map(lambda k: k + "x"),
                              st.text(string.ascii_letters + "._", min_size=1, max_size=12)))
    value = data.draw(yaml_scalars)
    item = data.draw(st.sampled_from([f"{key}={value}", key, f"={value}", f"{key}=="]))
    before = digest(world["shards"], world["cfg"])
    code, _, err = cli("train", world["cfg"], "--set", item, "--print-config")
    line = check_failure(code, err)
    if code:
        assert code == 2, err
        shown = item.split("=", 1)[0].split(".")
        assert "--set" in line or any(part and part in line for part in shown), (item, line)
    assert digest(world["shards"], world["cfg"]) == before


@pytest.mark.integration
@settings(FUZZ, max_examples=40)
@given(key=st.sampled_from(["data.train", "data.val", "checkpoint.resume"]),
       value=st.one_of(st.text(string.printable, max_size=16), st.sampled_from([
           "/dev/null", "/proc/self", ".", "..", "s3:/", "[a, b]", "~"])))
def test_a_path_the_config_names_is_checked_before_training(world, tmp_path, key, value,
                                                            monkeypatch):
    """Paths the config reads, checked on load (data.train/val must hold shards, a named
    checkpoint must exist): a run that starts anyway is one step long, in a scratch folder
    (a relative path lands there)."""
    monkeypatch.chdir(tmp_path)
    before = digest(world["shards"], world["cfg"])
    code, _, err = cli("train", world["cfg"], "--set", f"{key}={value}",
                       "--set", f"output.dir={tmp_path / 'out'}", "--set", "train.max_steps=1")
    check_failure(code, err)
    assert digest(world["shards"], world["cfg"]) == before


@pytest.mark.integration
@settings(FUZZ, max_examples=100)
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=120).map(
    lambda b: b.decode("latin-1")), st.sampled_from([
        "model: {name: mlp}\n", "data: [1, 2]\n", "framework: jax\n", "- a\n- b\n",
        "model: {name: 'os:system'}\ndata: {train: x}\n", "train: {epochs: -1}\n",
        "a: &x [*x]\n", "{{{{\n", "\t- tab\n", "model:\n  name: cnn\n  args: {depth: 99}\n"])))
def test_a_garbage_config_file_is_one_line_naming_it(world, tmp_path, text):
    cfg = tmp_path / "garbage.yaml"
    cfg.write_text(text, encoding="utf-8", errors="surrogateescape")
    code, _, err = cli("train", cfg, "--print-config")
    check_failure(code, err, str(cfg))
    assert code in (0, 2)


@pytest.mark.system  # `ringfeed run` tries to start its (missing) launcher
@settings(FUZZ, max_examples=250)
@given(data=st.data())
def test_cli_arguments(world, tmp_path, data, monkeypatch):
    """Random arguments to shard, verify, inspect, train and run: a result or one line (in a
    scratch folder: a relative OUT lands there)."""
    monkeypatch.chdir(tmp_path)
    base = world["base"]
    # (no unreachable URL: the retry policy waits it out for data.retry_budget_s)
    paths = [world["shards"], world["images"], world["csv"], world["cfg"], base / "missing",
             base / "imgs", tmp_path / "new", "s3:/", "", "-"]
    token = st.one_of(st.sampled_from([str(p) for p in paths]), st.sampled_from([
        "--workers", "0", "-1", "2", "--format", "csv", "npz", "parquet", "imagefolder",
        "jsonl", "text", "bogus", "--max-count", "--max-size", "1KB", "-5MB", "--field",
        "label=cls", "x", "--val-fraction", "1.5", "0.5", "--shuffle-seed", "--samples",
        "--storage-option", "k=v", "--set", "--resume", "auto", "--elastic", "--profile",
        "--help", "--max-restarts", "--backoff", "nan"]), st.text(string.printable,
                                                                    max_size=8))
    command = data.draw(st.sampled_from(["shard", "verify", "inspect", "train", "run"]))
    argv = data.draw(st.lists(token, max_size=6))
    if command == "train":  # never a config that trains: that is not a bad-argument case
        argv = [a for a in argv if a != str(world["cfg"])] + ["--print-config"]
    if command == "run":  # nothing to launch: the launcher does not exist
        argv = [a for a in argv if a != "--"] + ["--", str(base / "no-such-launcher")]
    before = digest(world["shards"], world["images"], world["csv"], world["cfg"])
    code, _, err = cli(command, *argv)
    check_failure(code, err)
    assert digest(world["shards"], world["images"], world["csv"], world["cfg"]) == before


# -- corrupted files ---------------------------------------------------------------------------
def corrupt(path: Path, how: str, where: float, bit: int) -> None:
    """Truncate `path` at, or flip one bit at, the fraction `where` of its length; or replace
    it with garbage."""
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), max(0, len(data) - 1))
    if how == "truncate":
        data = data[:at]
    elif how == "flip" and data:
        data[at] ^= 1 << bit
    elif how == "garbage":
        data = bytearray(hashlib.sha256(bytes(data[:16])).digest() * 3)
    path.write_bytes(bytes(data))


@pytest.mark.integration
@settings(FUZZ, max_examples=150)
@given(target=st.sampled_from(["train-000000.tar", "train-000001.tar.idx", "manifest.json",
                               "manifest.bin", "train-000002.tar"]),
       how=st.sampled_from(["truncate", "flip", "garbage"]),
       where=st.floats(0, 1), bit=st.integers(0, 7))
def test_corrupted_shards_indexes_and_manifests(world, tmp_path, target, how, where, bit):
    """verify and inspect of a damaged dataset: one line naming the file (or a report that
    says so), never a traceback, the files left as they are; verify never passes a shard
    whose bytes changed."""
    data = tmp_path / "data"
    if data.exists():
        shutil.rmtree(data)
    shutil.copytree(world["images"], data)
    original = (data / target).read_bytes()
    corrupt(data / target, how, where, bit)
    changed = (data / target).read_bytes() != original
    before = digest(data)
    code, out, err = cli("verify", data)
    check_failure(code, err, target, "manifest", str(data))
    if changed and target.endswith(".tar"):
        assert code != 0, f"verify passed a changed shard: {out}{err}"
    code, out, err = cli("inspect", data, "--samples", "2")
    check_failure(code, err, target, "manifest", str(data))
    listed = pipeline_listing(data, tmp_path / "cache")
    if listed is not None and target != "manifest.json":  # the JSON says, whatever the rest
        assert listed == pipeline_listing(world["images"], tmp_path / "cache")
    assert digest(data) == before


def pipeline_listing(data: Path, cache: Path) -> list[tuple[str, int]] | None:
    """What the training pipeline reads of a dataset's manifest (its binary index, or the JSON
    when that is damaged): (shard, samples) per train shard; None when it refuses the manifest,
    which it must do with a UserError naming it. (The index's sha256 array is not checked when
    it is mapped, by design: a changed one fails the download check.)"""
    from ringfeed.errors import UserError
    from ringfeed.pipeline.source import manifest_refs
    from ringfeed.remote import RetryPolicy

    try:
        _, refs = manifest_refs(str(data), "train", {}, RetryPolicy(budget_s=1), cache)
        return [(Path(r.url).name, r.num_samples) for r in refs]
    except UserError as e:
        assert "manifest" in str(e), e
        return None


@pytest.mark.integration
@settings(FUZZ, max_examples=50)
@given(how=st.sampled_from(["truncate", "flip", "garbage", "delete", "json"]),
       where=st.floats(0, 1), bit=st.integers(0, 7),
       value=st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers())))
def test_a_damaged_checkpoint_meta_is_passed_over(world, checkpoints, tmp_path, how, where, bit,
                                                  value):
    """--resume auto's search with the newest meta.json damaged: the older checkpoint, or the
    newest when its meta still reads (every file's sha256 still checks), never an error; a
    resume from a meta that reads but says something else is one line (exit 2)."""
    from ringfeed.train.checkpoint.files import find_resume_point

    run = tmp_path / "run"
    if run.exists():
        shutil.rmtree(run)
    directory = run / "checkpoints"
    shutil.copytree(checkpoints, directory)
    newest, older = sorted(p for p in directory.iterdir() if p.name.startswith("ckpt-"))[::-1]
    meta = newest / "meta.json"
    if how == "delete":
        meta.unlink()
    elif how == "json":
        doc = json.loads(meta.read_text())
        doc[sorted(doc)[int(where * (len(doc) - 1))]] = value
        meta.write_text(json.dumps(doc))
    else:
        corrupt(meta, how, where, bit)
    said: list[str] = []
    found = find_resume_point("auto", directory, said.append)
    assert found is not None
    if Path(found.path).name != newest.name:
        assert Path(found.path).name == older.name
        assert any(newest.name in line for line in said), said
        return
    code, _, err = cli("train", world["cfg"], "--set", f"output.dir={run}", "--resume",
                       newest, "--set", "output.tensorboard=false")
    check_failure(code, err, newest.name)
    assert code in (0, 2)


@pytest.fixture(scope="module")
def checkpoints(world, tmp_path_factory) -> Path:
    """Two checkpoints of a 2-step toy run (in this process)."""
    out = tmp_path_factory.mktemp("ckpt-run")
    code, _, err = cli("train", world["cfg"], "--set", f"output.dir={out}",
                       "--set", "checkpoint.every_steps=1", "--set", "output.tensorboard=false")
    assert code == 0, err
    return out / "checkpoints"


# -- faults with real file systems -------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 48 KiB tmpfs (root only)."""
    yield from mounted_tmpfs(tmp_path, "48k")


@pytest.mark.system
def test_a_disk_that_fills_mid_run_is_one_line_exit_4_and_keeps_what_was_written(
        world, tmp_path, tiny_tmpfs):
    """output.dir on a 48 KiB file system fills at about step 100 (metrics, samples and
    TensorBoard records every step); checkpoints are elsewhere.

    Promise: Errors a restart cannot fix (train/RECOVERY.md)."""
    out = tiny_tmpfs / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    code, _, err = cli("train", world["cfg"], "--set", f"output.dir={out}",
                       "--set", f"checkpoint.dir={tmp_path / 'ckpts'}",
                       "--set", "train.max_steps=2000", "--set", "train.log_every=1",
                       "--set", "checkpoint.every_steps=20", "--set", "output.sample_log=true")
    line = check_failure(code, err, str(out))
    assert code == 4 and "No space left on device" in line, err
    assert (out / "notes.txt").read_text() == "mine\n"
    for name, key in (("metrics.jsonl", "loss"), ("samples.jsonl", "ids")):
        records = [json.loads(r) for r in (out / name).read_text().splitlines()]  # whole ones
        steps = [r["step"] for r in records if key in r]  # (not validation records)
        assert steps == list(range(1, len(steps) + 1)) and len(steps) > 20, name
    from ringfeed.train.checkpoint.files import verify

    saved = sorted((tmp_path / "ckpts").glob("ckpt-*"))
    assert saved, "no checkpoint before the disk filled"
    verify(saved[-1])


@pytest.mark.system
def test_a_read_only_output_dir_is_exit_4_even_under_checkpoint_on_error_warn(world,
                                                                             tiny_tmpfs):
    """on_error: warn covers checkpoints, not the run's own files (it was a traceback, exit 1,
    which ringfeed run relaunched)."""
    out = tiny_tmpfs / "run"
    out.mkdir()
    res = subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], capture_output=True,
                         text=True)
    if res.returncode:
        pytest.skip(f"cannot remount read-only: {res.stderr.strip()}")
    code, _, err = cli("train", world["cfg"], "--set", f"output.dir={out}",
                       "--set", "checkpoint.on_error=warn")
    line = check_failure(code, err, str(out))
    assert code == 4 and "Read-only file system" in line, err


@pytest.mark.integration
def test_a_shard_with_more_samples_than_its_manifest_lists_stops_the_run(world, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(world["shards"], data)
    (data / "manifest.bin").unlink(missing_ok=True)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["num_samples"] = 15  # it holds 20
    (data / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = cli("train", world["cfg"], "--set", f"data.train={data}",
                       "--set", f"output.dir={tmp_path / 'out'}")
    line = check_failure(code, err, str(data / "train-000000.tar"))
    assert code == 2 and "holds 20 samples" in line and "says 15" in line, line


@pytest.mark.integration
def test_resuming_with_a_changed_model_is_one_line(world, tmp_path, checkpoints):
    run = tmp_path / "run"
    shutil.copytree(checkpoints.parent, run)
    code, _, err = cli("train", world["cfg"], "--set", f"output.dir={run}",
                       "--set", "model.args.hidden=[32, 8]", "--set", "train.max_steps=3",
                       "--resume", "auto")
    line = check_failure(code, err, "ckpt-000000002")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "not in the checkpoint: net.7.weight" in line and "(16, 8) in the checkpoint, " \
        "(32, 8) in the model" in line and "--resume none" in line, line


@pytest.mark.integration
def test_an_unreachable_http_source_says_connection_refused():
    import socket

    from ringfeed.remote import describe, read_url

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exception) as raised:  # (retried, then named, by the callers)
        read_url(f"http://127.0.0.1:{port}/shards/manifest.json", {})
    assert describe(raised.value).startswith("connection refused ("), describe(raised.value)


def test_a_latin1_csv_names_the_line_the_byte_is_on(tmp_path):
    rows = ["x,label", *(f"{i},{i % 2}" for i in range(40))]
    rows[31] = "caf\xe9,1"  # line 32
    (tmp_path / "t.csv").write_bytes(("\n".join(rows) + "\n").encode("latin-1"))
    code, _, err = cli("shard", tmp_path / "t.csv", tmp_path / "out", "--format", "csv")
    line = check_failure(code, err, f"{tmp_path / 't.csv'}:32: not UTF-8")
    assert code == 2 and "byte 0xe9" in line and "iconv" in line, line


def test_inspect_warns_when_the_class_totals_disagree_with_the_manifest(world, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(world["images"], data)
    shard = data / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    code, out, err = cli("inspect", data)
    assert code == 0, err
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "train-000001.tar (" in warning and "of 8)" in warning, warning


# -- user code and ringfeed run ----------------------------------------------------------------
FACTORY = '''
def broken(spec, **kwargs):
    raise ValueError("my factory is broken")
'''


@pytest.mark.system
def test_a_user_model_factory_that_raises_is_not_relaunched(world, tmp_path):
    """Its traceback and the line naming it, exit 1; `ringfeed run --max-restarts 2` stops at
    once (before the first step the same code would fail the same way).

    Promise: Exit codes (train/RECOVERY.md)."""
    from helpers import BIN, REPO, ringfeed, test_env
    from train_util import toy_config, write_config

    (tmp_path / "mymodels.py").write_text(FACTORY)
    cfg = write_config(tmp_path / "cfg.yaml", **toy_config(
        world["shards"], tmp_path / "out", model={"name": "mymodels:broken", "args": {}}))
    env = test_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    res = ringfeed("run", "--max-restarts", "2", "--backoff", "0", "--",
                   str(BIN / "ringfeed"), "train", str(cfg), timeout=120, env=env)
    assert res.returncode == 1, res.output
    assert res.output.count("Traceback") == 1 and 'mymodels.py", line 3, in broken' in res.output
    assert ("ringfeed: error in your code (model.name=mymodels:broken): ValueError: my factory "
            "is broken") in res.output
    assert "not restarting" in res.output and "restart 1/2" not in res.output


@pytest.mark.integration
def test_a_data_transform_that_raises_is_named_not_called_bad_data(world, tmp_path,
                                                                   monkeypatch):
    """Every sample failing in the user's transform is their code's error (exit 1, its
    traceback), not 'no decodable sample in any shard' (exit 2).

    Promise: Exit codes (train/RECOVERY.md)."""
    (tmp_path / "fuzz_hooks.py").write_text("def transform(sample):\n"
                                            "    raise RuntimeError('my transform')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = cli("train", world["cfg"], "--set", "data.transform=fuzz_hooks:transform",
                       "--set", f"output.dir={tmp_path / 'out'}")
    assert code == 1 and 'fuzz_hooks.py", line 2, in transform' in err, err
    assert err.strip().splitlines()[-1] == ("ringfeed: error in your code "
                                            "(transform=fuzz_hooks:transform): RuntimeError: "
                                            "my transform")


WORKER_TRANSFORM = '''
import itertools
from torch.utils.data import get_worker_info
calls = itertools.count()
def transform(sample):
    if get_worker_info() is not None and next(calls) == 25:
        raise RuntimeError("my transform failed in a worker")
    return sample
'''


@pytest.mark.system
def test_a_transform_that_raises_in_a_loader_worker_after_the_first_steps_is_named(world,
                                                                                    tmp_path):
    """A loader worker process's exception reaches the trainer with its traceback from the
    worker, and the line names the user's code and the step (torch's own re-raise in the
    training process held no frame of it: a crash, exit 1, no line).

    Promise: Exit codes (train/RECOVERY.md)."""
    from helpers import REPO, ringfeed, test_env
    from train_util import toy_config, write_config, write_toy_shards

    (tmp_path / "worker_hooks.py").write_text(WORKER_TRANSFORM)
    shards = write_toy_shards(tmp_path / "shards", n_train=200, n_val=10, per_shard=20)
    cfg = write_config(tmp_path / "cfg.yaml", **toy_config(
        shards, tmp_path / "out", train={"max_steps": 40},
        data={"transform": "worker_hooks:transform", "num_workers": 2}))
    env = test_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    res = ringfeed("train", str(cfg), timeout=180, env=env)
    assert res.returncode == 1, res.output
    assert 'worker_hooks.py", line 7, in transform' in res.output, res.output
    assert res.output.count("Traceback") == 1, res.output
    assert re.search(r"ringfeed: error in your code at step \d+ \(transform=worker_hooks:"
                     r"transform\): RuntimeError: my transform failed in a worker$",
                     res.output.strip()), res.output


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.system
def test_a_sigkilled_ringfeed_run_leaves_no_job_behind():
    """Its job gets SIGTERM (a launcher passes it on to its ranks, a trainer saves and stops).
    The job here prints nothing: a job that writes dies of the broken pipe anyway, a quiet one
    (a long step between log lines) did not.

    Promise: Signals (train/RECOVERY.md)."""
    import psutil
    from helpers import BIN, test_env

    cmd = [str(BIN / "ringfeed"), "run", "--", "sleep", "600"]
    sup = subprocess.Popen(cmd, env=test_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline, job = time.monotonic() + 60, []
        while time.monotonic() < deadline and not job:
            job = psutil.Process(sup.pid).children()
            time.sleep(0.05)
        assert job, "the job never started"
        pids += [job[0].pid] + [p.pid for p in job[0].children(recursive=True)]
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "the job outlived its supervisor"
    finally:
        sup.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.system
def test_a_sigkilled_parallel_csv_shard_leaves_no_worker(tmp_path):
    """`ringfeed shard table.csv --workers 2` (the table path's writer pool).

    Promise: Signals (train/RECOVERY.md)."""
    import psutil
    from helpers import BIN, test_env

    rows = "".join(f"{i},{i % 3},{'x' * 200}\n" for i in range(60000))
    (tmp_path / "t.csv").write_text("x,label,text\n" + rows)
    proc = subprocess.Popen([str(BIN / "ringfeed"), "shard", str(tmp_path / "t.csv"),
                             str(tmp_path / "out"), "--format", "csv", "--workers", "2",
                             "--max-count", "500"], env=test_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(workers) < 2 and proc.poll() is None:
            workers = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.02)
        assert len(workers) >= 2, "the pool's workers never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(w.pid) for w in workers):
            time.sleep(0.05)
        assert not any(alive(w.pid) for w in workers)
    finally:
        proc.kill()
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)


def test_errors_from_the_users_code_are_told_apart_by_their_frames(tmp_path, monkeypatch):
    """Promise: Exit codes (train/RECOVERY.md)."""
    from ringfeed.userhooks import UserCode, load_callable

    (tmp_path / "fuzz_user_mod.py").write_text("def fn():\n    raise KeyError('mine')\n\n"
                                               "def other():\n    raise KeyError('too')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    user_code = UserCode([("train.loss", "fuzz_user_mod:fn"),
                          ("train.metrics", "fuzz_user_mod:other")])  # the same module
    fn = load_callable("fuzz_user_mod:fn", "train.loss")
    other = load_callable("fuzz_user_mod:other", "train.metrics")
    with pytest.raises(KeyError) as raised:
        other()
    assert user_code.culprit(raised.value) == " (train.metrics=fuzz_user_mod:other)"
    with pytest.raises(KeyError) as raised:
        fn()
    assert user_code.culprit(raised.value) == " (train.loss=fuzz_user_mod:fn)"
    user_code.note_step(7)
    assert user_code.culprit(raised.value) == " at step 8 (train.loss=fuzz_user_mod:fn)"
    try:
        int("not a number")
    except ValueError as ours:  # no frame of the user's module: not theirs
        assert user_code.culprit(ours) is None


def test_the_line_is_one_line_whatever_the_message(capsys):
    from ringfeed.errors import UserError
    from ringfeed.train.cli import exit_status

    assert exit_status(UserError("two\nlines  here")) == 2
    assert capsys.readouterr().err == "ringfeed: error: two lines here\n"
    assert exit_status(OSError(28, "No space left on device", "/x/metrics.jsonl")) == 4
    assert "cannot write /x/metrics.jsonl (No space left on device" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):  # a crash keeps Python's traceback, exit 1
        exit_status(ZeroDivisionError("bug"))
    assert re.fullmatch(r"", capsys.readouterr().err)
