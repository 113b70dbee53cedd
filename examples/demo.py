"""`make demo`: the whole ringfeed path on this machine, no arguments, no network.

    digits (scikit-learn's bundled 8x8 images) -> 32x32 PNGs in class folders
      -> `ringfeed shard` -> `horovodrun -np 2 ringfeed train examples/configs/digits.yaml`
      with PyTorch, then the same config with TensorFlow -> validation accuracy of each.

`make demo-lm` (`--lm`): byte-level token shards of Python's own standard library sources ->
the small `gpt` for a few hundred steps on 2 ranks -> first and last loss, validation
perplexity, and a sample of text from the trained model (`ringfeed generate`).

Everything goes under demo-out/ (shards, runs with checkpoints, TensorBoard logs and
metrics.jsonl). Shards are reused when present; training runs start fresh every time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIGS = REPO / "examples" / "configs"
GOAL_ACCURACY = 0.95
LM_TEXT_BYTES = 2_000_000  # of standard-library source: ~15k samples of 129 tokens
# TensorFlow's C++ start-up chatter and tf.data naming warnings; the demo's own output stays.
NOISE = re.compile(r"I0000 |W0000 |E0000 |WARNING: All log messages before absl|"
                   r"To enable the following instructions|oneDNN custom operations|"
                   r"is not a valid node name|rebuild TensorFlow with")


def sh(cmd: list[object], title: str) -> None:
    """Run a step with live output (TF noise filtered); stop the demo if it fails."""
    print(f"\n== {title}\n$ {' '.join(str(c) for c in cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if not NOISE.search(line):
            print(line, end="", flush=True)
    if proc.wait() != 0:
        sys.exit(f"demo: step failed ({title}), exit code {proc.returncode}")


def build_digits(folder: Path, size: int = 32) -> int:
    """sklearn's digits as `size` x `size` grayscale PNGs in one folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        pixels = (image * (255.0 / 16.0)).round().astype("uint8")  # 0..16 -> 0..255
        png = Image.fromarray(pixels, mode="L").resize((size, size), Image.BILINEAR)
        (tmp / str(label)).mkdir(parents=True, exist_ok=True)
        png.save(tmp / str(label) / f"{i:04d}.png")
    tmp.rename(folder)  # complete or absent
    return len(digits.images)


