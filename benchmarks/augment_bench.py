"""Train-time augmentation (issue 45): ringfeed's fused decode + RandomResizedCrop(224) + flip
against torchvision's PIL path, DALI's CPU pipeline, a torchvision ImageFolder + DataLoader and,
from S3, MosaicML Streaming, LitData and webdataset.

    .venv/bin/python benchmarks/augment_bench.py            # full mode, ~6 min quiet, 13 loaded
    .venv/bin/python benchmarks/augment_bench.py --quick    # the smoke test, a few CPU-seconds
    .venv/bin/python benchmarks/augment_bench.py --s3-only --s3-baseline DIR   # row 5 alone

`--s3-baseline DIR` reads S3 also with the `ringfeed` package under DIR (an earlier commit:
`git archive C | tar -x -C T`, then pipeline/, shards/ and train/ copied into T/ringfeed/;
DIR = T), as the contender ringfeed-before, in the same interleaved rounds.

Images: ImageNet-like JPEGs cut from the photographs scikit-image ships (`skimage.data`:
astronaut, chelsea, coffee, rocket, hubble_deep_field, ...; grayscale ones too, 1 in 16, as
ImageNet has), random crops rescaled to 500x375-class sizes, quality 90, ~110 KB, made once
into the temp dir and reused. torchvision itself does not load here (PyPI's wheel is a CUDA
build that does not load beside our CPU torch): its PIL path is written out by hand
(benchmarks/peers/pil_augment.py).

Rows (each contender in a process of its own; contenders interleaved A B C A B C ..., ratios
per pair of passes of the same round, their median and min-max):
1-3. One core (every contender pinned to the same CPU), batches of 64 uint8 NHWC 224x224:
   the torchvision PIL path over the image folder; DALI's CPU pipeline (1 thread,
   peers/dali_worker.py); ringfeed with `augment` from `ringfeed shard`'s shards of the same
   folder (num_workers=0, prefetch=0: all in the consumer's thread), decoded cache off (cold),
   and epochs from the decoded cache (the first epoch, timed apart, filled it).
4. Two cores end to end, batch 128, NCHW float32 normalized: ringfeed's torch adapter
   (`make_loader`, 2 workers; and 0 workers with 2 decode threads) against a hand-written
   torchvision ImageFolder + DataLoader(num_workers=2) with RandomResizedCrop + flip +
   ToTensor + Normalize, a fresh loader per pass. Images/s in steady state: after the second
   batch (2 workers deliver their first batches together); the whole pass's rate is kept too.
   ringfeed's NCHW batch is a view of its NHWC one (channels_last memory), as the trainer
   hands it to torch models.
5. From moto's S3 behind tests/s3_proxy.py (50 MB/s, 20 ms per connection): ringfeed,
   Streaming, LitData and webdataset, each its own writer and loader
   (benchmarks/bucket_bench.py, peers/peer_worker.py `--augment`), 64 images (~7 MB) a
   shard, batch 128, 2 workers, the same crop and flip (PIL) for the peers; the cold epoch
   (construction included, as bucket_bench times it) against its bytes at the link's rate,
   and the CPU-seconds the reader's processes spent on it (/proc: what each does per image,
   whatever else the machine runs).
When a one-core goal is missed, one more ringfeed pass of that kind (cold, cached) runs under
cProfile in the pinned child: the functions that took the time (`data.one_core.profile`).
DALI and the S3 peers need the peers' venv (`bash benchmarks/peers/setup.sh`, ~15 min, not run
from here): without it their rows say why; `--quick` leaves them out unless `--peers`. Prints
a table; writes benchmarks/results/augment_bench[_quick].json with the load (`uptime`) at the
start and end. It measures, it does not assert.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
from common import REPO, RESULTS, Row, bench_env, finish  # noqa: E402
from pil_augment import augmented  # noqa: E402

PEERS_VENV = HERE / ".peers-venv"
AUGMENT = ["random_resized_crop", "horizontal_flip"]
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, torchvision's recipe
PHOTOS_VERSION = 1  # bump when the generated images change


# -- the images -----------------------------------------------------------------------------------
COLOUR = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "motorcycle_left",
          "motorcycle_right", "immunohistochemistry", "retina")
GRAY = ("camera", "grass", "gravel", "brick", "moon", "coins")
SHAPES = ((500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (500, 500), (400, 500),
          (640, 480))  # (width, height), ImageNet's common sizes
CLASSES = 10
GRAY_EVERY = 16


def photo(i: int, sources: dict[str, np.ndarray]):
    """Image i: a random crop of one photograph rescaled to one of SHAPES, sharpened, with
    sensor-like noise: ImageNet's photos hold ~110 KB at q90 (the entropy decoding's share of
    a decode), these clean, mostly upscaled crops ~60 KB without it, ~107 KB with it."""
    from PIL import Image, ImageFilter

    rng = np.random.default_rng(i)
    gray = i % GRAY_EVERY == GRAY_EVERY - 1
    name = (GRAY if gray else COLOUR)[int(rng.integers(len(GRAY if gray else COLOUR)))]
    source = sources[name]
    width, height = SHAPES[int(rng.integers(len(SHAPES)))]
    sh, sw = source.shape[:2]
    fit = min(sw / width, sh / height)               # the largest crop of this aspect
    frac = rng.uniform(0.45, 1.0)
    cw, ch = max(8, int(width * fit * frac)), max(8, int(height * fit * frac))
    top, left = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
    image = Image.fromarray(source[top:top + ch, left:left + cw])
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    image = image.filter(ImageFilter.UnsharpMask(radius=2, percent=300, threshold=0))
    pixels = np.asarray(image).astype(np.float32)
    pixels = pixels * rng.uniform(0.8, 1.2) + rng.normal(0, 11.0, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return image if not rng.integers(2) else image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)


def load_sources() -> dict[str, np.ndarray]:
    from skimage import data

    out = {name: getattr(data, name)() for name in COLOUR + GRAY if not name.startswith("moto")}
    out["motorcycle_left"], out["motorcycle_right"], _ = data.stereo_motorcycle()
    return out


def photos(count: int) -> Path:
    """An image folder `class<k>/<i>.jpg` of `count` ImageNet-like JPEGs, made once per count
    in the temp dir (image i is the same in every count)."""
    path = Path(tempfile.gettempdir()) / "ringfeed-bench" / f"augment-photos-v{PHOTOS_VERSION}-{count}"
    if (path / ".done").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    sources = load_sources()
    for i in range(count):
        folder = path / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(i, sources).save(folder / f"{i:06d}.jpg", "JPEG", quality=90)
    (path / ".done").write_text("")
    return path


def folder_facts(folder: Path) -> dict[str, Any]:
    from PIL import Image

    files = sorted(folder.glob("class*/*.jpg"))
    sizes = [p.stat().st_size for p in files]
    modes = [Image.open(p).mode for p in files]
    return {"images": len(files), "mean_kb": round(sum(sizes) / len(sizes) / 1e3, 1),
            "min_kb": round(min(sizes) / 1e3, 1), "max_kb": round(max(sizes) / 1e3, 1),
            "grayscale": modes.count("L"), "folder": str(folder)}


def shards_of(folder: Path, per_shard: int) -> Path:
    """`ringfeed shard --format imagefolder` of the folder, made once beside it."""
    out = folder.with_name(folder.name + f"-shards{per_shard}")
    if (out / ".done").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    result = subprocess.run([sys.executable, "-m", "ringfeed.train.cli", "shard", str(folder),
                             str(out), "--format", "imagefolder", "--shuffle-seed", "0",
                             "--max-count", str(per_shard), "--no-progress"],
                            capture_output=True, text=True, env=bench_env(), timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"ringfeed shard exited {result.returncode}: {result.stderr[-800:]}")
    (out / ".done").write_text("")
    return out


# -- contenders in their own processes ------------------------------------------------------------
class Contender:
    """A child process that answers each command line with one JSON line (a timed pass)."""

    def __init__(self, name: str, cmd: list[str], timeout: float, env: dict[str, str]):
        self.name, self.timeout = name, timeout
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env,
                                     start_new_session=True)
        self.ready = self._answer()

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.close()
                raise RuntimeError(f"{self.name}: no answer in {self.timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                self.err.seek(0)
                tail = self.err.read().strip()[-1500:]
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {tail}")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.err.close()


def serve(handlers: dict[str, Any]) -> None:
    """The child's loop: `name [arg]` -> handlers[name](arg) -> one JSON line."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, _, arg = line.strip().partition(" ")
        if name not in handlers:
            return
        print(json.dumps(handlers[name](arg)), flush=True)


