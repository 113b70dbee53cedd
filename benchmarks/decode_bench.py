"""Image decode speed on one core: PIL (the reference) vs ringfeed's pipeline.codecs vs
simplejpeg, OpenCV and torchvision's CPU decoders, JPEG and PNG at 32-256 px.

    .venv/bin/python benchmarks/decode_bench.py            # ~1 minute
    .venv/bin/python benchmarks/decode_bench.py --quick    # 32 and 64 px, a few seconds

Images are generated (smooth gradients plus noise, JPEG quality 90, 4:2:0), 16 per size. Each
contender decodes all of them to uint8 HWC RGB, one thread (OMP/OpenCV/torch threads = 1); the
best of --repeat passes counts, in microseconds per image. "max diff" is the largest absolute
pixel difference from PIL's decode (0 = identical). Contenders that are not installed (or do not
load) are listed with the reason. Also measured: whether simplejpeg releases the GIL (a second
Python thread keeps running while it decodes; 2 threads vs 1 thread throughput) and the opt-in
DCT-domain downscale (codecs.decode_image(..., dct_downscale=True)) against the exact resize.
Prints a table and writes benchmarks/results/decode_bench[_quick].json (+ .png). It measures,
it does not assert.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import REPO, RESULTS, Row, finish, new_figure  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = (32, 64, 128, 256)
IMAGES_PER_SIZE = 16


def natural(side: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise (JPEG-typical content), side x side RGB."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side].astype(np.float32)
    planes = [127 + 60 * np.sin(x / side * a * 6.28 + p) * np.cos(y / side * b * 6.28)
              for a, b, p in rng.uniform(0.5, 3, (3, 3))]
    pixels = np.stack(planes, -1) + rng.normal(0, float(rng.uniform(2, 12)), (side, side, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def encoded(fmt: str, side: int, count: int) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(count):
        buffer = io.BytesIO()
        image = Image.fromarray(natural(side, seed=side * 1000 + i))
        if fmt == "JPEG":
            image.save(buffer, "JPEG", quality=90)
        else:
            image.save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


# -- contenders: name -> (fmt -> decode(bytes) -> HWC uint8) or the reason it is missing -------
def contenders() -> tuple[dict[str, dict[str, Callable[[bytes], np.ndarray]]], dict[str, str]]:
    from ringfeed.pipeline import codecs

    found: dict[str, dict[str, Callable[[bytes], np.ndarray]]] = {
        "PIL": {"JPEG": codecs.decode_pil, "PNG": codecs.decode_pil},
        "ringfeed": {"JPEG": codecs.decode_image, "PNG": codecs.decode_image},
    }
    missing: dict[str, str] = {}
    try:
        import simplejpeg

        found["simplejpeg"] = {"JPEG": simplejpeg.decode_jpeg}
    except ImportError as e:
        missing["simplejpeg"] = f"not installed ({e})"
    try:
        import cv2

        cv2.setNumThreads(1)

        def cv2_decode(data: bytes) -> np.ndarray:
            bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
            return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

        found["cv2"] = {"JPEG": cv2_decode, "PNG": cv2_decode}
    except ImportError as e:
        missing["cv2"] = f"not installed ({e})"
    try:
        import importlib.util

        if importlib.util.find_spec("torchvision") is None:
            raise ImportError("not installed")
        import torch
        from torchvision.io import decode_jpeg, decode_png

        torch.set_num_threads(1)

        def tv(decode):
            def run(data: bytes) -> np.ndarray:
                tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return decode(tensor).permute(1, 2, 0).numpy()
            return run

        found["torchvision"] = {"JPEG": tv(decode_jpeg), "PNG": tv(decode_png)}
    except Exception as e:  # noqa: BLE001 - not installed, or a build for another torch
        text = str(e).strip().splitlines()
        missing["torchvision"] = (f"does not load: {type(e).__name__}: "
                                  f"{text[0] if text else ''}")[:160]
    return found, missing


def best_us(fns: dict[str, Callable[[bytes], Any]], datas: list[bytes],
            repeat: int) -> dict[str, float]:
    """Per contender, the best over `repeat` passes of the mean time per image (us). The
    contenders take turns pass by pass, so a burst of load elsewhere hits them all alike."""
    for fn in fns.values():
        for d in datas[:2]:
            fn(d)  # warm up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            for d in datas:
                fn(d)
            best[name] = min(best[name], (time.perf_counter() - start) / len(datas))
    return {name: t * 1e6 for name, t in best.items()}


def max_diff(fn: Callable[[bytes], np.ndarray], datas: list[bytes]) -> int | None:
    from ringfeed.pipeline import codecs

    worst = 0
    for d in datas:
        got, want = np.asarray(fn(d)), codecs.decode_pil(d)
        if got.shape != want.shape:
            return None
        worst = max(worst, int(np.abs(got.astype(np.int16) - want).max()))
    return worst


def speed_table(sizes: tuple[int, ...], repeat: int) -> dict[str, Any]:
    found, missing = contenders()
    table: dict[str, Any] = {}
    for fmt in ("JPEG", "PNG"):
        for side in sizes:
            datas = encoded(fmt, side, IMAGES_PER_SIZE)
            passes = repeat if side <= 64 else max(2, repeat // 2)
            entry: dict[str, Any] = {"bytes_per_image": sum(map(len, datas)) / len(datas)}
            fns = {name: f[fmt] for name, f in found.items() if fmt in f}
            for name, us in best_us(fns, datas, passes).items():
                entry[name] = {"us": us, "max_diff": max_diff(fns[name], datas)}
            table[f"{fmt} {side}px"] = entry
    return {"table": table, "missing": missing}


# -- the GIL --------------------------------------------------------------------------------------
def threads_throughput(fn: Callable[[bytes], Any], datas: list[bytes], threads: int,
                       seconds: float) -> float:
    """Images per second with `threads` threads decoding for about `seconds`."""
    counts = [0] * threads
    stop = threading.Event()

    def work(slot: int) -> None:
        while not stop.is_set():
            for d in datas:
                fn(d)
            counts[slot] += len(datas)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def stalled_share(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(ms per call of fn, median over the calls of the longest wake-up delay of a second
    thread sleeping 1 ms at a time, as a share of the call). That thread needs the GIL to
    return from sleep: a decoder holding the GIL delays it by about the whole call (share ~1)
    every call; one that releases it leaves the scheduler's wake-up latency, which stays short
    even on a busy machine (a sleeper is woken ahead of running work), so the share is ~0."""
    stop = threading.Event()
    late: list[tuple[float, float]] = []  # (due, woke) of the late wake-ups

    def sleeper() -> None:
        while not stop.is_set():
            due = time.perf_counter() + 1e-3
            time.sleep(1e-3)
            woke = time.perf_counter()
            if woke - due > 2e-4:
                late.append((due, woke))

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.02)
    spans = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        spans.append((start, time.perf_counter()))
        time.sleep(0.005)
    stop.set()
    thread.join()
    shares = []
    for start, end in spans:
        longest = max((min(w, end) - max(d, start) for d, w in late if w > start and d < end),
                      default=0.0)
        shares.append(longest / (end - start))
    per_call = float(np.mean([e - s for s, e in spans]))
    return per_call * 1e3, float(np.median(shares))


