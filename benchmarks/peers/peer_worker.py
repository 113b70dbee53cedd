"""One contender of benchmarks/bucket_bench.py in its own process: prepare a dataset with a
tool's own writer, or read it (cold epoch, warm epoch, time to first batch) with its own loader.

Runs in the peers' venv (benchmarks/.peers-venv: webdataset, MosaicML Streaming, LitData) or,
for ringfeed, in the repository's .venv. Prints one JSON line (the last line of stdout).

    python peer_worker.py prepare --tool wds|mds|litdata --src IMAGES --out DIR --per-shard N
    python peer_worker.py read --tool ringfeed|wds|mds|litdata --decoder own|ringfeed \\
        --data DIR_OR_S3_URL --cache DIR [--endpoint URL] [--batch 256] [--workers 2] \\
        [--augment SIZE]

"ringfeed" as the decoder: the tool's reader hands over the stored JPEG bytes and ringfeed's
own decoder (pipeline/codecs.py, loaded by path: simplejpeg, checked against PIL) makes the
arrays, so decode and I/O can be told apart.

`--augment SIZE` (benchmarks/augment_bench.py): torchvision's RandomResizedCrop(SIZE) + flip on
every image. ringfeed through its own `augment` option; each peer decodes with PIL, converts to
RGB and crops and flips in PIL (peers/pil_augment.py) through its documented place for a
transform: webdataset `.decode("pilrgb").map_tuple(...)`, a Streaming `StreamingDataset`
subclass's `__getitem__`, LitData's `transform=` (its JPEG deserializer hands over the PIL
image: its own decoder is torchvision.io, which does not load here).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # pil_augment
RINGFEED_AUGMENT = ["random_resized_crop", "horizontal_flip"]


def ringfeed_codecs():
    """pipeline/codecs.py by path (stdlib + numpy + simplejpeg/PIL): ringfeed's decoder without
    the ringfeed package."""
    name = "ringfeed_bench_codecs"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "pipeline" / "codecs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rf_decode(data: bytes) -> np.ndarray:
    return ringfeed_codecs().decode_image(data)


def pil_decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# -- the source images -----------------------------------------------------------------------
def source_items(src: Path) -> list[tuple[Path, int]]:
    """(jpeg path, label) of an image folder `class<k>/<i>.jpg`, shuffled with seed 0 (what
    `ringfeed shard --shuffle-seed 0` does to its input, by its own generator)."""
    items = []
    for folder in sorted(src.iterdir()):
        if folder.is_dir():
            label = int(folder.name.removeprefix("class"))
            items += [(p, label) for p in sorted(folder.glob("*.jpg"))]
    random.Random(0).shuffle(items)
    return items


def prepare(tool: str, src: Path, out: Path, per_shard: int, workers: int) -> dict:
    items = source_items(src)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if tool == "ringfeed":              # `ringfeed shard`, in this process (.venv's python)
        from ringfeed.train.cli import main as ringfeed

        start = time.perf_counter()
        code = ringfeed(["shard", str(src), str(out), "--format", "imagefolder",
                         "--max-count", str(per_shard), "--shuffle-seed", "0",
                         "--workers", str(workers), "--no-progress"])
        if code:
            raise SystemExit(f"ringfeed shard exited {code}")
    elif tool == "ringfeed-gz":         # the same shards gzipped (level 1), then indexed
        import gzip
        import shutil
        import tempfile

        from ringfeed.train.cli import main as ringfeed

        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            code = ringfeed(["shard", str(src), tmp, "--format", "imagefolder",
                             "--max-count", str(per_shard), "--shuffle-seed", "0",
                             "--workers", str(workers), "--no-progress"])
            for tar in sorted(Path(tmp).glob("*.tar")):
                with open(tar, "rb") as f, gzip.open(out / (tar.name + ".gz"), "wb",
                                                     compresslevel=1) as g:
                    shutil.copyfileobj(f, g, 1 << 20)
        code = code or ringfeed(["shard", str(out), "--format", "wds-index", "--no-progress"])
        if code:
            raise SystemExit(f"ringfeed shard exited {code}")
    elif tool == "wds":
        import webdataset as wds

        with wds.ShardWriter(str(out / "train-%06d.tar"), maxcount=per_shard,
                             verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{i:08d}", "jpg": path.read_bytes(), "cls": label})
    elif tool == "mds":
        from streaming import MDSWriter

        # bytes per shard for ~per_shard samples (MDS limits shards by size only)
        mean = sum(p.stat().st_size for p, _ in items[:500]) / min(500, len(items))
        limit = int(per_shard * (mean + 24))
        with MDSWriter(out=str(out), columns={"jpg": "jpeg", "cls": "int"},
                       size_limit=limit) as sink:
            from PIL import Image

            for path, label in items:
                sink.write({"jpg": Image.open(path), "cls": label})
    elif tool == "litdata":
        import litdata

        litdata.optimize(fn=_litdata_sample, inputs=[(str(p), lab) for p, lab in items],
                         output_dir=str(out), chunk_size=per_shard, num_workers=workers,
                         mode="overwrite", start_method="fork")
    else:
        raise SystemExit(f"unknown tool {tool}")
    seconds = time.perf_counter() - start
    files = [p for p in out.rglob("*") if p.is_file()]
    return {"tool": tool, "seconds": seconds, "files": len(files),
            "bytes": sum(p.stat().st_size for p in files), "samples": len(items)}


def _litdata_sample(item):
    from PIL import Image

    path, label = item
    return {"jpg": Image.open(path), "cls": label}   # a JpegImageFile: stored as its bytes


# -- reading ---------------------------------------------------------------------------------
class Tally:
    """Counts samples and keeps the multiset of (label, pixel sum) of every valid sample."""

    def __init__(self):
        self.keys: list[np.ndarray] = []
        self.samples = 0

    def add(self, images, labels, valid=None) -> None:
        images = np.asarray(images)
        labels = np.asarray(labels).astype(np.int64).reshape(-1)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise SystemExit(f"not uint8 NHWC: {images.dtype} {images.shape}")
        if valid is not None:
            valid = np.asarray(valid, dtype=bool)
            images, labels = images[valid], labels[valid]
        sums = images.reshape(len(images), -1).sum(axis=1, dtype=np.int64)
        self.keys.append(labels * 10**9 + sums)
        self.samples += len(labels)

    def result(self) -> dict:
        keys = np.sort(np.concatenate(self.keys)) if self.keys else np.zeros(0, np.int64)
        labels = keys // 10**9
        return {"samples": self.samples,
                "digest": hashlib.sha256(keys.tobytes()).hexdigest()[:16],
                "label_digest": hashlib.sha256(np.sort(labels).tobytes()).hexdigest()[:16]}


def collate_dicts(decode):
    def collate(samples):
        images = np.stack([decode(s["jpg"]) for s in samples])
        return images, np.array([int(s["cls"]) for s in samples], np.int64)

    return collate


def _as_array(image) -> np.ndarray:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return rf_decode(bytes(image))
    if isinstance(image, np.ndarray):
        return image
    if hasattr(image, "numpy"):                       # a torch tensor (CHW from torchvision)
        array = image.numpy()
        return np.ascontiguousarray(array.transpose(1, 2, 0)) if array.shape[0] == 3 else array
    return np.asarray(image.convert("RGB"))           # PIL: decoded here (lazily loaded)


class PILAugment:
    """A PIL image -> uint8 HWC RGB, RandomResizedCrop(size) + flip (peers/pil_augment.py),
    with a generator of each process's own (loader workers fork from one parent)."""

    def __init__(self, size: int):
        self.size = size
        self._rng: tuple[int, random.Random] | None = None

    def __call__(self, image) -> np.ndarray:
        from pil_augment import crop_flip

        if self._rng is None or self._rng[0] != os.getpid():
            self._rng = (os.getpid(), random.Random(os.getpid()))
        return np.asarray(crop_flip(image.convert("RGB"), self.size, self._rng[1]))