def timed(batches, count) -> dict[str, Any]:
    """Images/s over an iterable of batches; `count(batch)` -> images in it."""
    start, n = time.perf_counter(), 0
    for batch in batches:
        n += count(batch)
    seconds = time.perf_counter() - start
    return {"images": n, "seconds": seconds, "rate": n / seconds}


def pil_batches(files: list[Path], batch: int, rng: random.Random):
    """torchvision's PIL path, shuffled, in batches of uint8 NHWC (a DataLoader's collate)."""
    order = list(files)
    rng.shuffle(order)
    for i in range(0, len(order), batch):
        yield np.stack([augmented(p, SIZE, rng) for p in order[i:i + batch]])


def serve_pil(args) -> None:
    files = sorted(Path(args.root).glob("class*/*.jpg"))[:args.images]
    rng = random.Random(0)
    for _ in pil_batches(files[:2 * args.batch], args.batch, rng):  # warm-up: imports
        pass
    serve({"run": lambda _: timed(pil_batches(files, args.batch, rng), len)})


def ringfeed_pipe(shards: str, work: Path, batch: int, **options):
    from ringfeed.pipeline import ShardPipeline

    return ShardPipeline(shards, augment=AUGMENT, image_size=(SIZE, SIZE), batch_size=batch,
                         shuffle_buffer=1000, balance="pad", seed=0, cache_dir=str(work),
                         **options)


