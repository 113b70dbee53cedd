"""Allreduce: Horovod (Gloo) bus bandwidth vs tensor size on 2 ranks, against
torch.distributed's gloo allreduce, with fp16 compression, with tensor fusion on and off for
many small tensors, Horovod's cycle time and fusion threshold (the `horovod:` config knobs) on
the smallest and largest tensor, and the loopback ceilings (memory copy, TCP over 127.0.0.1).

    .venv/bin/python benchmarks/allreduce_bench.py            # 4 KB .. 256 MB
    .venv/bin/python benchmarks/allreduce_bench.py --quick    # 4 KB .. 4 MB, seconds

busbw = 2(n-1)/n * bytes / seconds (NCCL-tests' definition): for 2 ranks it equals the
algorithm bandwidth, and it is what to hold against the TCP loopback ceiling. Writes
benchmarks/results/allreduce[_quick].json and .png. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    WORKERS,
    Row,
    check,
    finish,
    hvd_launch,
    new_figure,
    read_json,
    torchrun,
)

NAME = "allreduce"
KB, MB = 1024, 1024 * 1024
FULL_SIZES = [4 * KB * 4**i for i in range(9)]  # 4 KB .. 256 MB
QUICK_SIZES = [4 * KB, 256 * KB, 4 * MB]
# One fresh Horovod job each (a missing key: its default, cycle 1 ms / fusion 128 MB); the
# first is the reference the others are held against. Quick mode runs the first two.
KNOBS = [{}, {"cycle_time_ms": 0.1}, {"cycle_time_ms": 5}, {"fusion_threshold_mb": 0}]
KNOB_VARIABLES = {"cycle_time_ms": ("HOROVOD_CYCLE_TIME", lambda v: f"{v:g}"),
                  "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", lambda v: str(int(v * MB)))}


def knob_label(setting: dict) -> str:
    parts = []
    if "cycle_time_ms" in setting:
        parts.append(f"cycle {setting['cycle_time_ms']:g} ms")
    if "fusion_threshold_mb" in setting:
        parts.append(f"fusion {setting['fusion_threshold_mb']:g} MB")
    return ", ".join(parts) or "defaults"


def memcpy_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes/s of numpy copying one buffer into another (best of `repeat`)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def tcp_loopback_bandwidth(nbytes: int, chunk: int = 4 * MB) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (sender thread -> receiver), the link that
    both Gloo backends use between local ranks."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytes(chunk))

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            sent = 0
            while sent < nbytes:
                s.sendall(payload[: min(chunk, nbytes - sent)])
                sent += chunk

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    conn, _ = server.accept()
    buf = bytearray(chunk)
    received, start = 0, time.perf_counter()
    with conn:
        while received < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            received += n
    seconds = time.perf_counter() - start
    sender.join(timeout=10)
    server.close()
    return received / seconds


def at(rows: list[dict], size: int) -> dict:
    return next(r for r in rows if r["bytes"] == size)


def human(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def build_rows(hvd: dict, gloo: dict, ceiling: dict, sizes: list[int]) -> list[Row]:
    rows = []
    for size in sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]}):
        h, g = at(hvd["fp32"], size), at(gloo["fp32"], size)
        rows.append(Row(NAME, f"busbw {human(size)}", h["busbw"] / 1e9, "GB/s",
                        "torch gloo", g["busbw"] / 1e9))
    big = sizes[-1]
    h32, h16 = at(hvd["fp32"], big), at(hvd["fp16"], big)
    rows.append(Row(NAME, f"fp16-compressed busbw {human(big)}", h16["busbw"] / 1e9, "GB/s",
                    "hvd fp32", h32["busbw"] / 1e9,
                    note="effective: fp32 bytes / time"))
    small = hvd["small"]
    label = f"{small['count']}x{human(small['bytes'])} round"
    # Ratios of times are "how much faster": peer time / our time, so > 1 is better.
    rows.append(Row(NAME, f"fusion speed-up, {label}", small["fused_s"] * 1e3, "ms",
                    "hvd fusion off", small["unfused_s"] * 1e3,
                    ratio=small["unfused_s"] / small["fused_s"]))
    rows.append(Row(NAME, f"hvd fused vs gloo, {label}", small["fused_s"] * 1e3, "ms",
                    "torch gloo", gloo["small"]["unfused_s"] * 1e3,
                    ratio=gloo["small"]["unfused_s"] / small["fused_s"]))
    rows += knob_rows(hvd.get("knobs", []), gloo, small)
    rows.append(Row(NAME, f"busbw {human(big)} / TCP loopback", h32["busbw"] / 1e9, "GB/s",
                    "127.0.0.1 TCP", ceiling["tcp_loopback"] / 1e9))
    rows.append(Row(NAME, "TCP loopback / memcpy", ceiling["tcp_loopback"] / 1e9, "GB/s",
                    "numpy memcpy", ceiling["memcpy"] / 1e9))
    return rows


def knob_rows(knobs: list[dict], gloo: dict, small: dict) -> list[Row]:
    """Per cycle time / fusion setting: busbw at the smallest and largest size against torch
    gloo (the note: against Horovod's defaults measured in the same phase), and the many-small
    round against the defaults."""
    if not knobs:
        return []
    default = knobs[0]  # KNOBS[0]: {}
    rows = []
    for setting in knobs[1:]:
        name = knob_label(setting)
        for r, d in zip(setting["fp32"], default["fp32"], strict=True):
            g = at(gloo["fp32"], r["bytes"])
            rows.append(Row(NAME, f"busbw {human(r['bytes'])}, hvd {name}", r["busbw"] / 1e9,
                            "GB/s", "torch gloo", g["busbw"] / 1e9,
                            note=f"{r['busbw'] / d['busbw']:.2f}x hvd defaults"))
        rows.append(Row(NAME, f"{small['count']}x{human(small['bytes'])} round, hvd {name}",
                        setting["small_s"] * 1e3, "ms", "hvd defaults",
                        default["small_s"] * 1e3, ratio=default["small_s"] / setting["small_s"]))
    return rows


def plot(hvd: dict, gloo: dict, ceiling: dict):
    fig, (ax,) = new_figure(width=7.5, height=4.5)
    for label, rows, style in (("Horovod fp32", hvd["fp32"], "o-"),
                               ("Horovod fp16 compression (effective)", hvd["fp16"], "s--"),
                               ("torch.distributed gloo", gloo["fp32"], "^-")):
        ax.plot([r["bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], style, label=label)
    ax.axhline(ceiling["tcp_loopback"] / 1e9, color="grey", ls=":",
               label="TCP loopback (1 stream)")
    ax.axhline(ceiling["memcpy"] / 1e9, color="black", ls=":", label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"allreduce, {hvd['ranks']} ranks on localhost")
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=None, help="per launch (s)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    timeout = args.timeout or (90 if args.quick else 300)
    budget = 2e7 if args.quick else 1e9
    worker_args = ["--sizes", ",".join(map(str, sizes)), "--budget-bytes", str(budget),
                   "--small-rounds", "5" if args.quick else "30"]
    knob_args = ["--sizes", f"{sizes[0]},{sizes[-1]}", "--budget-bytes", str(budget),
                 "--small-rounds", "5" if args.quick else "30", "--knob-run"]

    with tempfile.TemporaryDirectory(prefix="ringfeed-allreduce-") as tmp:
        out_h, out_g = Path(tmp) / "hvd.json", Path(tmp) / "gloo.json"
        check(hvd_launch(args.ranks, WORKERS / "allreduce_hvd.py", [*worker_args, "--out",
                         str(out_h)], timeout), "horovodrun allreduce_hvd.py")
        out_u = Path(tmp) / "hvd-unfused.json"  # fusion off: a fresh job (see the worker)
        check(hvd_launch(args.ranks, WORKERS / "allreduce_hvd.py",
                         [*worker_args, "--small-only", "--out", str(out_u)], timeout,
                         HOROVOD_FUSION_THRESHOLD="0"), "horovodrun allreduce_hvd.py --small-only")
        check(torchrun(args.ranks, WORKERS / "allreduce_gloo.py", [*worker_args, "--out",
                       str(out_g)], timeout), "torchrun allreduce_gloo.py")
        hvd, gloo = read_json(out_h), read_json(out_g)
        hvd["small"]["unfused_s"] = read_json(out_u)["small_s"]
        hvd["knobs"] = []
        for i, setting in enumerate(KNOBS[:2] if args.quick else KNOBS):
            env = {var: fmt(setting[key]) for key, (var, fmt) in KNOB_VARIABLES.items()
                   if key in setting}
            out_k = Path(tmp) / f"knob{i}.json"
            check(hvd_launch(args.ranks, WORKERS / "allreduce_hvd.py",
                             [*knob_args, "--out", str(out_k)], timeout, **env),
                  f"horovodrun allreduce_hvd.py --knob-run ({knob_label(setting)})")
            hvd["knobs"].append({**setting, **read_json(out_k)})
    big = sizes[-1]
    ceiling = {"memcpy": memcpy_bandwidth(big, 3 if args.quick else 5),
               "tcp_loopback": tcp_loopback_bandwidth(max(big, 64 * MB))}
    rows = build_rows(hvd, gloo, ceiling, sizes)
    data = {"horovod": hvd, "gloo": gloo, "ceiling_bytes_per_s": ceiling, "sizes": sizes}
    return finish(NAME, args.quick, args.results, rows, data, plot(hvd, gloo, ceiling))


if __name__ == "__main__":
    main()
