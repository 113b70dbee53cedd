"""GPU feeding benchmark: can ringfeed's pipeline keep one GPU as busy as data already on it?

One process, one GPU, no Horovod: the same resnet18 (torchvision's layout, written here) trains
for the same number of steps on 64x64 JPEG shards fed by each contender, in one run:

  a. in-memory bound: one uint8 batch already on the GPU (what the model alone can eat);
  b. bare webdataset: `WebDataset(urls).shuffle(1000).decode("rgb8").to_tuple("jpg", "cls")
     .batched(b)` + torch DataLoader (W workers, pin_memory), batches moved with non_blocking;
  c. ringfeed: `ShardPipeline` + `ringfeed.pipeline.torch.make_loader` (W workers, decode threads),
     decoded cache off, and warm (epochs after the one that filled it).

Every contender converts the uint8 NHWC batch to float and normalises it on the device, then
runs bf16 autocast + channels_last (CUDA; fp32 on CPU) with SGD momentum. Timing starts after
the warm-up steps and ends after torch.cuda.synchronize(); data wait is the training loop's time
spent getting its next batch onto the device; per step, the host's time inside the step
(launching kernels) and, on CUDA, the GPU's span from the step's first to its last kernel (CUDA
events) say which side limits. Every row also gives achieved TFLOP/s and MFU: FLOPs per sample
counted as the trainer counts them (FlopCounterMode on the meta device), against the device's
dense bf16 peak (train/observe/throughput.py's table, or --peak-tflops). The timed steps run across
epoch boundaries (with 25,600 samples an epoch is ~100 steps), so every shuffle-buffer refill
is paid as in training. With --compile (default on for a full CUDA run) a second copy of the
model goes through `torch.compile` (default mode, dynamic=False; its compile time reported)
and is fed in memory and by ringfeed at the largest W <= 8.
With --s3 (issue 36) the same shards are also read from S3: moto's S3 server on 127.0.0.1
behind tests/s3_proxy.py's FaultProxy shaped at 50e6 bytes/s and 0.02 s per connection (both in
a child process, so their threads do not share the training loop's interpreter), at the same W
as the local rows: d. ringfeed from `s3://bucket/gpu-feed` with a fresh `cache_dir`, decoded
cache off: cold (the first epoch, every shard downloaded into the empty cache as it is read;
also timed from the pipeline's creation to the epoch's end) and warm (the epochs after it, the
shards in the cache); e. bare webdataset reading the `s3://` URLs through fsspec/s3fs (a gopen
handler; every epoch downloads again). The proxy's counters (bytes down, requests,
connections) of each row are in the JSON.
A second table sets ringfeed's own training loop (`benchmarks/workers/ringfeed_loop.py`, the
trainer on one in-memory batch, run as a single Horovod process) against a minimal plain loop
on the same small cnn, where per-step overhead dominates, each also compiled (the trainer with
train.compile: true); it needs Horovod (skipped without).

    python benchmarks/gpu_feed_bench.py --device cuda [--out benchmarks/results/gpu.json]
    python benchmarks/gpu_feed_bench.py --device cpu --quick --out /tmp/gpu_quick.json  # smoke
    python benchmarks/gpu_feed_bench.py --device cuda --s3 [--no-small-model]   # + S3 rows

Writes JSON (machine, device, versions, every row, "table_md": the markdown that
`make gpu-check` pastes between the gpu-table markers of benchmarks/README.md) and prints the
table. Measures, never asserts. Exit 2: --device cuda without a GPU; exit 1: a contender failed
(the JSON and table are still written, the failure named in its row and on the last line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, WORKERS, machine, run  # noqa: E402
from datasets import CACHE, cached_dir, image_shards  # noqa: E402
from pipeline_bench import write_jpeg_folder  # noqa: E402

from ringfeed.fsutil import atomic_write_text  # noqa: E402
from ringfeed.train.observe.throughput import (  # noqa: E402
    Accounting,
    FlopCount,
    Peak,
    count_torch_flops,
    resolve_peak,
)

NAME = "gpu_feed"
MEAN = (0.485, 0.456, 0.406)  # ImageNet's, applied on the device by every contender
STD = (0.229, 0.224, 0.225)
GOAL_RATIO, GOAL_MAX_WORKERS = 0.97, 8  # issue 12: ringfeed >= 0.97x the bound, <= 8 workers
LABELS = {
    "in_memory": "in-memory bound: one uint8 batch already on the device",
    "webdataset": 'bare webdataset `.decode("rgb8")` + DataLoader',
    "ringfeed_off": "ringfeed `make_loader`, decoded cache off",
    "ringfeed_warm": "ringfeed `make_loader`, decoded cache warm (epochs after the first)",
    "in_memory_compiled": "in-memory bound, model `torch.compile`d",
    "ringfeed_off_compiled": "ringfeed `make_loader`, decoded cache off, model compiled",
    "ringfeed_warm_compiled": "ringfeed `make_loader`, decoded cache warm, model compiled",
    "webdataset_s3": "S3: bare webdataset via fsspec (every epoch downloads)",
    "ringfeed_s3_cold": "S3: ringfeed, shard cache cold (first epoch downloads), decoded off",
    "ringfeed_s3_warm": "S3: ringfeed, shard cache warm (epochs after the first), decoded off",
}
S3_BANDWIDTH, S3_CONNECT_LATENCY_S = 50e6, 0.02  # issue 36: the proxy's shaping
S3_PREFIX = "bucket/gpu-feed"
TESTS = Path(__file__).resolve().parent.parent / "tests"  # tests/s3_proxy.py
COMPILED = "_compiled"  # contender-name suffix: the same contender with the compiled model


# -- model ----------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's resnet BasicBlock: two 3x3 convs, projection shortcut when the shape
    changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 layout (7x7/2 stem + max pool, BasicBlock x [2, 2, 2, 2]): the
    model of issue 12's measurements, without importing torchvision (absent on the GPU host)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    model = nn.Sequential(*layers)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


class Step:
    """One training step on a uint8 NHWC batch already on the device, the same for every
    contender: float conversion and normalisation on the device, autocast, SGD momentum."""

    def __init__(self, device: torch.device, classes: int, lr: float = 0.1,
                 compiled: bool = False) -> None:
        cuda = device.type == "cuda"
        self.device = device
        torch.manual_seed(0)  # eager and compiled steps start from the same weights
        # channels_last is the layout tensor cores want; a uint8 NHWC batch permuted to NCHW
        # already is channels_last, so the conversion below copies nothing extra
        self.memory_format = torch.channels_last if cuda else torch.contiguous_format
        self.model = resnet18(classes).to(device, memory_format=self.memory_format)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.amp = torch.bfloat16 if cuda else None
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
        # fixed shapes (every batch is full): dynamic=False, one graph, no recompiles
        self.forward = torch.compile(self.model, dynamic=False) if compiled else self.model
        self.compile_s: float | None = None

    def compile_now(self, batch: int, side: int) -> float:
        """A compiled step's first call compiles forward and backward: done here, untimed
        by the rows and reported on its own (seconds to the first finished step)."""
        started = time.perf_counter()
        x = torch.zeros((batch, side, side, 3), dtype=torch.uint8, device=self.device)
        y = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self(x, y)
        synchronize(self.device)
        self.compile_s = time.perf_counter() - started
        return self.compile_s

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).contiguous(memory_format=self.memory_format).float()
        x = x.sub_(self.mean).div_(self.std)
        with (torch.autocast(self.device.type, dtype=self.amp) if self.amp
              else contextlib.nullcontext()):
            loss = F.cross_entropy(self.forward(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss  # not read: no host sync per step (the bound would pay it too)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[torch.Tensor, torch.Tensor], Any],
          batches: Iterator[tuple[torch.Tensor, torch.Tensor]], warmup: int, steps: int,
          batch: int, device: torch.device) -> dict[str, float]:
    """Train `warmup` untimed then `steps` timed steps; samples/s over the timed ones and the
    share of that time spent waiting in next(batches) (the loader plus the host-to-device
    copy's launch). Where the rest goes, per step: `host_step_ms`, the host's time inside
    step() (launching its kernels; near the wall time per step when the host, not the GPU, is
    the limit) and on CUDA `gpu_span_ms`, the GPU's time from a step's first to its last
    kernel (CUDA events; the GPU is idle for the remainder between steps)."""
    for _ in range(warmup):
        step(*next(batches))
    synchronize(device)  # the warm-up's queued GPU work is not the timed steps'
    cuda = device.type == "cuda"
    spans: list[tuple[Any, Any]] = []
    waited = launching = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(batches)
        got = time.perf_counter()
        waited += got - t
        if cuda:
            first = torch.cuda.Event(enable_timing=True)
            first.record()
        step(x, y)
        if cuda:
            last = torch.cuda.Event(enable_timing=True)
            last.record()
            spans.append((first, last))
        launching += time.perf_counter() - got
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"samples_per_s": steps * batch / seconds, "data_wait_fraction": waited / seconds,
            "seconds": seconds, "steps": steps, "step_ms": 1e3 * seconds / steps,
            "host_step_ms": 1e3 * launching / steps,
            "gpu_span_ms": (sum(a.elapsed_time(b) for a, b in spans) / steps) if spans else None}


def on_device(loader: Any, unpack: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
              device: torch.device, epochs: int | None = None
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) on the device, pass after pass over `loader` (`epochs` passes, or
    forever); copies are non_blocking (from pinned memory on CUDA: they overlap the step)."""
    done = 0
    while epochs is None or done < epochs:
        n = 0
        for item in loader:
            x, y = unpack(item)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            n += 1
        if n == 0:
            raise RuntimeError("the loader yielded no batch")
        done += 1


def shutdown(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now (and a ringfeed loader's)."""
    if hasattr(loader, "close"):
        loader.close()
        return
    iterator, loader._iterator = getattr(loader, "_iterator", None), None
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


# -- data -----------------------------------------------------------------------------------
def jpeg_shards(samples: int, shards: int, side: int, workers: int) -> Path:
    """`samples` photo-like JPEGs (q90, 10 classes, pipeline_bench's generator) sharded by
    `ringfeed shard --format imagefolder`, as users make them: plain WebDataset tars (`jpg` +
    `cls`) that bare webdataset reads as they are, with the manifest and tar-index sidecars
    ringfeed reads. Cached under the benchmarks' temp dir (datasets.cached_dir)."""
    from ringfeed.train.cli import main as ringfeed

    per_shard = -(-samples // shards)

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".jpegs-") as src:
            write_jpeg_folder(Path(src), samples, side)
            code = ringfeed(["shard", src, str(out), "--format", "imagefolder", "--max-count",
                             str(per_shard), "--shuffle-seed", "0", "--workers", str(workers),
                             "--no-progress"])
        if code != 0:
            raise RuntimeError(f"ringfeed shard exited {code}")

    return cached_dir(f"gpu-feed-jpeg-{samples}x{side}px-{per_shard}per-v1", build)


# -- contenders -----------------------------------------------------------------------------
def in_memory(step: Step, opts: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (opts.batch, opts.image, opts.image, 3),
                                           dtype=np.uint8)).to(step.device)
    labels = torch.from_numpy(rng.integers(0, 10, opts.batch)).to(step.device)

    def same() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield images, labels

    return timed(step, same(), opts.warmup, opts.steps, opts.batch, step.device)


def webdataset(step: Step, urls: list[str], workers: int, opts: argparse.Namespace
               ) -> dict[str, float]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    # batched in the workers (webdataset's recommended form); partial=False: every batch full.
    # Shards are split between workers by webdataset (split_by_worker).
    dataset = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
               .shuffle(opts.shuffle_buffer).decode("rgb8").to_tuple("jpg", "cls")
               .batched(opts.batch, partial=False))
    cuda = step.device.type == "cuda"
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=cuda,
                        persistent_workers=workers > 0,
                        prefetch_factor=2 if workers > 0 else None)
    try:
        batches = on_device(loader, lambda b: (torch.as_tensor(b[0]), torch.as_tensor(b[1])),
                            step.device)
        return timed(step, batches, opts.warmup, opts.steps, opts.batch, step.device)
    finally:
        shutdown(loader)


