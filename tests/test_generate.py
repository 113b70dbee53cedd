"""`ringfeed generate`: text sampled from a run's built-in gpt (a tiny one trained a few steps
on byte-level token shards); greedy output equals an argmax computed here step by step from the
checkpoint's weights, a seed gives the same sample, and what it cannot sample from is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import BIN, run
from lm_util import load_gpt, newest_checkpoint, token_shards, train_gpt

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]  # (a module fixture trains)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lm")
    shards = token_shards(root)
    return train_gpt(root, shards), shards


def generate(*args: object) -> tuple[int, str, str]:
    res = run([BIN / "ringfeed", "generate", *map(str, args)], timeout=180)
    assert not res.timed_out
    return res.returncode, res.stdout, res.stderr


def argmax_continuation(model, prompt: bytes, steps: int) -> bytes:
    """Greedy decoding, one position at a time, from the model as the checkpoint holds it."""
    ids = list(prompt)
    block = model.pos.num_embeddings
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids[-block:]]))[0, -1].argmax())
            if token == 256:  # the byte tokenizer's end of document
                break
            ids.append(token)
    return bytes(ids[len(prompt):])


def test_greedy_output_is_the_argmax_of_the_checkpoint(lm_run):
    run_dir, _ = lm_run
    prompt = "the quick "
    # 40 new tokens: past the 32 positions, so the context is cropped as nanoGPT crops it
    code, out, err = generate(run_dir, "--prompt", prompt, "--temperature", "0",
                              "--max-new-tokens", "40")
    assert code == 0, err
    expected = argmax_continuation(load_gpt(run_dir), prompt.encode(), 40)
    assert out == prompt + expected.decode("utf-8", errors="replace") + "\n"
    assert len(out) > len(prompt) + 1 and "Traceback" not in err
    # the checkpoint named instead of the run: the same
    code, again, _ = generate(newest_checkpoint(run_dir), "--prompt", prompt,
                              "--temperature", "0", "--max-new-tokens", "40")
    assert code == 0 and again == out


def test_a_seed_gives_the_same_sample_and_another_seed_another(lm_run):
    run_dir, _ = lm_run
    samples = [generate(run_dir, "--prompt", "fox ", "--temperature", "1.5", "--top-k", "0",
                        "--max-new-tokens", "30", "--seed", seed)[1] for seed in (1, 1, 2)]
    assert samples[0] == samples[1] != samples[2]
    assert all(s.startswith("fox ") for s in samples)


def test_what_generate_cannot_use_is_one_line(lm_run, tmp_path):
    run_dir, shards = lm_run
    cases = {
        "nowhere": (tmp_path / "missing", "no such run directory or checkpoint"),
        "empty": (tmp_path, "no complete checkpoint"),
    }
    for source, expected in cases.values():
        code, _, err = generate(source, "--prompt", "x")
        assert code == 2 and expected in err and "Traceback" not in err, err
    # a run whose shards moved away: the tokenizer is asked for, and --tokenizer gives it
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    shutil.move(shards, tmp_path / "elsewhere")
    try:
        code, _, err = generate(moved, "--prompt", "x", "--max-new-tokens", "3")
        assert code == 2 and "--tokenizer" in err and err.count("\n") == 1, err
        code, out, _ = generate(moved, "--prompt", "x", "--max-new-tokens", "3",
                                "--tokenizer", "bytes")
        assert code == 0 and out.startswith("x")
    finally:
        shutil.move(tmp_path / "elsewhere", shards)


def test_a_checkpoint_in_a_bucket_samples_as_the_local_one(lm_run, s3_server):
    import s3fs

    run_dir, _ = lm_run
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("ckpt")
    checkpoint = newest_checkpoint(run_dir)
    fs.put(str(checkpoint), f"ckpt/run/{checkpoint.name}", recursive=True)
    greedy = ["--prompt", "dog ", "--temperature", "0", "--max-new-tokens", "20",
              "--tokenizer", "bytes"]
    code, remote, err = generate("s3://ckpt/run", "--storage-option",
                                 f"endpoint_url={s3_server}", *greedy)
    assert code == 0, err
    assert remote == generate(run_dir, *greedy)[1]


def test_a_tensorflow_run_is_refused_in_one_line(tmp_path):
    shards = token_shards(tmp_path)
    run_dir = train_gpt(tmp_path, shards, "tf", framework="tensorflow", train={"max_steps": 1})
    code, _, err = generate(run_dir, "--prompt", "x")
    assert code == 2 and err.count("\n") == 1, err
    assert "a tensorflow checkpoint" in err and "framework: torch" in err


def test_a_resume_whose_optimizer_groups_differ_is_one_line(lm_run, tmp_path):
    """The run decays the gpt's matrices only (two optimizer groups); resumed without weight
    decay the optimizer has one group, as a gpt checkpoint from before the groups had: torch's
    ValueError becomes one line naming the checkpoint, exit 2."""
    run_dir, _ = lm_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    res = run([BIN / "ringfeed", "train", run_dir.parent / f"{run_dir.name}.yaml", "--resume",
               "auto", "--set", f"output.dir={copy}", "--set", "optim.weight_decay=0",
               "--set", "train.max_steps=9"], timeout=180)
    assert not res.timed_out
    err = res.stderr.strip()
    assert res.returncode == 2 and err.count("\n") == 0 and "Traceback" not in err, res.output
    assert f"checkpoint {newest_checkpoint(copy)}" in err, err
    assert "optimizer state does not fit" in err and "--resume none" in err, err