def ringfeed_epoch(pipe, epoch: int) -> dict[str, Any]:
    """One epoch's images/s (valid samples), a batch's shape, the decoded cache's hits."""
    pipe.set_epoch(epoch)
    shapes = []

    def count(batch) -> int:
        shapes.append(batch["jpg"].shape)
        return int(np.count_nonzero(batch["__valid__"]))
    out = timed(pipe, count)
    out["shape"] = list(shapes[-1]) if shapes else None
    out["cached_samples"] = pipe.stats().get("cached_samples")
    return out


def profiled(fn) -> dict[str, Any]:
    """fn() under cProfile: its result, and the 15 functions with the most own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    result = fn()
    profile.disable()
    stats = pstats.Stats(profile)
    total = sum(v[2] for v in stats.stats.values())
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    result["profile"] = [{"function": f"{Path(file).name}:{line}({name})", "calls": v[1],
                          "own_s": round(v[2], 4), "share": round(v[2] / total, 3),
                          "cumulative_s": round(v[3], 4)}
                         for (file, line, name), v in top]
    return result


def serve_ringfeed(args) -> None:
    """Cold passes (augmentation on, decoded cache off) and cached ones (a decoded cache the
    first epoch, `fill`, filled), both in the consumer's thread (num_workers=0, prefetch=0)."""
    work = Path(args.work)
    cold = ringfeed_pipe(args.shards, work / "index", args.batch, num_workers=0, prefetch=0)
    cached = ringfeed_pipe(args.shards, work / "index", args.batch, num_workers=0, prefetch=0,
                           decoded_cache=str(work / "decoded"))
    for _ in cold:   # warm-up: imports, the tar indexes
        break
    epochs = {"cold": 0, "cached": 0}

    def run(which: str, profile: bool = False) -> dict[str, Any]:
        pipe = cold if which == "cold" else cached
        epochs[which] += 1

        def go():
            return ringfeed_epoch(pipe, epochs[which])
        return profiled(go) if profile else go()

    serve({"cold": lambda _: run("cold"), "cached": lambda _: run("cached"),
           "fill": lambda _: ringfeed_epoch(cached, 0),
           "profile": lambda which: run(which, profile=True)})


# -- one core -------------------------------------------------------------------------------------
def peers_python() -> Path | None:
    python = PEERS_VENV / "bin" / "python"
    return python if python.exists() else None