def _s3_boto(endpoint: str | None):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@dataclass(frozen=True)
class ReadSpec:
    """What one reader reads and how (make_loader's arguments)."""

    decoder: str
    data: str
    cache: Path
    endpoint: str | None
    batch: int
    workers: int
    crop: PILAugment | None

    @property
    def remote(self) -> bool:
        return self.data.startswith("s3://")


def make_loader(tool: str, decoder: str, data: str, cache: Path, endpoint: str | None,
                batch: int, workers: int, augment: int = 0):
    """An iterable of (images NHWC uint8, labels, valid or None) batches, one epoch per
    iteration."""
    spec = ReadSpec(decoder, data, cache, endpoint, batch, workers,
                    PILAugment(augment) if augment else None)
    loaders = {"ringfeed": _ringfeed_loader, "ringfeed-gz": _ringfeed_loader,
               "wds": _wds_loader, "mds": _mds_loader, "litdata": _litdata_loader}
    if tool not in loaders:
        raise SystemExit(f"unknown tool {tool}")
    loader = loaders[tool](spec)
    if tool.startswith("ringfeed"):
        def epochs():
            for b in loader:
                yield b["jpg"], b["cls"], b["__valid__"]
    else:
        def epochs():
            for images, labels in loader:
                yield images, labels, None
    return epochs