def decode_threads_for(workers: int, opts: argparse.Namespace) -> int:
    """pipeline/README: decode threads use spare cores; each of the W reading processes gets
    an equal share of the cores the training loop and DataLoader's pin thread leave."""
    if opts.decode_threads is not None:
        return opts.decode_threads
    return max(1, (opts.cpus - 2) // max(1, workers))


def ringfeed(step: Step, shard_dir: Path, workers: int, opts: argparse.Namespace,
             cache_dir: Path) -> dict[str, dict[str, float]]:
    """The decoded cache off; then on: its first epoch (which fills it, recorded in the JSON)
    and the warm epochs after it."""
    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline.torch import make_loader

    threads = decode_threads_for(workers, opts)
    # read_ahead starts the next epoch in the consumer's own threads: what the trainer sets, but
    # with loader worker processes those reads are never used (the workers read the pass), so
    # by default it is on only with num_workers=0
    read_ahead = {"on": True, "off": False}.get(opts.read_ahead, workers == 0)
    settings = {"batch_size": opts.batch, "shuffle_buffer": opts.shuffle_buffer,
                "num_workers": workers, "decode_threads": threads, "read_ahead": read_ahead,
                "rank": 0, "world_size": 1, "cache_dir": str(cache_dir)}

    def unpack(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return b["jpg"], b["cls"]

    out: dict[str, dict[str, float]] = {}
    for name, setting in (("ringfeed_off", False), ("ringfeed_warm", True)):
        decoded = cache_dir / f"decoded-w{workers}"
        shutil.rmtree(decoded, ignore_errors=True)  # every round starts with an empty cache
        pipe = ShardPipeline(shard_dir, decoded_cache=str(decoded) if setting else False,
                             **settings)
        loader = make_loader(pipe)
        try:
            if setting:  # the first epoch fills the cache: timed on its own, one pass only
                per_epoch = len(loader)
                warm = min(opts.warmup, per_epoch - 1)
                first = on_device(loader, unpack, step.device, epochs=1)
                fill = timed(step, first, warm, per_epoch - warm, opts.batch, step.device)
                if next(first, None) is not None:  # reach the pass's end: next is epoch 2
                    raise RuntimeError("the first epoch has more batches than len(loader)")
                fill["decoded_entries"] = len(list(decoded.rglob("*.rfd")))
                out["ringfeed_fill"] = fill
            before = pipe.stats()
            result = timed(step, on_device(loader, unpack, step.device), opts.warmup,
                           opts.steps, opts.batch, step.device)
            after = pipe.stats()
            # evidence of what the timed steps did (workers' counters arrive with batches)
            result["pipeline_stats"] = {k: after.get(k, 0) - before.get(k, 0) for k in (
                "samples_read", "decoded_cache_hits", "cached_samples", "skipped")}
        finally:
            loader.close()
            pipe.close()
        result["decode_threads"] = threads
        result["read_ahead"] = read_ahead
        if setting:
            result["decoded_entries"] = len(list(decoded.rglob("*.rfd")))
        shutil.rmtree(decoded, ignore_errors=True)
        out[name] = result
    return out


# -- S3 (--s3): moto behind the shaping proxy, in a child process ---------------------------
# The child: moto's server, the bucket filled with the shard folder (straight to moto, so the
# proxy's counters hold only the benchmark's reads), then the proxy; prints {"url", ...} and
# answers each "counters" line on stdin with the proxy's counters as one JSON line; stops at EOF.
SERVE_S3 = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from s3_proxy import FaultProxy, host_port, start_moto
import boto3
server, endpoint = start_moto()
s3 = boto3.client("s3", endpoint_url=endpoint)
bucket, prefix = sys.argv[3].split("/", 1)
s3.create_bucket(Bucket=bucket)
total = 0
for path in sorted(Path(sys.argv[2]).rglob("*")):
    if path.is_file():
        s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(sys.argv[2]).as_posix()}")
        total += path.stat().st_size
proxy = FaultProxy(host_port(endpoint), bandwidth=float(sys.argv[4]),
                   connect_latency_s=float(sys.argv[5])).start()
print(json.dumps({"url": proxy.url, "bytes_uploaded": total}), flush=True)
for line in sys.stdin:
    if line.strip() == "counters":
        print(json.dumps(proxy.counters()), flush=True)
proxy.stop()
server.stop()
"""


class S3Server:
    """moto + FaultProxy in a child process (SERVE_S3) holding `shard_dir` at s3://S3_PREFIX."""

    def __init__(self, shard_dir: Path, log: Path, bandwidth: float = S3_BANDWIDTH,
                 connect_latency_s: float = S3_CONNECT_LATENCY_S) -> None:
        sys.path.insert(0, str(TESTS))
        from s3_proxy import AWS_ENV

        os.environ.update(AWS_ENV)  # fake credentials and region for s3fs/botocore here too
        self.bandwidth, self.connect_latency_s = bandwidth, connect_latency_s
        self.log = log  # the child's stderr: moto's request log, or why it failed
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVE_S3, str(TESTS), str(shard_dir), S3_PREFIX,
                 str(bandwidth), str(connect_latency_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, **AWS_ENV})
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            tail = log.read_text(errors="replace").strip().splitlines() or ["no output"]
            raise RuntimeError(f"moto/proxy child exited {self.proc.returncode} before its "
                               f"URL: {tail[-1][:200]}")
        started = json.loads(line)
        self.url, self.bytes_uploaded = started["url"], started["bytes_uploaded"]
        self.options = {"endpoint_url": self.url, "key": "testing", "secret": "testing"}
        self.last_counters: dict[str, Any] | None = None

    def counters(self) -> dict[str, Any]:
        self.proc.stdin.write("counters\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):  # the totals, for the JSON
                self.last_counters = self.counters()
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def info(self) -> dict[str, Any]:
        return {"endpoint": "moto S3 server on 127.0.0.1 behind tests/s3_proxy.py FaultProxy",
                "source": f"s3://{S3_PREFIX}", "bandwidth_bytes_per_s": self.bandwidth,
                "connect_latency_s": self.connect_latency_s,
                "bytes_uploaded": self.bytes_uploaded, "server_log": str(self.log)}


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What the proxy saw between two `counters()` calls."""
    return {k: after[k] - before[k] for k in ("requests", "bytes_down", "bytes_up",
                                               "connections", "upstream_connections")}


def gopen_s3(options: dict[str, Any]) -> Callable[..., Any]:
    """A webdataset gopen handler for s3:// URLs: fsspec (s3fs) with `options`, read as a
    stream (set in webdataset.gopen.gopen_schemes before the DataLoader forks its workers)."""
    def handler(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        import fsspec

        return fsspec.open(url, mode, **options).open()
    return handler


def webdataset_s3(step: Step, urls: list[str], workers: int, opts: argparse.Namespace,
                  server: S3Server) -> dict[str, Any]:
    import importlib

    # (the module: `webdataset.gopen` as an attribute is the function of that name)
    importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = gopen_s3(server.options)
    before = server.counters()
    result = webdataset(step, urls, workers, opts)
    result["proxy"] = counter_delta(before, server.counters())
    return result


def ringfeed_s3(step: Step, workers: int, opts: argparse.Namespace, cache_dir: Path,
                server: S3Server) -> dict[str, dict[str, Any]]:
    """ringfeed from s3://S3_PREFIX with an empty `cache_dir` (shard cache), decoded cache off:
    the first epoch (cold: each shard downloaded as it is first read) timed as the local fill
    epoch is, plus its wall time from the pipeline's creation; then the warm epochs after it."""
    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline.torch import make_loader

    threads = decode_threads_for(workers, opts)
    read_ahead = {"on": True, "off": False}.get(opts.read_ahead, workers == 0)
    shutil.rmtree(cache_dir, ignore_errors=True)  # every round starts cold
    out: dict[str, dict[str, Any]] = {}
    before = server.counters()
    created = time.perf_counter()
    pipe = ShardPipeline(f"s3://{S3_PREFIX}", batch_size=opts.batch,
                         shuffle_buffer=opts.shuffle_buffer, num_workers=workers,
                         decode_threads=threads, read_ahead=read_ahead, rank=0, world_size=1,
                         cache_dir=str(cache_dir), decoded_cache=False,
                         storage_options=server.options)
    loader = make_loader(pipe)
    try:
        per_epoch = len(loader)
        warm = min(opts.warmup, per_epoch - 1)
        first = on_device(loader, lambda b: (b["jpg"], b["cls"]), step.device, epochs=1)
        cold = timed(step, first, warm, per_epoch - warm, opts.batch, step.device)
        if next(first, None) is not None:
            raise RuntimeError("the first epoch has more batches than len(loader)")
        cold["epoch_wall_s"] = time.perf_counter() - created
        cold["epoch_samples_per_s"] = per_epoch * opts.batch / cold["epoch_wall_s"]
        middle = server.counters()
        cold["proxy"] = counter_delta(before, middle)
        stats = pipe.stats()
        hot = timed(step, on_device(loader, lambda b: (b["jpg"], b["cls"]), step.device),
                    opts.warmup, opts.steps, opts.batch, step.device)
        hot["proxy"] = counter_delta(middle, server.counters())
        after = pipe.stats()
        hot["pipeline_stats"] = {k: after.get(k, 0) - stats.get(k, 0)
                                 for k in ("samples_read", "decoded_cache_hits", "skipped")}
    finally:
        loader.close()
        pipe.close()
    cached = [p for p in cache_dir.rglob("*.tar") if p.is_file()]
    for name, result in (("ringfeed_s3_cold", cold), ("ringfeed_s3_warm", hot)):
        result.update(decode_threads=threads, read_ahead=read_ahead,
                      shards_cached=len(cached))
        out[name] = result
    shutil.rmtree(cache_dir, ignore_errors=True)
    return out


# -- small model: the trainer's own loop vs a plain one --------------------------------------
def plain_loop(device: torch.device, args: argparse.Namespace, compiled: bool = False
               ) -> dict[str, float]:
    """workers/hvd_torch_loop.py without Horovod, on `device`: the built-in model, SGD
    momentum, one in-memory uint8 batch converted to float every step, loss read every step.
    `compiled`: the model through torch.compile (its compile is in the warm-up steps)."""
    from peer import batch, model_args, model_input, spec

    from ringfeed.train.models import build_model

    torch.manual_seed(0)
    module = build_model("torch", args.model, model_args(args), spec(args)).to(device)
    model = torch.compile(module, dynamic=False) if compiled else module
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    images, labels = batch(args, 0)
    x_u8, y = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)

    def step(x_u8: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(model_input(x_u8.float().div_(255.0), args)), y)
        loss.backward()
        optimizer.step()
        return loss.item()  # the per-step host read of a loop that logs its loss

    def same() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield x_u8, y

    return timed(step, same(), args.warmup, args.steps, args.batch, device)