def gil(quick: bool) -> dict[str, Any]:
    from ringfeed.pipeline import codecs

    out: dict[str, Any] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    if codecs.simplejpeg is None:
        out["skipped"] = "simplejpeg not installed"
        return out
    big = encoded("JPEG", 1024 if quick else 2048, 1)[0]
    held = list(range(100_000 if quick else 300_000))
    np.random.default_rng(0).shuffle(held)  # sorting it takes a while, holding the GIL
    calls = 5 if quick else 15
    out["stall"] = {
        "control: sorted() holds the GIL": stalled_share(lambda: sorted(held), calls),
        "simplejpeg": stalled_share(lambda: codecs.simplejpeg.decode_jpeg(big), calls),
        "PIL": stalled_share(lambda: codecs.decode_pil(big), calls),
    }
    seconds = 0.25 if quick else 2.0
    for side in (64, 256):
        datas = encoded("JPEG", side, 8)
        for name, fn in (("simplejpeg", codecs.simplejpeg.decode_jpeg),
                         ("ringfeed", lambda d: codecs.decode_image(d, None)),
                         ("PIL", codecs.decode_pil)):
            one = two = 0.0
            for _ in range(3):  # alternating, best of each
                one = max(one, threads_throughput(fn, datas, 1, seconds / 3))
                two = max(two, threads_throughput(fn, datas, 2, seconds / 3))
            out[f"{name} {side}px"] = {"1 thread/s": one, "2 threads/s": two,
                                       "speedup": two / one}
    return out


# -- opt-in DCT-domain downscale ------------------------------------------------------------------
def dct_downscale(repeat: int, quick: bool) -> dict[str, Any]:
    from ringfeed.pipeline import codecs

    out = {}
    cases = [(256, 64)] if quick else [(256, 128), (256, 64), (512, 224), (512, 128)]
    for source, target in cases:
        datas = encoded("JPEG", source, 8)
        size = (target, target)
        diffs = [np.abs(codecs.decode_image(d, size, dct_downscale=True).astype(np.int16)
                        - codecs.decode_image(d, size)) for d in datas]
        out[f"{source}->{target}"] = {
            **{f"{name}_us": us for name, us in best_us({
                "exact": lambda d, s=size: codecs.decode_image(d, s),
                "dct": lambda d, s=size: codecs.decode_image(d, s, dct_downscale=True),
                "PIL": lambda d, s=size: codecs.decode_pil(d, s)}, datas, repeat).items()},
            "max_diff": int(max(d.max() for d in diffs)),
            "mean_diff": float(np.mean([d.mean() for d in diffs])),
        }
    return out