def _ringfeed_loader(spec: ReadSpec):
    from ringfeed.pipeline import ShardPipeline
    from ringfeed.pipeline.torch import make_loader as rf_loader

    options = ({"endpoint_url": spec.endpoint, "key": "testing", "secret": "testing"}
               if spec.remote else {})
    extra = ({"augment": RINGFEED_AUGMENT, "image_size": (spec.crop.size, spec.crop.size)}
             if spec.crop else {})
    pipe = ShardPipeline(spec.data, batch_size=spec.batch, num_workers=spec.workers,
                         balance="pad", cache_dir=str(spec.cache), storage_options=options,
                         seed=0, **extra)
    return rf_loader(pipe)


def _wds_loader(spec: ReadSpec):
    import webdataset as wds
    from torch.utils.data import DataLoader

    endpoint = spec.endpoint
    if spec.remote:
        def gopen_s3(url, mode="rb", bufsize=8192):
            bucket, key = url[len("s3://"):].split("/", 1)
            return _s3_boto(endpoint).get_object(Bucket=bucket, Key=key)["Body"]
        importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = gopen_s3
        import boto3  # noqa: F401  (imported in the parent: the workers fork with it)

        bucket, prefix = spec.data[len("s3://"):].split("/", 1)
        listing = _s3_boto(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        urls = sorted(f"s3://{bucket}/{o['Key']}" for o in listing.get("Contents", [])
                      if o["Key"].endswith(".tar"))
        extra = {"cache_dir": str(spec.cache)}
    else:
        urls = sorted(str(p) for p in Path(spec.data).glob("*.tar"))
        extra = {}
    dataset = wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=0,
                             **extra).shuffle(1000)
    if spec.crop is not None:
        dataset = dataset.decode("pilrgb").to_tuple("jpg", "cls").map_tuple(spec.crop, int)
    elif spec.decoder == "own":
        dataset = dataset.decode("rgb8").to_tuple("jpg", "cls")
    else:
        dataset = dataset.map(lambda s: (rf_decode(s["jpg"]), int(s["cls"])))
    dataset = dataset.batched(spec.batch, partial=True)
    return DataLoader(dataset, batch_size=None, num_workers=spec.workers,
                      persistent_workers=True, prefetch_factor=2)


def _mds_loader(spec: ReadSpec):
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    if spec.decoder == "ringfeed":       # Streaming's "jpeg" column handed over as its bytes
        from streaming.base.format.mds import encodings

        class RawJPEG(encodings.JPEG):
            def decode(self, data: bytes):
                return data
        encodings._encodings["jpeg"] = RawJPEG
    kind = StreamingDataset
    crop = spec.crop
    if crop is not None:
        class Augmented(StreamingDataset):      # Streaming's place for a transform
            def __getitem__(self, index):
                sample = super().__getitem__(index)
                return {**sample, "jpg": crop(sample["jpg"])}
        kind = Augmented
    if spec.remote:
        os.environ["S3_ENDPOINT_URL"] = spec.endpoint
        dataset = kind(remote=spec.data, local=str(spec.cache), batch_size=spec.batch,
                       shuffle=True, shuffle_seed=0)
    else:
        dataset = kind(local=spec.data, batch_size=spec.batch, shuffle=True, shuffle_seed=0)
    return DataLoader(dataset, batch_size=spec.batch, num_workers=spec.workers,
                      collate_fn=collate_dicts(_as_array), persistent_workers=True,
                      prefetch_factor=2)