def small_model(device: torch.device, opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Per-step overhead: the built-in `cnn` (the digits demo's width 16) on one in-memory
    32x32 batch, trained by a minimal plain loop (batch on the device, loss read every step,
    as workers/hvd_torch_loop.py minus Horovod) and by ringfeed's own loop
    (workers/ringfeed_loop.py, a single Horovod process: no horovodrun)."""
    import importlib.util

    sys.path.insert(0, str(WORKERS))
    from peer import model_args, model_input, parse_args, spec

    from ringfeed.train.models import build_model

    peer_argv = ["--model", "cnn", "--width", "16", "--image", "32", "--batch",
                 str(opts.small_batch), "--warmup", str(opts.small_warmup), "--steps",
                 str(opts.small_steps)]
    args = parse_args([*peer_argv, "--out", str(tmp / "unused.json")])
    result: dict[str, Any] = {"model": "cnn", "width": 16, "image": 32,
                              "batch": opts.small_batch, "steps": opts.small_steps,
                              "warmup": opts.small_warmup, "precision": "fp32"}
    cnn = build_model("torch", args.model, model_args(args), spec(args))
    # counted on the batch as the plain loop and the trainer feed it (model_input's layout)
    nhwc = torch.empty((args.batch, args.image, args.image, args.channels), device="meta")
    result["flops"] = flops_info(cnn, tuple(model_input(nhwc, args).shape), device, "fp32",
                                 opts.peak_tflops)
    loops = [("plain", False), *([("plain_compiled", True)] if opts.compile else [])]
    for name, compiled in loops:
        try:
            result[name] = plain_loop(device, args, compiled)
        except Exception as e:
            result[name] = {"error": failure(e)}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's process shares the GPU

    if importlib.util.find_spec("horovod") is None:
        result["ringfeed"] = {"error": "not measured: horovod is not importable"}
        return result
    result["ringfeed"] = ringfeed_loop(device, opts, args, peer_argv, tmp, compiled=False)
    if opts.compile:
        result["ringfeed_compiled"] = ringfeed_loop(device, opts, args, peer_argv, tmp,
                                                    compiled=True)
    return result


def ringfeed_loop(device: torch.device, opts: argparse.Namespace, args: argparse.Namespace,
                  peer_argv: list[str], tmp: Path, compiled: bool) -> dict[str, Any]:
    """workers/ringfeed_loop.py (train.compile when `compiled`) in its own process."""
    shards = image_shards(1024, per_shard=1024)  # only the first batch is read
    out = tmp / "ringfeed_loop.json"
    env = dict(os.environ)  # ringfeed as this process imports it (installed, or gpu-check's)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # the plain loop's thread count
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes a GPU whenever it sees one
    cmd = [sys.executable, str(WORKERS / "ringfeed_loop.py"), "--framework", "torch",
           "--shards", str(shards), "--run-dir", str(tmp / f"ringfeed-loop-{int(compiled)}"),
           *(["--compile"] if compiled else []), *peer_argv, "--out", str(out)]
    # a plain process is a one-rank Horovod job (Gloo's single-process context); should that
    # fail on some build, horovodrun -np 1 as gpu-check's digits runs use
    launches = [("plain process", cmd)]
    if shutil.which("horovodrun"):
        launches.append(("horovodrun -np 1", [shutil.which("horovodrun"), "-np", "1", "-H",
                                              "localhost:1", *cmd]))
    for how, argv in launches:
        out.unlink(missing_ok=True)
        proc, launch = run(argv, timeout=opts.timeout, env=env), how
        if proc.returncode == 0 and not proc.timed_out and out.exists():
            break
    if proc.returncode != 0 or proc.timed_out or not out.exists():
        lines = proc.output.strip().splitlines() or ["no output"]
        state = "timed out" if proc.timed_out else f"exit {proc.returncode}"
        return {"error": f"ringfeed_loop.py {state}: {lines[-1][:200]}", "launch": launch}
    loop = json.loads(out.read_text())
    return {"samples_per_s": loop["samples_per_s"], "launch": launch,
            "seconds": loop["step_s_mean"] * args.steps, "steps": args.steps,
            "step_s_median": loop["step_s_median"]}


# -- throughput -----------------------------------------------------------------------------
def failure(e: BaseException) -> str:
    """A row's error: the exception's type and first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def flops_info(model: nn.Module, shape: tuple[int, ...], device: torch.device, dtype: str,
               peak_tflops: float | None) -> dict[str, Any]:
    """Training FLOPs per sample (the trainer's own count: FlopCounterMode over one forward +
    backward of a float batch of `shape` on the meta device) and the peak MFU is measured
    against: the device's dense peak for `dtype` (the table's, or `peak_tflops`); none on a
    CPU unless given."""
    count = count_torch_flops(model, shape, torch.float32, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak(name, dtype, peak_tflops)
    return {"per_sample": count.per_sample, "method": count.method, "dtype": dtype,
            "peak_tflops": peak.tflops, "peak_source": peak.source}


def rates(samples_per_s: float | None, flops: dict[str, Any]) -> dict[str, float | None]:
    """Achieved TFLOP/s and MFU of a row (None where unknown), as the trainer computes them."""
    known = Accounting(FlopCount(flops.get("per_sample"), flops.get("method", "")),
                       Peak(flops.get("peak_tflops"), flops.get("peak_source", "")),
                       devices=1).rates(samples_per_s) if samples_per_s else {}
    return {"achieved_tflops": known.get("tflops"), "mfu": known.get("mfu")}


# -- report ---------------------------------------------------------------------------------
def fmt(x: float | None, pct: bool = False, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else (f"{x:,.0f}" if x >= 100 else f"{x:.3g}")


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def flops_line(flops: dict[str, Any]) -> str:
    if not flops.get("per_sample"):
        return f"FLOPs: {flops.get('method')}."
    peak = (f"MFU against {flops['peak_tflops']:g} TFLOP/s ({flops['peak_source']})"
            if flops.get("peak_tflops") else f"no MFU: {flops['peak_source']}")
    return (f"Training FLOPs: {flops['per_sample'] / 1e9:.3g} GFLOP/sample ({flops['method']}:"
            f" matmuls and convolutions, 2 per multiply-add); {peak}.")


def compile_lines(rows: list[dict[str, Any]], info: dict[str, Any],
                  opts: argparse.Namespace) -> list[str]:
    """What torch.compile cost (the first step) and gave (compiled vs eager, same feed)."""
    if not opts.compile:
        return []
    if info.get("compile_error"):
        return ["", f"torch.compile failed: {info['compile_error'][:200]}"]
    by = {(r["contender"], r["workers"]): r["samples_per_s"] for r in rows if not r["error"]}
    gains = []
    for name, short in (("in_memory", "in-memory"), ("ringfeed_off", "ringfeed cache off"),
                        ("ringfeed_warm", "ringfeed cache warm")):
        for (contender, workers), sps in by.items():
            eager = by.get((name, workers))
            if contender == name + COMPILED and sps and eager:
                where = f" W={workers}" if workers else ""
                gains.append(f"{short}{where} {sps / eager:.2f}x")
    return ["", f"`torch.compile` (default mode, dynamic=False): the first step (compiling "
                f"forward and backward) took {info['compile_s']:.1f} s; compiled / eager "
                f"samples/s: {'; '.join(gains) or 'no pair measured'}."]


def make_rows(best: dict[tuple[str, int], dict[str, Any]], flops: dict[str, Any]
              ) -> list[dict[str, Any]]:
    """One row per (contender, workers); each compared with the in-memory bound of the same
    model (eager rows with the eager bound, compiled rows with the compiled one)."""
    rows = []
    for (contender, workers), r in best.items():
        bound_key = "in_memory" + (COMPILED if contender.endswith(COMPILED) else "")
        bound = (best.get((bound_key, 0)) or {}).get("samples_per_s")
        sps = r.get("samples_per_s")
        rows.append({
            "contender": contender, "label": LABELS[contender],
            "workers": workers if not contender.startswith("in_memory") else None,
            "decode_threads": r.get("decode_threads"),
            "samples_per_s": sps, **rates(sps, flops),
            "ratio_to_in_memory": sps / bound if sps and bound else None,
            "data_wait_fraction": r.get("data_wait_fraction"),
            "steps": r.get("steps"), "seconds": r.get("seconds"), "step_ms": r.get("step_ms"),
            "host_step_ms": r.get("host_step_ms"), "gpu_span_ms": r.get("gpu_span_ms"),
            "read_ahead": r.get("read_ahead"), "pipeline_stats": r.get("pipeline_stats"),
            **{k: r[k] for k in ("proxy", "epoch_wall_s", "epoch_samples_per_s",
                                 "shards_cached") if k in r},
            "all_rounds_samples_per_s": r.get("all", []), "error": r.get("error")})
    return rows


def table_md(rows: list[dict[str, Any]], small: dict[str, Any] | None,
             info: dict[str, Any], opts: argparse.Namespace) -> str:
    dev = info["device"]
    where = (f"{dev['name']} (compute capability {dev['capability']}), CUDA {dev['cuda']}"
             if dev["type"] == "cuda" else "CPU only: a smoke run, not a GPU measurement")
    m = info["machine"]
    lines = [
        f"### GPU: {dev['name']}" if dev["type"] == "cuda" else "### CPU smoke run (no GPU)",
        "",
        f"GPU feeding benchmark{' (--quick)' if opts.quick else ''}, {m['date']}: {where}; "
        f"{m['cpus']} x {m['cpu_model']}; torch {info['torch']}, Python {m['python']}.",
        f"Command: `{info['command']}`",
        "",
        f"resnet18 (torchvision layout, 10 classes), {opts.image}x{opts.image} JPEG q90, "
        f"{'bf16 autocast + channels_last' if dev['type'] == 'cuda' else 'fp32'}, SGD momentum,"
        f" batch {opts.batch}; {opts.samples:,} samples in {opts.shards} shards; "
        f"{opts.steps} timed steps after {opts.warmup} warm-up steps, best of {opts.rounds} "
        "interleaved round(s).",
        "",
        flops_line(info["flops"]),
        *compile_lines(rows, info, opts),
        "",
        "Per step: wall ms; host ms inside step() (launching kernels); GPU ms from its first "
        "to its last kernel (CUDA events). Host near wall: the host is the limit; GPU near "
        "wall: the GPU is.",
        "",
        "| contender | workers | decode threads | samples/s | / in-memory | data wait | "
        "ms/step: wall, host, GPU | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['label']} | {r['workers'] if r['workers'] is not None else '-'}"
                         f" | - | FAILED: {r['error'][:120]} | - | - | - | - | - |")
            continue
        ratio = r["ratio_to_in_memory"]
        bound = r["contender"].startswith("in_memory")
        lines.append(
            f"| {r['label']} | {r['workers'] if r['workers'] is not None else '-'} | "
            f"{r['decode_threads'] if r['decode_threads'] is not None else '-'} | "
            f"{fmt(r['samples_per_s'])} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{'-' if bound else fmt(r['data_wait_fraction'], True)} | "
            f"{ms(r['step_ms'])}, {ms(r['host_step_ms'])}, {ms(r['gpu_span_ms'])} | "
            f"{fmt(r['achieved_tflops'])} | {fmt(r['mfu'], True, 1)} |")
    ours = [r for r in rows if r["contender"].startswith("ringfeed") and r["ratio_to_in_memory"]
            and "_s3" not in r["contender"] and r["workers"] <= GOAL_MAX_WORKERS]
    if ours and dev["type"] == "cuda" and not opts.quick:
        top = max(ours, key=lambda r: r["ratio_to_in_memory"])
        met = "met" if top["ratio_to_in_memory"] >= GOAL_RATIO else "**not met**"
        lines += ["", f"Issue 12's goal, ringfeed >= {GOAL_RATIO}x the in-memory bound with <= "
                      f"{GOAL_MAX_WORKERS} workers: best {top['ratio_to_in_memory']:.2f}x "
                      f"({top['label']}, W={top['workers']}): {met}."]
    if info.get("s3"):
        lines += s3_lines(rows, info["s3"])
    if small:
        lines += small_model_lines(small)
    return "\n".join(lines)


def s3_lines(rows: list[dict[str, Any]], s3: dict[str, Any]) -> list[str]:
    """What the S3 rows read: the setup, and per row the proxy's bytes down and requests."""
    if s3.get("error"):
        return ["", f"S3 rows not measured: {s3['error'][:200]}"]
    lines = ["", f"S3 rows: `{s3['source']}` from {s3['endpoint']}, shaped at "
                 f"{s3['bandwidth_bytes_per_s'] / 1e6:g} MB/s (all connections together) and "
                 f"{1e3 * s3['connect_latency_s']:g} ms per new connection; "
                 f"{s3['bytes_uploaded'] / 1e6:.1f} MB in the bucket. Through the proxy, the "
                 "best round's timed steps (cold: the whole first epoch):"]
    for r in rows:
        p = r.get("proxy")
        if "_s3" not in r["contender"] or not p:
            continue
        extra = ""
        if r.get("epoch_wall_s"):
            extra = (f"; first epoch from the pipeline's creation {r['epoch_wall_s']:.1f} s "
                     f"({fmt(r['epoch_samples_per_s'])} samples/s)")
        lines.append(f"- {r['contender']} W={r['workers']}: {p['bytes_down'] / 1e6:.1f} MB "
                     f"down, {p['requests']} requests, {p['connections']} connections{extra}")
    return lines


def small_model_lines(small: dict[str, Any]) -> list[str]:
    plain = small["plain"].get("samples_per_s")
    flops = small.get("flops") or {}
    lines = ["", f"Per-step overhead: built-in `cnn` (width {small['width']}), "
                 f"{small['image']}x{small['image']}x3, batch {small['batch']}, "
                 f"{small['precision']}, one in-memory batch, {small['steps']} timed steps "
                 f"after {small['warmup']} (a compiled loop compiles in its warm-up).",
             flops_line(flops), "",
             "| loop | samples/s | / plain loop | TFLOP/s | MFU |", "|---|---|---|---|---|"]
    labels = {
        "plain": "minimal plain torch loop (batch on the device, loss read every step)",
        "plain_compiled": "the same plain loop, model `torch.compile`d",
        "ringfeed": "ringfeed's training loop (`workers/ringfeed_loop.py`, one Horovod process)",
        "ringfeed_compiled": "ringfeed's training loop with `train.compile: true`"}
    for key, label in labels.items():
        row = small.get(key)
        if row is None:
            continue
        sps = row.get("samples_per_s")
        if not sps:
            lines.append(f"| {label} | {row.get('error', 'not measured')[:160]} | - | - | - |")
            continue
        r = rates(sps, flops)
        ratio = f"{sps / plain:.2f}x" if plain else "-"
        lines.append(f"| {label} | {fmt(sps)} | {ratio} | {fmt(r['achieved_tflops'])} | "
                     f"{fmt(r['mfu'], True, 1)} |")
    return lines


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "cuda": torch.version.cuda}
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), capability=f"{cap[0]}.{cap[1]}",
                    memory_gb=round(props.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version(), count=torch.cuda.device_count())
    else:
        info["name"] = "cpu"
    return info


# -- main -----------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (the measurement) or cpu (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="tiny run: a few hundred samples")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/gpu[_quick].json)")
    ap.add_argument("--workers", default=None,
                    help='loader workers to try, comma-separated (default "4,8,16"; quick "1"),'
                    " capped by the CPU count")
    ap.add_argument("--samples", type=int, default=None, help="default 25600 (quick 96)")
    ap.add_argument("--shards", type=int, default=None, help="default 64 (quick 4)")
    ap.add_argument("--image", type=int, default=None, help="image side, px (default 64; "
                    "quick 32)")
    ap.add_argument("--batch", type=int, default=None, help="default 256 (quick 8)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 10)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 200)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2)")
    ap.add_argument("--shuffle-buffer", type=int, default=1000, help="both pipelines")
    ap.add_argument("--decode-threads", type=int, default=None,
                    help="ringfeed decode_threads (default: (cpus - 2) // workers, >= 1)")
    ap.add_argument("--read-ahead", choices=["auto", "on", "off"], default="auto",
                    help="ringfeed read_ahead (auto: only with 0 workers)")
    ap.add_argument("--no-small-model", action="store_true",
                    help="skip the per-step overhead table (trainer loop vs plain loop)")
    ap.add_argument("--timeout", type=float, default=600, help="ringfeed_loop.py launch (s)")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="also the torch.compile'd model (in-memory, ringfeed at the largest "
                    "worker count <= 8, the small-model loops); auto: on for a full CUDA run")
    ap.add_argument("--s3", action="store_true",
                    help="also read the shards from S3 (moto behind tests/s3_proxy.py, 50e6 B/s, "
                    "20 ms per connection): ringfeed cold and warm, bare webdataset via fsspec")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak for MFU (default: ringfeed's table by GPU name)")
    opts = ap.parse_args(argv)
    q = opts.quick
    opts.compile = {"on": True, "off": False}.get(opts.compile,
                                                  opts.device == "cuda" and not q)
    opts.cpus = os.cpu_count() or 1
    # quick: a smoke run that a loaded 2-core CI box finishes in well under a minute of steps
    defaults = {"samples": 96 if q else 25600, "shards": 4 if q else 64,
                "image": 32 if q else 64, "batch": 8 if q else 256, "warmup": 1 if q else 10,
                "steps": 3 if q else 200, "rounds": 1 if q else 2}
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    asked = [int(w) for w in (opts.workers or ("1" if q else "4,8,16")).split(",") if w.strip()]
    opts.workers_asked = asked
    opts.workers = sorted({min(w, opts.cpus) for w in asked})  # capped, duplicates merged
    opts.small_batch, opts.small_warmup = (8, 1) if q else (32, 20)
    opts.small_steps = 3 if q else 300
    opts.out = opts.out or RESULTS / ("gpu_quick.json" if q else "gpu.json")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_feed_bench: --device cuda but torch {torch.__version__} sees no GPU "
              f"(CUDA build: {torch.version.cuda}); --device cpu runs the CPU smoke test",
              file=sys.stderr)
        return 2
    device = torch.device(opts.device, 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        # the smoke run shares a few cores with its loader workers: one intra-op thread, as
        # every benchmark here runs (OMP_NUM_THREADS=1), not a spinning pool per core
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed shapes: autotuned in the warm-up
    info = {"name": NAME, "quick": opts.quick, "machine": machine(),
            "device": device_info(device), "torch": torch.__version__,
            "command": " ".join(["python benchmarks/gpu_feed_bench.py",
                                 *(sys.argv[1:] if argv is None else argv)])}
    print(f"gpu_feed_bench: {info['device']['name']}, {opts.cpus} CPUs, workers "
          f"{opts.workers}; making {opts.samples} JPEG samples...", flush=True)
    shard_dir = jpeg_shards(opts.samples, opts.shards, opts.image, min(opts.cpus, 8))
    urls = [str(p) for p in sorted(shard_dir.glob("train-*.tar"))]
    opts.shards = len(urls)
    per_shard_min = opts.samples // len(urls)
    # every worker gets at least one shard from webdataset's split_by_worker
    workers = opts.workers = [w for w in opts.workers if w <= len(urls)]

    step = Step(device, classes=10)
    info["flops"] = flops_info(step.model, (opts.batch, 3, opts.image, opts.image), device,
                               "bf16" if device.type == "cuda" else "fp32", opts.peak_tflops)
    compiled = None
    if opts.compile:
        compiled = Step(device, classes=10, compiled=True)
        print("compiling resnet18 (torch.compile, forward and backward)...", flush=True)
        try:
            info["compile_s"] = compiled.compile_now(opts.batch, opts.image)
            print(f"  compiled in {info['compile_s']:.1f} s", flush=True)
        except Exception as e:  # its rows say so; the eager rows still run
            info["compile_error"] = failure(e)
            print(f"  torch.compile failed: {info['compile_error']}", flush=True)
            compiled = None
    # the compiled model is fed at one worker count: the largest of those asked within the goal
    compiled_workers = max([w for w in workers if w <= GOAL_MAX_WORKERS] or workers[:1])
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def record(key: tuple[str, int], fn: Callable[[], Any], clock: bool = True) -> Any:
        started = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # one contender's failure must not hide the others' rows
            value = {"error": failure(e)}
        runs.setdefault(key, []).append(value)
        took = f"  ({time.perf_counter() - started:.1f} s)" if clock else ""
        print(f"  {key[0]:<14} W={key[1]:<3} {value.get('samples_per_s', 0):>10,.1f} samples/s"
              f"{took}{'  ' + value['error'] if 'error' in value else ''}", flush=True)
        return value

    fills: dict[int, list[dict[str, Any]]] = {}
    server = None
    if opts.s3:
        print("S3: moto's server behind the shaping proxy (a child process), uploading...",
              flush=True)
        try:
            opts.out.parent.mkdir(parents=True, exist_ok=True)
            server = S3Server(shard_dir, opts.out.with_name(opts.out.stem + "_s3_server.log"))
            info["s3"] = server.info()
        except Exception as e:  # the local rows still run; the table says why not
            info["s3"] = {"error": failure(e)}
            runs[("ringfeed_s3_cold", workers[0] if workers else 0)] = [
                {"error": f"S3 server: {info['s3']['error']}"}]
            print(f"  S3 server failed: {info['s3']['error']}", flush=True)
    s3_urls = [f"s3://{S3_PREFIX}/{Path(u).name}" for u in urls]
    with contextlib.ExitStack() as stack, \
            tempfile.TemporaryDirectory(prefix="ringfeed-gpu-feed-") as tmp:
        if server is not None:
            stack.callback(server.close)

        def fed_by_ringfeed(step: Step, w: int, suffix: str = "") -> None:
            started = time.perf_counter()
            try:
                out = ringfeed(step, shard_dir, w, opts, Path(tmp))
            except Exception as e:
                out = {k: {"error": failure(e)}
                       for k in ("ringfeed_off", "ringfeed_warm")}
            print(f"  ringfeed{suffix} W={w}: {time.perf_counter() - started:.1f} s (both "
                  "pipelines, the cache-filling epoch included)", flush=True)
            for name in ("ringfeed_off", "ringfeed_warm"):
                record((name + suffix, w), lambda name=name, out=out: out[name], clock=False)
            if "ringfeed_fill" in out and not suffix:
                fills.setdefault(w, []).append(out["ringfeed_fill"])

        def fed_from_s3(w: int) -> None:
            record(("webdataset_s3", w),
                   lambda: webdataset_s3(step, s3_urls, w, opts, server))
            started = time.perf_counter()
            try:
                out = ringfeed_s3(step, w, opts, Path(tmp) / f"s3-cache-w{w}", server)
            except Exception as e:
                out = {k: {"error": failure(e)} for k in ("ringfeed_s3_cold", "ringfeed_s3_warm")}
            print(f"  ringfeed S3 W={w}: {time.perf_counter() - started:.1f} s (cold epoch "
                  "and warm steps)", flush=True)
            for name in ("ringfeed_s3_cold", "ringfeed_s3_warm"):
                record((name, w), lambda name=name, out=out: out[name], clock=False)

        for r in range(opts.rounds):
            print(f"round {r + 1}/{opts.rounds}", flush=True)
            record(("in_memory", 0), lambda: in_memory(step, opts))
            for w in workers:
                record(("webdataset", w), lambda w=w: webdataset(step, urls, w, opts))
                fed_by_ringfeed(step, w)
                if server is not None:
                    fed_from_s3(w)
            if compiled is not None:
                record(("in_memory" + COMPILED, 0), lambda: in_memory(compiled, opts))
                fed_by_ringfeed(compiled, compiled_workers, COMPILED)
        small = None
        if not opts.no_small_model:
            print("small model: plain loop vs ringfeed's loop", flush=True)
            try:
                small = small_model(device, opts, Path(tmp))
            except Exception as e:
                small = {"error": f"{type(e).__name__}: {e}"}
                print(f"  small model failed: {small['error']}", flush=True)

    best: dict[tuple[str, int], dict[str, Any]] = {}
    for key, values in runs.items():
        ok = [v for v in values if "samples_per_s" in v]
        top = max(ok, key=lambda v: v["samples_per_s"]) if ok else values[-1]
        best[key] = {**top, "all": [v.get("samples_per_s") for v in values]}
    rows = make_rows(best, info["flops"])
    small_ok = small if small and "plain" in small else None
    table = table_md(rows, small_ok, info, opts)
    result = {
        **info, "table_md": table, "rows": rows,
        "settings": {k: getattr(opts, k) for k in (
            "samples", "shards", "image", "batch", "warmup", "steps", "rounds",
            "shuffle_buffer", "decode_threads", "read_ahead", "workers", "workers_asked")},
        "samples_per_shard_min": per_shard_min,
        # ringfeed's first epoch with the cache on (reads, decodes and writes the cache): one
        # pass only, so the shuffle buffer's head start is inside it
        "ringfeed_first_epoch_filling_cache": {str(w): v for w, v in fills.items()},
        "small_model": small,
        "s3_proxy_total": server.last_counters if server is not None else None,
        "compile": {"on": opts.compile, "workers": compiled_workers if compiled else None,
                    "compile_s": info.get("compile_s"), "error": info.get("compile_error"),
                    "how": "torch.compile(model, dynamic=False), default mode (inductor)"},
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(opts.out, json.dumps(result, indent=2) + "\n")
    print("\n" + table + "\n")
    failed = [f"{r['contender']} W={r['workers']}: {r['error']}" for r in rows if r["error"]]
    print(f"wrote {opts.out}", flush=True)
    # the small-model table is context (it needs Horovod and the trainer, which gpu-check
    # tests on their own): its failure is shown in its row and here, not in the exit code
    small_error = (small or {}).get("error") or ((small or {}).get("ringfeed") or {}).get("error")
    if small_error:
        print(f"gpu_feed_bench: small-model table incomplete: {small_error}", flush=True)
    if failed:
        print(f"gpu_feed_bench: {len(failed)} failed: " + "; ".join(failed)[:400], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