def dali_missing() -> str | None:
    python = peers_python()
    if python is None:
        return "peers venv missing (bash benchmarks/peers/setup.sh)"
    probe = subprocess.run([str(python), "-c", "import nvidia.dali"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return f"DALI does not import in the peers venv: {probe.stderr.strip()[-200:]}"
    return None


def one_core(folder: Path, shards: Path, images: int, batch: int, rounds: int, warmup: bool,
             dali_skipped: str | None, work: Path) -> dict[str, Any]:
    """Interleaved passes, every contender pinned to the same CPU: {"passes": {name: [pass
    results]}, ...}; then, for each missed goal, one ringfeed pass under cProfile."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--images", str(images), "--batch", str(batch), "--cpu", str(cpu)]
    env = bench_env()
    out: dict[str, Any] = {"cpu": cpu, "images": images, "batch": batch, "passes": {},
                           "dali_skipped": dali_skipped}
    children: list[Contender] = []
    contenders: dict[str, tuple[Contender, str]] = {}
    try:
        children.append(Contender("PIL", [*me, "--serve", "pil", "--root", str(folder),
                                          *common], 600, env))
        contenders["torchvision PIL"] = (children[-1], "run")
        if dali_skipped is None:
            children.append(Contender(
                "DALI", [str(peers_python()), str(HERE / "peers" / "dali_worker.py"), "--root",
                         str(folder), *common], 600, {**env, "PYTHONPATH": ""}))
            contenders["DALI"] = (children[-1], "run")
            out["dali_version"] = children[-1].ready.get("version")
        rf = Contender("ringfeed", [*me, "--serve", "ringfeed", "--shards", str(shards),
                                    "--work", str(work / "rf"), *common], 900, env)
        children.append(rf)
        contenders["ringfeed cold"] = (rf, "cold")
        out["fill"] = rf.ask("fill")   # the first epoch, writing the decoded cache
        contenders["ringfeed cached"] = (rf, "cached")
        for r in range(rounds + warmup):
            for name, (child, command) in contenders.items():
                result = child.ask(command)
                if r >= warmup:
                    out["passes"].setdefault(name, []).append(result)
        missed = {which for which, row in zip(("cold", "cold", "cached"), one_core_rows(out),
                                              strict=False) if row.met is False}
        out["profile"] = {which: rf.ask(f"profile {which}") for which in sorted(missed)}
    finally:
        for child in children:
            child.close()
    return out


# -- two cores end to end -------------------------------------------------------------------------
def serve_e2e(args) -> None:
    """DataLoader-shaped loops, batch 128, NCHW float32 normalized, each pass a fresh loader:
    ringfeed's torch adapter (2 workers; 0 workers and 2 decode threads) and a torchvision
    ImageFolder + DataLoader(num_workers=2) written out by hand."""
    import torch

    from ringfeed.pipeline.torch import make_loader

    work = Path(args.work)
    epochs = {"workers": 0, "threads": 0}

    def ringfeed(which: str) -> dict[str, Any]:
        options = ({"num_workers": 2} if which == "workers"
                   else {"num_workers": 0, "decode_threads": 2})
        pipe = ringfeed_pipe(args.shards, work / "index", args.batch, normalize=(MEAN, STD),
                             **options)
        pipe.set_epoch(epochs[which])
        epochs[which] += 1
        loader = make_loader(pipe)
        try:
            return loop(((b["jpg"].permute(0, 3, 1, 2), b["__valid__"]) for b in loader),
                        lambda valid: int(valid.sum()))
        finally:
            getattr(loader, "close", lambda: None)()

    def imagefolder(_: str) -> dict[str, Any]:
        dataset = ImageFolderPIL(Path(args.root), args.images)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True,
                                             num_workers=2)
        return loop(iter(loader), len)

    if args.warmup:   # imports, the tar indexes, page cache
        ringfeed("workers")
    serve({"ringfeed": lambda _: ringfeed("workers"),
           "ringfeed_threads": lambda _: ringfeed("threads"), "imagefolder": imagefolder})


def loop(batches, count, lead: int = 2) -> dict[str, Any]:
    """Images/s in steady state: from the arrival of batch `lead` to the end (2 workers
    start 2 batches at once, so the second arrives right after the first); the whole pass's
    rate too, loader start included; the batch's shape and dtype."""
    start = time.perf_counter()
    n = lead_n = 0
    for i, (images, labels) in enumerate(batches):
        n += count(labels)
        if i == 0:
            first, shape, dtype = time.perf_counter(), list(images.shape), str(images.dtype)
        if i == lead - 1:
            lead_t, lead_n = time.perf_counter(), n
    end = time.perf_counter()
    return {"images": n, "seconds": end - lead_t, "rate": (n - lead_n) / (end - lead_t),
            "first_batch_s": first - start, "pass_rate": n / (end - start), "shape": shape,
            "dtype": dtype}


class ImageFolderPIL:
    """torchvision's ImageFolder with RandomResizedCrop(224), RandomHorizontalFlip(),
    ToTensor(), Normalize(ImageNet) by hand: (CHW float32 tensor, class index)."""

    def __init__(self, root: Path, limit: int):
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = sorted((p, classes.index(p.parent.name))
                              for p in root.glob("*/*.jpg"))[:limit]
        self.rng: random.Random | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        import torch

        if self.rng is None:   # one generator per worker process, seeded as torch seeds it
            self.rng = random.Random(torch.initial_seed())
        path, target = self.samples[index]
        tensor = torch.from_numpy(augmented(path, SIZE, self.rng)).permute(2, 0, 1)
        tensor = tensor.contiguous().float().div(255)                      # ToTensor
        mean = torch.tensor(MEAN).view(-1, 1, 1)
        std = torch.tensor(STD).view(-1, 1, 1)
        return tensor.sub_(mean).div_(std), target                         # Normalize


def two_cores(folder: Path, shards: Path, images: int, batch: int, rounds: int,
              warmup: bool, work: Path) -> dict[str, Any]:
    """Interleaved loader passes in one child (2 cores, unpinned)."""
    me = [sys.executable, str(Path(__file__).resolve())]
    child = Contender("end to end", [*me, "--serve", "e2e", "--root", str(folder), "--images",
                                     str(images), "--batch", str(batch), "--work",
                                     str(work / "e2e"),
                                     "--shards", str(shards),
                                     *(["--warmup"] if warmup else [])],
                      900, bench_env())
    names = ("ringfeed", "imagefolder", "ringfeed_threads")
    passes: dict[str, list[dict[str, Any]]] = {}
    try:
        for _ in range(rounds):
            for name in names:
                passes.setdefault(name, []).append(child.ask(name))
    finally:
        child.close()
    return {"images": images, "batch": batch, "passes": passes}


# -- from S3: the peers' own writers and loaders (bucket_bench) -----------------------------------
S3_CONTENDERS = (("ringfeed", "ringfeed"), ("webdataset", "wds"), ("streaming", "mds"),
                 ("litdata", "litdata"))
# ~7 MB shards: under boto3's 8 MB multipart threshold. With 256 per shard (27 MB, fetched in
# 8 MB ranged parts) Streaming 0.13's 2 loader workers read truncated shards in 2 of 3 cold
# epochs (IndexError "Relative sample index ... is not present", or PIL's "cannot identify
# image file"); with 1 worker, or shards under the threshold, in 0 of 3.
S3_PER_SHARD = 64
BEFORE = "ringfeed-before"  # --s3-baseline's contender


def s3_epochs(folder: Path, contenders: list[tuple[str, str]], per_shard: int, repeats: int,
              batch: int, work: Path, link: tuple[float, float],
              baseline: str | None = None) -> dict[str, Any]:
    """Cold epochs from moto's S3 behind the proxy shaped to `link` (bytes/s, s per
    connection): each tool's writer (bucket_bench.prepare_all), then each reader in its own
    process (peers/peer_worker.py --augment), rotated round-robin per repeat. `baseline`: a
    directory holding another `ringfeed` package (e.g. an earlier commit's), read as the
    contender "ringfeed-before" from ringfeed's shards."""
    sys.path.insert(0, str(REPO / "tests"))
    import bucket_bench as bucket
    from s3_proxy import FaultProxy, host_port

    if baseline:
        contenders = [*contenders, (BEFORE, "ringfeed")]
    prepared = bucket.prepare_all(folder, work, per_shard, 2,
                                  list(dict.fromkeys(t for _, t in contenders)))
    want = label_digest(folder)
    moto, endpoint = bucket.start_moto_child()
    runs: list[dict[str, Any]] = []
    try:
        bucket.upload(endpoint, prepared)
        with FaultProxy(host_port(endpoint), bandwidth=link[0], connect_latency_s=link[1],
                        log_requests=True) as proxy:
            options = argparse.Namespace(batch=batch, workers=2, run_timeout=900.0)
            for rep in range(repeats):
                for name, tool in contenders[rep % len(contenders):] + contenders[
                        :rep % len(contenders)]:
                    result = bucket.run_read(name, tool, "own", f"s3://{bucket.BUCKET}/{tool}",
                                             work / f"cache-{name}", options, proxy,
                                             extra=("--augment", str(SIZE), "--epochs", "1"),
                                             env={"PYTHONPATH": baseline} if name == BEFORE
                                             and baseline else None)
                    result.update(repeat=rep, problems=s3_problems(result, want),
                                  load1=os.getloadavg()[0])
                    runs.append(slim(result))
                    print(f"  S3 {rep} {name:11s} load {result['load1']:4.1f} " + (
                        cold_line(result["epochs"][0], link[0]) if not result["problems"]
                        else result["problems"][0]), flush=True)
    finally:
        moto.stdin.close()
        try:
            moto.wait(10)
        except subprocess.TimeoutExpired:
            moto.kill()
    return {"images": want["samples"], "per_shard": per_shard, "batch": batch, "workers": 2,
            "bandwidth": link[0], "latency_s": link[1], "runs": runs,
            "seconds": s3_seconds(runs),
            "prepared": {t: {k: p[k] for k in ("seconds", "bytes", "files")}
                         for t, p in prepared.items()}}


def s3_seconds(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per tool, the cold epoch's and its first batch's seconds over the repeats (median,
    min, max), printed."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        epochs = [r["epochs"][0] for r in runs if r["name"] == name and not r["problems"]]
        if epochs:
            out[name] = {k: spread([e[k] for e in epochs]) for k in ("seconds", "first_batch_s")}
            print(f"  S3 {name:11s} " + ", ".join(
                f"{k} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
                for k, v in out[name].items()), flush=True)
    return out


def cold_line(epoch: dict[str, Any], bandwidth: float) -> str:
    """The cold epoch against what its bytes cost on the link alone."""
    down = epoch.get("proxy", {}).get("bytes_down", 0)
    return (f"cold {epoch['seconds']:6.2f} s (first batch {epoch['first_batch_s']:5.2f} s, "
            f"{epoch['cpu_s']:6.2f} CPU-s), {down / 1e6:6.1f} MB down: "
            f"{down / bandwidth:5.2f} s at the link's rate")


def label_digest(folder: Path) -> dict[str, Any]:
    """The folder's sample count and label multiset as peer_worker's Tally digests them."""
    import hashlib

    labels = np.sort(np.array([int(p.parent.name.removeprefix("class"))
                               for p in folder.glob("class*/*.jpg")], np.int64))
    return {"samples": len(labels),
            "label_digest": hashlib.sha256(labels.tobytes()).hexdigest()[:16]}


def s3_problems(result: dict[str, Any], want: dict[str, Any]) -> list[str]:
    if "error" in result:
        lines = result["error"].strip().splitlines()
        return [lines[-1] if lines else "failed"]
    epoch = result["epochs"][0]
    if epoch["samples"] != want["samples"]:
        return [f"{epoch['samples']} samples, expected {want['samples']}"]
    if epoch["label_digest"] != want["label_digest"]:
        return ["the labels' multiset differs from the source's"]
    return []


def slim(result: dict[str, Any]) -> dict[str, Any]:
    """A run without the proxy's request log (its counters and timings stay)."""
    for epoch in result.get("epochs", []):
        epoch.get("proxy", {}).pop("log", None)
    return result


# -- rows -----------------------------------------------------------------------------------------
COLD_PIL = "1 core: ringfeed cold / torchvision PIL path"
COLD_DALI = "1 core: ringfeed cold / DALI CPU (1 thread)"
CACHED_PIL = "1 core: ringfeed from decoded cache / torchvision PIL path"
E2E = "2 cores, batch 128 NCHW float: ringfeed (2 workers) / ImageFolder + DataLoader"
S3_BEST = "S3 50 MB/s, cold epoch: ringfeed / best peer"
GOALS = {COLD_PIL: 1.5, COLD_DALI: 1.1, CACHED_PIL: 5.0, E2E: 1.5, S3_BEST: 1.5}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def paired_row(metric: str, ours: list[float], theirs: list[float], peer: str) -> Row:
    """ours[i] / theirs[i] per pair (the same round): the row carries the ratios' median
    (their min-max in the note) and each contender's median images/s."""
    ratios = spread([a / b for a, b in zip(ours, theirs, strict=True)])
    note = (f"ratio {ratios['min']:.2f}-{ratios['max']:.2f} over {ratios['n']} pairs"
            if ratios["n"] > 1 else "1 pair")
    goal = (">=", GOALS[metric]) if metric in GOALS else None
    return Row("augment", metric, statistics.median(ours), "images/s", peer,
               statistics.median(theirs), ratio=ratios["median"], goal=goal, note=note)


def unmeasured(metric: str, why: str) -> Row:
    goal = (">=", GOALS[metric]) if metric in GOALS else None
    return Row("augment", metric, None, goal=goal, note=why)


def rates(passes: list[dict[str, Any]]) -> list[float]:
    return [p["rate"] for p in passes]


def one_core_rows(data: dict[str, Any]) -> list[Row]:
    if "error" in data:
        return [unmeasured(m, data["error"]) for m in (COLD_PIL, COLD_DALI, CACHED_PIL)]
    p = data["passes"]
    pil = rates(p["torchvision PIL"])
    dali = f"DALI {data.get('dali_version', '')}".strip()
    cold, cached = rates(p["ringfeed cold"]), rates(p["ringfeed cached"])
    rows = [paired_row(COLD_PIL, cold, pil, "torchvision PIL"),
            paired_row(COLD_DALI, cold, rates(p["DALI"]), dali) if "DALI" in p
            else unmeasured(COLD_DALI, data["dali_skipped"]),
            paired_row(CACHED_PIL, cached, pil, "torchvision PIL"),
            Row("augment", "1 core: ringfeed's first epoch, filling the decoded cache",
                data["fill"]["rate"], "images/s", "ringfeed cold", statistics.median(cold))]
    if "DALI" in p:
        rows.append(paired_row("1 core: DALI CPU / torchvision PIL path", rates(p["DALI"]), pil,
                               "torchvision PIL"))
    return rows


def two_core_rows(data: dict[str, Any]) -> list[Row]:
    if "error" in data:
        return [unmeasured(E2E, data["error"])]
    p = data["passes"]
    peer = "ImageFolder + DataLoader"
    return [paired_row(E2E, rates(p["ringfeed"]), rates(p["imagefolder"]), peer),
            paired_row("2 cores: ringfeed (0 workers, 2 decode threads) / ImageFolder + "
                       "DataLoader", rates(p["ringfeed_threads"]), rates(p["imagefolder"]),
                       peer)]


def s3_rows(data: dict[str, Any]) -> list[Row]:
    if "runs" not in data:
        return [unmeasured(S3_BEST, data["error"])]
    by: dict[str, dict[int, float]] = {}      # images/s of the cold epoch
    per_cpu: dict[str, dict[int, float]] = {}  # images per CPU-second of the reader's processes
    for r in data["runs"]:
        if not r["problems"]:
            epoch = r["epochs"][0]
            by.setdefault(r["name"], {})[r["repeat"]] = data["images"] / epoch["seconds"]
            per_cpu.setdefault(r["name"], {})[r["repeat"]] = data["images"] / epoch["cpu_s"]
    peers = [n for n, _ in S3_CONTENDERS[1:] if n in by]
    failed = "; ".join(f"{r['name']}: {r['problems'][0]}" for r in data["runs"] if r["problems"])
    reps = sorted(r for r in by.get("ringfeed", {}) if all(r in by[n] for n in peers))
    if not peers or not reps:
        return [unmeasured(S3_BEST, f"not measured: {failed}"[:200])]

    def best(table: dict[str, dict[int, float]], metric: str) -> Row:
        return paired_row(metric, [table["ringfeed"][r] for r in reps],
                          [max(table[n][r] for n in peers) for r in reps], "best peer")
    rows = [best(by, S3_BEST)]
    rows += [paired_row(f"S3 cold epoch: ringfeed / {n}", [by["ringfeed"][r] for r in reps],
                        [by[n][r] for r in reps], n) for n in peers]
    if BEFORE in by:
        before = [r for r in reps if r in by[BEFORE]]
        rows.append(paired_row(f"S3 cold epoch: ringfeed / {BEFORE}",
                               [by["ringfeed"][r] for r in before],
                               [by[BEFORE][r] for r in before], BEFORE))
    cpu = best(per_cpu, "S3 cold epoch, images per CPU-second of the reader's processes: "
                        "ringfeed / best peer")
    return [*rows, Row(**{**cpu.__dict__, "unit": "images/CPU-s"})]


# -- main -----------------------------------------------------------------------------------------
def print_profiles(profiles: dict[str, Any]) -> None:
    for which, result in profiles.items():
        print(f"\nwhere a {which} ringfeed pass spends its time (cProfile, one core, "
              f"{result['rate']:.0f} images/s under the profiler): own time")
        for entry in result["profile"][:10]:
            print(f"  {entry['share']:6.1%}  {entry['own_s']:8.3f} s  {entry['calls']:7d} calls"
                  f"  {entry['function']}")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def measure(args, work: Path) -> tuple[dict[str, Any], list[Row]]:
    q = args.quick
    small = photos(args.images or (128 if q else 1024))
    large = photos(args.images or (128 if q else 2048))
    with_peers = not q or args.peers
    dali_skipped = ("not asked" if args.s3_only else dali_missing() if with_peers
                    else "full mode only")
    rounds = args.rounds or (1 if q else 5)
    data: dict[str, Any] = {"uptime_start": uptime(), "photos": folder_facts(small),
                            "photos_large": folder_facts(large), "augment": AUGMENT,
                            "size": SIZE, "dali_skipped": dali_skipped}
    print(f"augment_bench: {data['photos']}", flush=True)
    rows = [] if args.s3_only else local_rows(args, data, small, large, rounds, work)
    if not with_peers:
        data["s3"] = {"error": "full mode only"}
    elif peers_python() is None:
        data["s3"] = {"error": "peers venv missing (bash benchmarks/peers/setup.sh)"}
    else:
        try:
            tools = args.s3_tools.split(",") if args.s3_tools else None
            data["s3"] = s3_epochs(large, [c for c in S3_CONTENDERS if tools is None
                                           or c[0] == "ringfeed" or c[0] in tools],
                                   32 if q else S3_PER_SHARD, args.repeats or (1 if q else 3),
                                   32 if q else 128, work / "s3", (50e6, 0.02),
                                   args.s3_baseline)
        except RuntimeError as e:
            data["s3"] = {"error": f"failed: {str(e)[:300]}"}
    rows += s3_rows(data["s3"])
    data["uptime_end"] = uptime()
    return data, rows


def local_rows(args, data: dict[str, Any], small: Path, large: Path, rounds: int,
               work: Path) -> list[Row]:
    """Rows 1-4 (one core, two cores), their data into `data`."""
    q = args.quick
    try:
        data["one_core"] = one_core(small, shards_of(small, 256), data["photos"]["images"], 64,
                                    rounds, not q, data["dali_skipped"], work)
    except RuntimeError as e:
        data["one_core"] = {"error": f"failed: {str(e)[:300]}"}
    rows = one_core_rows(data["one_core"])
    print_profiles(data["one_core"].get("profile", {}))
    try:
        data["two_cores"] = two_cores(large, shards_of(large, 256),
                                      data["photos_large"]["images"], 32 if q else 128,
                                      args.rounds or (1 if q else 3), not q, work)
    except RuntimeError as e:
        data["two_cores"] = {"error": f"failed: {str(e)[:300]}"}
    return rows + two_core_rows(data["two_cores"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 images, 1 round, no peers")
    parser.add_argument("--peers", action="store_true",
                        help="with --quick: DALI and the S3 peers too (when installed)")
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON goes")
    parser.add_argument("--images", type=int, help="images (1 core and 2 cores, S3)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (1 core, 2 cores)")
    parser.add_argument("--repeats", type=int, help="S3 repeats")
    parser.add_argument("--s3-only", action="store_true", help="only row 5, from S3")
    parser.add_argument("--s3-tools", help="S3 peers to read, e.g. webdataset,litdata (all)")
    parser.add_argument("--s3-baseline", metavar="DIR",
                        help=f"S3: also read with the ringfeed package in DIR ({BEFORE})")
    # the contenders' own processes
    parser.add_argument("--serve", choices=["pil", "ringfeed", "e2e"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        if args.cpu is not None:
            os.sched_setaffinity(0, {args.cpu})
        {"pil": serve_pil, "ringfeed": serve_ringfeed, "e2e": serve_e2e}[args.serve](args)
        return {}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="augment-bench-") as tmp:
        data, rows = measure(args, Path(tmp))
    return finish("augment_bench", args.quick, Path(args.results), rows, data)


if __name__ == "__main__":
    main()