def collect_stdlib_text(folder: Path, limit: int = LM_TEXT_BYTES) -> int:
    """Copy top-level standard library modules (sorted by name) up to `limit` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= limit:
            break
        shutil.copyfile(path, tmp / path.name)
        total += path.stat().st_size
    tmp.rename(folder)
    return total


def train(config: Path, run_dir: Path, framework: str, ranks: int, *extra: str) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (the demo is repeatable)
    sh([BIN / "horovodrun", "-np", ranks, "-H", f"localhost:{ranks}", "--gloo",
        BIN / "ringfeed", "train", rel(config), "--set", f"framework={framework}",
        "--set", f"output.dir={rel(run_dir)}", *extra],
       f"train with {framework} on {ranks} Horovod ranks")
    return json.loads((run_dir / "summary.json").read_text())


def rel(path: Path) -> str:
    return os.path.relpath(path, REPO)


def where(run_dir: Path) -> str:
    rel_dir = rel(run_dir)
    traces = f", profile {rel_dir}/profile/" if (run_dir / "profile").is_dir() else ""
    return (f"checkpoints {rel_dir}/checkpoints/, TensorBoard {rel_dir}/tensorboard/, "
            f"metrics {rel_dir}/metrics.jsonl{traces}")


def compute(summary: dict) -> str:
    """FLOPs per sample and the FLOP/s achieved (summary.json's throughput)."""
    t = summary.get("throughput") or {}
    if not t.get("flops_per_sample"):
        return "FLOPs not counted"
    return (f"{t['flops_per_sample'] / 1e6:.2f} MFLOP/sample, "
            f"{t['achieved_tflops'] * 1e3:.2f} GFLOP/s")


def digits_demo(out: Path, ranks: int, frameworks: list[str]) -> int:
    images, shards = out / "digits-images", out / "digits-shards"
    if not images.exists():
        print(f"== digits -> {rel(images)}: {build_digits(images)} PNGs", flush=True)
    if not (shards / "manifest.json").exists():
        sh([BIN / "ringfeed", "shard", rel(images), rel(shards),
            "--format", "imagefolder", "--val-fraction", "0.1", "--shuffle-seed", "0",
            "--max-count", "200", "--workers", "2"], "shard the image folder")
    results = {}
    for framework in frameworks:
        started = time.monotonic()
        run_dir = out / "runs" / f"digits-{framework}"
        results[framework] = (train(CONFIGS / "digits.yaml", run_dir, framework, ranks,
                                    "--set", f"data.train={rel(shards)}"),
                              time.monotonic() - started, run_dir)
    print("\n== make demo: results (cnn on digits, 2 Horovod ranks, same config)")
    ok = True
    for framework, (summary, seconds, run_dir) in results.items():
        accuracy = summary["val"].get("accuracy", float("nan"))
        ok &= accuracy >= GOAL_ACCURACY
        print(f"  {framework:<10} val accuracy {accuracy:.4f} (goal >= {GOAL_ACCURACY})  "
              f"{summary['samples_per_s']:.0f} samples/s  data wait "
              f"{100 * summary['data_wait_share']:.1f}% of step time  "
              f"{summary['step']} steps, {seconds:.0f}s wall")
        print(f"             {compute(summary)}; {where(run_dir)}")
    print(f"  view the curves: {BIN / 'tensorboard'} --logdir {rel(out / 'runs')}")
    return 0 if ok else 1


def lm_demo(out: Path, ranks: int, framework: str) -> int:
    text, shards = out / "lm-text", out / "lm-flat"
    if not text.exists():
        size = collect_stdlib_text(text)
        print(f"== Python stdlib sources -> {rel(text)}: {size / 1e6:.1f} MB")
    if not (shards / "manifest.json").exists():
        sh([BIN / "ringfeed", "shard", rel(text), rel(shards),
            "--format", "text", "--glob", "*.py", "--val-fraction", "0.05",
            "--shuffle-seed", "0", "--max-size", "1MB", "--workers", "2"],
           "byte-level flat token shards")
    run_dir = out / "runs" / f"lm-{framework}"
    summary = train(CONFIGS / "lm.yaml", run_dir, framework, ranks,
                    "--set", f"data.train={rel(shards)}")
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
              if "loss" in r]
    print("\n== make demo-lm: results (gpt on byte-level Python source, 2 Horovod ranks)")
    print(f"  train loss {losses[0]:.3f} (first log window) -> "
          f"{losses[-1]:.3f} (last), val loss {summary['val'].get('loss', float('nan')):.3f} "
          f"(perplexity {summary['val'].get('perplexity', float('nan')):.2f}), "
          f"{summary['samples_per_s']:.0f} samples/s")
    print(f"  {where(run_dir)}")
    if framework == "torch":  # (ringfeed generate reads torch checkpoints)
        sh([BIN / "ringfeed", "generate", rel(run_dir), "--prompt", "def ", "--seed", "0",
            "--max-new-tokens", "300"], "a sample of the trained gpt")
    return 0 if losses[-1] < 0.75 * losses[0] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm", action="store_true", help="the gpt on stdlib sources instead")
    parser.add_argument("--framework", choices=["torch", "tensorflow", "both"], default=None,
                        help="default: both for digits, torch for --lm")
    parser.add_argument("--np", type=int, default=2, help="Horovod ranks (default 2)")
    parser.add_argument("--out", type=Path, default=REPO / "demo-out")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.lm:
        return lm_demo(out, args.np, args.framework or "torch")
    frameworks = (["torch", "tensorflow"] if args.framework in (None, "both")
                  else [args.framework])
    return digits_demo(out, args.np, frameworks)


if __name__ == "__main__":
    sys.exit(main())
