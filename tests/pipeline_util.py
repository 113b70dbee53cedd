"""Shard fixtures and local servers for the pipeline tests (real tars, real servers, 127.0.0.1).

Shards are written with webdataset.TarWriter and described by a ringfeed.formats.manifest.Manifest, as
`ringfeed shard` does. Sample `g` (global id, manifest order) has key `s{shard}_{pos}`,
`cls` = g % 10 and `npy` = [g, 2g] (int64), so every decoded value names its sample.

Run as a script, it is the rank program of the horovodrun test (see `hvd_main`).
"""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringfeed.formats.manifest import Manifest, ShardInfo, Split  # noqa: E402
from ringfeed.fsutil import sha256_file  # noqa: E402


def png_bytes(value: int, size: int = 8) -> bytes:
    from PIL import Image

    array = np.full((size, size, 3), value % 256, dtype=np.uint8)
    array[0, 0] = [(value // 256) % 256, 0, 0]
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def write_shards(directory: str | os.PathLike, sizes: Sequence[int], split: str = "train",
                 images: bool = False, prefix: str | None = None,
                 manifest: bool = True) -> list[Path]:
    """Write one tar per entry of `sizes` (its sample count) and manifest.json; return paths."""
    import webdataset as wds  # imports torch: not for the server child process

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prefix = prefix or split
    paths, infos, g = [], [], 0
    for s, n in enumerate(sizes):
        path = directory / f"{prefix}-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for pos in range(n):
                sample = {"__key__": f"s{s:04d}_{pos:05d}", "cls": str(g % 10).encode(),
                          "npy": np.array([g, 2 * g], dtype=np.int64)}
                if images:
                    sample["png"] = png_bytes(g)
                sink.write(sample)
                g += 1
        paths.append(path)
        infos.append(ShardInfo(path.name, n, path.stat().st_size, sha256_file(path)))
    if manifest:
        fields = {"cls": "int", "npy": "npy", **({"png": "image"} if images else {})}
        existing = (Manifest.load(directory).splits
                    if (directory / "manifest.json").exists() else {})
        Manifest(splits={**existing, split: Split(infos)}, fields=fields,
                 created_by="tests").save(directory)
    return paths


def collect(batches) -> list[dict]:
    """Batches -> plain comparable records (lists), asserting each sample matches its id."""
    out = []
    for batch in batches:
        index = np.asarray(batch["__index__"]).tolist()
        npy = np.asarray(batch["npy"])
        for i, g in enumerate(index):
            if bool(np.asarray(batch["__valid__"])[i]):
                assert npy[i].tolist() == [g, 2 * g], (g, npy[i])
        out.append({"index": index, "valid": np.asarray(batch["__valid__"]).tolist()})
    return out


def valid_ids(records: list[dict]) -> list[int]:
    return [g for r in records for g, v in zip(r["index"], r["valid"], strict=True) if v]


# -- servers -------------------------------------------------------------------------------
class _Handler(http.server.SimpleHTTPRequestHandler):
    """Static files; `corrupt` names are served with flipped bytes; `rate` throttles (B/s)."""

    corrupt: set[str] = set()
    rate: float | None = None
    requests: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        name = self.path.lstrip("/").split("?")[0]
        self.requests.append(name)
        path = Path(self.directory) / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        if name in self.corrupt:
            data = bytes(b ^ 0xFF for b in data[:64]) + data[64:]
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        chunk, start = 64 * 1024, time.perf_counter()
        for i in range(0, len(data), chunk):
            self.wfile.write(data[i:i + chunk])
            if self.rate:  # pace to the rate, wall clock (write time included)
                time.sleep(max(0.0, start + (i + chunk) / self.rate - time.perf_counter()))


@contextmanager
def http_server(directory: str | os.PathLike, corrupt: Sequence[str] = (),
                rate: float | None = None) -> Iterator[tuple[str, list[str]]]:
    """Serve `directory` on 127.0.0.1 (a thread); yields (base URL, list of requested names)."""
    handler = type("Handler", (_Handler,), {"corrupt": set(corrupt), "rate": rate,
                                            "requests": []})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def http_server_process(directory: str | os.PathLike, rate: float | None = None
                        ) -> Iterator[str]:
    """`http_server` in a child process (so its throttling does not compete with the caller
    for the GIL); yields the base URL."""
    import subprocess

    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import pipeline_util as u\n"
            "rate = float(sys.argv[3]) if sys.argv[3] != 'None' else None\n"
            "with u.http_server(sys.argv[2], rate=rate) as (url, _):\n"
            "    print(url, flush=True)\n"
            "    time.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent),
                             str(directory), str(rate)], stdout=subprocess.PIPE, text=True)
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


# -- horovodrun rank program ---------------------------------------------------------------
def hvd_main(argv: list[str]) -> int:
    """`python pipeline_util.py <shard dir> <out dir> [fail]`: under horovodrun, build a
    pipeline with default rank/size (from Horovod), iterate one epoch with an allreduce per
    batch, and write what this rank saw to <out>/rank<r>.json."""
    import horovod.torch as hvd
    import torch

    from ringfeed.pipeline import ShardPipeline

    hvd.init()
    source, out = argv[0], Path(argv[1])
    on_error = "fail" if "fail" in argv[2:] else "skip"
    pipe = ShardPipeline(source, batch_size=4, seed=3, shuffle_buffer=8, on_error=on_error)
    seen = []
    for batch in pipe:
        hvd.allreduce(torch.ones(1), name="step")
        seen.append(np.asarray(batch["__index__"]).tolist())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(
        {"rank": pipe.rank, "world_size": pipe.world_size, "hvd_size": hvd.size(),
         "batches_per_epoch": pipe.batches_per_epoch, "batches": seen}))
    return 0


if __name__ == "__main__":
    sys.exit(hvd_main(sys.argv[1:]))