# -- output ---------------------------------------------------------------------------------------
def print_tables(data: dict[str, Any]) -> None:
    table = data["speed"]["table"]
    names = ["PIL", "ringfeed", "simplejpeg", "cv2", "torchvision"]
    print("\nus per image, one thread (max abs diff vs PIL in brackets)")
    print("case".ljust(12) + "".join(n.rjust(16) for n in names))
    for case, entry in table.items():
        cells = []
        for n in names:
            r = entry.get(n)
            cells.append("-" if r is None else
                         f"{r['us']:.1f} [{'shape!' if r['max_diff'] is None else r['max_diff']}]")
        print(case.ljust(12) + "".join(c.rjust(16) for c in cells))
    for name, why in data["speed"]["missing"].items():
        print(f"  {name}: {why}")
    g = data["gil"]
    if "stall" in g:
        print("\nGIL: a sleeping thread's wake-up delay during a decode call (median share)")
        for name, (per_call, share) in g["stall"].items():
            print(f"  {name:34s} {per_call:7.1f} ms/call, delayed {share:4.0%} of it")
        print(f"2 threads vs 1 (cpus={g['cpus']}, load {g['load_avg_1m']} at the start)")
        for key, value in g.items():
            if isinstance(value, dict) and "speedup" in value:
                print(f"  {key:18s} {value['1 thread/s']:9.0f}/s -> {value['2 threads/s']:9.0f}/s"
                      f"  x{value['speedup']:.2f}")
    print("\nopt-in dct_downscale vs the exact resize (JPEG)")
    for case, r in data["dct_downscale"].items():
        print(f"  {case:9s} exact {r['exact_us']:8.1f} us  dct {r['dct_us']:8.1f} us  "
              f"PIL {r['PIL_us']:8.1f} us  max diff {r['max_diff']}  mean {r['mean_diff']:.2f}")


def rows_of(data: dict[str, Any]) -> list[Row]:
    rows = []
    for case, entry in data["speed"]["table"].items():
        pil = entry["PIL"]["us"]
        for name in ("ringfeed", "simplejpeg", "cv2", "torchvision"):
            r = entry.get(name)
            if r is None or (name == "simplejpeg" and "PNG" in case):
                continue
            diff = "shape differs" if r["max_diff"] is None else f"max diff {r['max_diff']}"
            rows.append(Row("decode", f"{case}: {name} / PIL, images/s", 1e6 / r["us"],
                            "images/s", "PIL", 1e6 / pil, note=diff))
    return rows


def plot(data: dict[str, Any]):
    fig, axes = new_figure(ncols=2, width=5.5, height=3.8)
    table = data["speed"]["table"]
    for ax, fmt in zip(axes, ("JPEG", "PNG"), strict=True):
        cases = [c for c in table if c.startswith(fmt)]
        sides = [int(c.split()[1][:-2]) for c in cases]
        for name, color in (("PIL", "tab:blue"), ("ringfeed", "tab:orange"),
                            ("simplejpeg", "tab:green"), ("cv2", "tab:red"),
                            ("torchvision", "tab:purple")):
            us = [table[c].get(name, {}).get("us") for c in cases]
            if any(u is not None for u in us):
                ax.plot(sides, us, marker="o", label=name, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("image side (px)")
        ax.set_ylabel("us per image (one thread)")
        ax.set_title(f"{fmt} decode")
        ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 and 64 px, few repeats")
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON/PNG go")
    parser.add_argument("--repeat", type=int, default=None, help="timed passes per case")
    args = parser.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENCV_FOR_THREADS_NUM"):
        os.environ.setdefault(var, "1")
    quick = args.quick
    repeat = args.repeat or (3 if quick else 15)
    sizes = SIZES[:2] if quick else SIZES
    from ringfeed.pipeline import codecs

    data: dict[str, Any] = {"images_per_size": IMAGES_PER_SIZE, "repeat": repeat,
                            "jpeg_backend": codecs.jpeg_backend(), "versions": versions()}
    data["speed"] = speed_table(sizes, repeat)
    data["gil"] = gil(quick)
    data["dct_downscale"] = dct_downscale(max(2, repeat // 3), quick)
    print_tables(data)
    rows = rows_of(data)
    return finish("decode_bench", quick, Path(args.results), rows, data, plot(data))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("pillow", "simplejpeg", "opencv-python-headless", "torch", "torchvision"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


if __name__ == "__main__":
    main()
