"""What the hand-written training loops (the peers `ringfeed train` is measured against) share:
the arguments, one in-memory batch (Horovod's pytorch_synthetic_benchmark.py style) and the
step-time report. Same model as the trainer's built-ins (train/models), same batch shape."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringfeed.train.data import CLASSIFY, DataSpec
from ringfeed.train.models import channels_first


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    ap.add_argument("--width", type=int, default=32, help="cnn width (channels of stage 1)")
    ap.add_argument("--image", type=int, default=32, help="square image side")
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def spec(args: argparse.Namespace) -> DataSpec:
    return DataSpec(CLASSIFY, "png", "cls", (args.image, args.image, args.channels),
                    num_classes=args.classes)


def model_args(args: argparse.Namespace) -> dict:
    return {"width": args.width} if args.model == "cnn" else {}


def batch(args: argparse.Namespace, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 HWC images and int64 labels, as the pipeline would hand them over."""
    rng = np.random.default_rng(rank)
    images = rng.integers(0, 256, (args.batch, args.image, args.image, args.channels),
                          dtype=np.uint8)
    return images, rng.integers(0, args.classes, args.batch).astype(np.int64)


def model_input(x: Any, args: argparse.Namespace) -> Any:
    """A float NHWC image batch (a torch tensor) as `ringfeed train` hands it to a torch
    model: by model.input_layout's default rule (models.channels_first), (N, C, H, W) as a
    permuted view of the NHWC memory, no copy."""
    return x.permute(0, 3, 1, 2) if channels_first("torch", "auto", spec(args)) else x


def time_steps(step: Callable[[], float], args: argparse.Namespace,
               barrier: Callable[[], None]) -> tuple[list[float], float]:
    """Run warm-up then timed steps; returns (per-step seconds, total wall seconds of the
    timed steps). `step` must return only after the update is applied."""
    for _ in range(args.warmup):
        step()
    barrier()
    times = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times, time.perf_counter() - start


def report(args: argparse.Namespace, ranks: int, times: list[float], wall: float,
           last_loss: float, **extra) -> None:
    data = {"ranks": ranks, "batch_per_rank": args.batch, "steps": args.steps,
            "step_s_mean": wall / args.steps, "step_s_median": float(np.median(times)),
            "samples_per_s": args.batch * ranks * args.steps / wall, "last_loss": last_loss,
            **extra}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