def _litdata_loader(spec: ReadSpec):
    import litdata
    from litdata.streaming import serializers

    transform = None
    crop = spec.crop
    if crop is not None:                 # the PIL image, cropped by LitData's transform=
        def pil_image(data: bytes):
            from PIL import Image

            return Image.open(io.BytesIO(bytes(data)))
        serializers._decode_image_tensor = pil_image

        def transform(sample):
            return {**sample, "jpg": crop(sample["jpg"])}
    elif spec.decoder == "ringfeed":     # LitData's JPEG serializer hands over the bytes
        def raw(self, data: bytes):
            return bytes(data)
        serializers.JPEGSerializer.deserialize = raw
    else:
        # LitData 0.2.76 decodes JPEGs only with torchvision.io (PIL only for EXIF ones),
        # and torchvision cannot load here (setup.sh): its PIL path, for every JPEG
        def pil_tensor(data: bytes):
            import torch

            return torch.from_numpy(pil_decode(data)).permute(2, 0, 1).contiguous()
        serializers._decode_image_tensor = pil_tensor
    options = {}
    if spec.remote:
        # boto3 client kwargs (LitData's S3Client passes storage_options to boto3); its
        # obstore store copies the endpoint from that client, but its client options are
        # a module constant without `allow_http`: obstore refuses http:// endpoints else
        from litdata.streaming import downloader

        downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS,
                                              "allow_http": True}
        options = {"cache_dir": str(spec.cache), "storage_options": {
            "endpoint_url": spec.endpoint, "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing", "region_name": "us-east-1"}}
    dataset = litdata.StreamingDataset(spec.data, shuffle=True, seed=0, transform=transform,
                                       **options)
    return litdata.StreamingDataLoader(dataset, batch_size=spec.batch,
                                       num_workers=spec.workers,
                                       collate_fn=collate_dicts(_as_array),
                                       persistent_workers=True, prefetch_factor=2)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and all its descendants, reaped or still
    running (persistent loader workers), from /proc."""
    import resource

    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[tuple[int, float]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue   # exited meanwhile
            kids.setdefault(int(fields[1]), []).append(
                (int(entry), (int(fields[11]) + int(fields[12])) / tick))
    total, todo = 0.0, [os.getpid()]
    while todo:
        for pid, cpu in kids.get(todo.pop(), []):
            total += cpu
            todo.append(pid)
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def read(args) -> dict:
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    import torch  # noqa: F401  (every contender's loader: not part of its time)

    {"ringfeed": lambda: __import__("ringfeed.pipeline.torch"),
     "ringfeed-gz": lambda: __import__("ringfeed.pipeline.torch"),
     "wds": lambda: __import__("webdataset"), "mds": lambda: __import__("streaming"),
     "litdata": lambda: __import__("litdata")}[args.tool]()
    imported = time.perf_counter() - start
    start, cpu = time.perf_counter(), cpu_seconds()
    epochs = make_loader(args.tool, args.decoder, args.data, cache, args.endpoint,
                         args.batch, args.workers, args.augment)
    built = time.perf_counter() - start
    out = {"tool": args.tool, "decoder": args.decoder, "import_s": imported,
           "build_s": built, "epochs": []}
    for epoch in range(args.epochs):
        tally = Tally()
        t = time.perf_counter()
        first = None
        for images, labels, valid in epochs():
            if first is None:
                first = time.perf_counter() - t + (built if epoch == 0 else 0.0)
            tally.add(images, labels, valid)
        seconds = time.perf_counter() - t + (built if epoch == 0 else 0.0)
        cpu, cpu_before = cpu_seconds(), cpu
        out["epochs"].append({"seconds": seconds, "first_batch_s": first,
                              "cpu_s": cpu - cpu_before, **tally.result()})
        if args.mark:                     # the parent reads the proxy's counters per epoch
            print(json.dumps({"mark": epoch}), flush=True)
            sys.stdin.readline()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "read"])
    parser.add_argument("--tool", required=True)
    parser.add_argument("--decoder", default="own", choices=["own", "ringfeed"])
    parser.add_argument("--src")
    parser.add_argument("--out")
    parser.add_argument("--per-shard", type=int, default=2000)
    parser.add_argument("--data")
    parser.add_argument("--cache", default="/tmp/peer-cache")
    parser.add_argument("--endpoint")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--augment", type=int, default=0, metavar="SIZE",
                        help="RandomResizedCrop(SIZE) + flip on every image (0: off)")
    parser.add_argument("--mark", action="store_true",
                        help="after each epoch print a mark line and wait for a line on stdin")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        result = prepare(args.tool, Path(args.src), Path(args.out), args.per_shard,
                         args.workers)
    else:
        result = read(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
