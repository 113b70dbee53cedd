"""Bucket benchmark: ringfeed against MosaicML Streaming, LitData and webdataset, each with its
own writer and its own loader, on local disk and from S3 (moto) behind a shaped link.

1. Data: N 64x64 JPEGs (q90, 10 classes; benchmarks/pipeline_bench.py's `write_jpeg_folder`),
   one image folder, cached in the temp dir.
2. Preparation, timed, each tool in its own process: `ringfeed shard --format imagefolder`
   (.venv), webdataset `ShardWriter`, Streaming `MDSWriter`, LitData `optimize` (peers' venv,
   benchmarks/.peers-venv, made by benchmarks/peers/setup.sh). The same samples per shard for
   all (`--per-shard`; MDS limits shards by bytes: a limit computed for that count). Their
   outputs' bytes and files are recorded, then uploaded to moto's S3 server (a child process).
3. Reads: one process per contender and repeat (benchmarks/peers/peer_worker.py), batch 256,
   2 DataLoader workers, shuffled, every batch uint8 NHWC arrays: time to first batch (dataset
   construction included, library imports not), a cold epoch (empty caches) and a warm epoch
   (the same loader again: caches filled). Locally (the tool's files in place), and from S3
   through tests/s3_proxy.py's FaultProxy shaped to `--bandwidth` (50 MB/s, shared) and
   `--latency` (20 ms per new connection). The peers also read with ringfeed's JPEG decoder
   (pipeline/codecs.py: the tool's reader hands over the JPEG bytes), so I/O and decode can be
   told apart. Contenders are interleaved (a rotated round-robin per repeat); medians with min
   and max; ratios are peer time / ringfeed time (> 1: ringfeed faster).
4. Every epoch of every contender is checked: exactly N samples, and the multiset of (label,
   pixel sum) equal to the one decoded from the source images with PIL. A contender that loses
   or duplicates samples is a failure, printed.
5. The proxy's counters per epoch (connections, requests by method, bytes down) and its request
   log (when the first request and the first byte came, how many requests were in flight): the
   S3 profile of each reader.

Prints tables, writes benchmarks/results/bucket_bench[_quick].json. Does not assert.
    python benchmarks/bucket_bench.py [--quick] [--samples N] [--repeats R] [--where local,s3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))        # s3_proxy: moto helpers and the FaultProxy
sys.path.insert(0, str(REPO / "benchmarks"))   # common: rows, JSON output

PEERS = REPO / "benchmarks" / "peers"
WORKER = PEERS / "peer_worker.py"
PEERS_VENV = REPO / "benchmarks" / ".peers-venv"
BUCKET = "bench"

# (name, tool, decoder): the tool's own reader, and for the peers also with ringfeed's decoder
CONTENDERS = [
    ("ringfeed", "ringfeed", "own"),
    ("ringfeed.tar.gz", "ringfeed-gz", "own"),   # the same shards gzipped (level 1)
    ("webdataset", "wds", "own"),
    ("streaming", "mds", "own"),
    ("litdata", "litdata", "own"),
    ("webdataset+rfdec", "wds", "ringfeed"),
    ("streaming+rfdec", "mds", "ringfeed"),
    ("litdata+rfdec", "litdata", "ringfeed"),
]
TOOLS = ["ringfeed", "ringfeed-gz", "wds", "mds", "litdata"]
TOOL_NAMES = {"ringfeed": "ringfeed shard", "ringfeed-gz": "ringfeed shard + gzip -1",
              "wds": "webdataset ShardWriter",
              "mds": "Streaming MDSWriter", "litdata": "LitData optimize"}


def python_for(tool: str) -> str:
    return (sys.executable if tool.startswith("ringfeed")
            else str(PEERS_VENV / "bin" / "python"))


def setup_peers() -> None:
    out = subprocess.run(["bash", str(PEERS / "setup.sh")], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks/peers/setup.sh failed:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    print(out.stdout.strip().splitlines()[-1])


def images(samples: int) -> Path:
    """The JPEG image folder, made once per N in the temp dir."""
    from pipeline_bench import write_jpeg_folder

    path = Path(tempfile.gettempdir()) / "ringfeed-bench" / f"bucket-jpegs-{samples}x64"
    if not (path / ".done").exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        write_jpeg_folder(path, samples, 64)
        (path / ".done").write_text("")
    return path


def reference(src: Path) -> dict[str, Any]:
    """Samples and the (label, pixel sum) multiset digest of the source, decoded with PIL."""
    from PIL import Image

    keys = []
    for folder in sorted(src.iterdir()):
        if folder.is_dir():
            label = int(folder.name.removeprefix("class"))
            for p in folder.glob("*.jpg"):
                pixels = np.asarray(Image.open(p).convert("RGB"))
                keys.append(label * 10**9 + int(pixels.sum(dtype=np.int64)))
    keys = np.sort(np.array(keys, np.int64))
    return {"samples": len(keys), "digest": hashlib.sha256(keys.tobytes()).hexdigest()[:16]}


def worker_json(cmd: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in out.stdout.strip().splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited {out.returncode}: "
                           f"{(out.stderr or out.stdout).strip()[-1500:]}")
    return json.loads(lines[-1])


def prepare_all(src: Path, work: Path, per_shard: int, workers: int,
                tools: list[str]) -> dict[str, Any]:
    prepared = {}
    for tool in tools:
        out = work / "data" / tool
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        result = worker_json([python_for(tool), str(WORKER), "prepare", "--tool", tool,
                              "--src", str(src), "--out", str(out), "--per-shard",
                              str(per_shard), "--workers", str(workers)], timeout=3600)
        result["wall_s"] = time.perf_counter() - start   # with the process start and imports
        result["dir"] = str(out)
        prepared[tool] = result
        print(f"  prepared {TOOL_NAMES[tool]:24s} {result['seconds']:7.2f} s "
              f"(process {result['wall_s']:.1f} s), {result['bytes'] / 1e6:8.2f} MB in "
              f"{result['files']} files")
    return prepared


# -- S3: moto in a child process, uploads, the shaped proxy -----------------------------------
MOTO_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from s3_proxy import start_moto
server, url = start_moto()
print(url, flush=True)
sys.stdin.read()
server.stop()
"""


def start_moto_child() -> tuple[subprocess.Popen, str]:
    from s3_proxy import aws_test_env

    aws_test_env()
    proc = subprocess.Popen([sys.executable, "-c", MOTO_CHILD, str(REPO / "tests")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise RuntimeError("moto's server did not start")
    return proc, url


def upload(endpoint: str, prepared: dict[str, Any]) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    for tool, info in prepared.items():
        root = Path(info["dir"])
        start = time.perf_counter()
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            s3.upload_file(str(path), BUCKET, f"{tool}/{path.relative_to(root)}")
        info["upload_s"] = time.perf_counter() - start


# -- one read run -------------------------------------------------------------------------------
def profile(counts: dict[str, Any], log: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """What the proxy saw in one epoch: connections, requests, bytes, timing of the first
    request / first byte / first big object, and the most requests in flight at once."""
    out = {k: counts[k] for k in ("connections", "requests", "bytes_down", "bytes_up")}
    out["methods"] = counts["methods"]
    if log:
        first = min(r["t_request"] for r in log)
        firsts = [r["t_first_byte"] for r in log if r["t_first_byte"] is not None]
        big = [r for r in log if r["bytes"] > 256 * 1024]
        out["first_request_s"] = first - t0
        out["first_byte_s"] = (min(firsts) - t0) if firsts else None
        if big:
            b = min(big, key=lambda r: r["t_request"])
            out["first_big_request_s"] = b["t_request"] - t0
            out["first_big_done_s"] = (b["t_end"] or b["t_first_byte"]) - t0
            out["big_objects"] = len(big)
            out["big_bytes_mean"] = sum(r["bytes"] for r in big) / len(big)
        events = []
        for r in log:
            end = r["t_end"] or r["t_first_byte"] or r["t_request"]
            events += [(r["t_request"], 1), (end, -1)]
        level = peak = 0
        for _, step in sorted(events):
            level += step
            peak = max(peak, level)
        out["peak_in_flight"] = peak
        out["ranged_gets"] = sum(1 for r in log if r["method"] == "GET" and r["range"])

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 4)
        out["log"] = [{"conn": r["conn"], "method": r["method"],
                       "object": r["target"].split("?")[0], "range": r["range"],
                       "t_request": rel(r["t_request"]), "t_first_byte": rel(r["t_first_byte"]),
                       "t_end": rel(r["t_end"]), "bytes": r["bytes"]} for r in log]
    return out


def run_read(name: str, tool: str, decoder: str, data: str, cache: Path, args,
             proxy=None, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
             ) -> dict[str, Any]:
    """One reader process (peer_worker.py read; `extra`: more of its options, which win;
    `env`: more environment, e.g. a PYTHONPATH that puts another ringfeed first)."""
    cmd = [python_for(tool), str(WORKER), "read", "--tool", tool, "--decoder", decoder,
           "--data", data, "--cache", str(cache), "--batch", str(args.batch), "--workers",
           str(args.workers), "--epochs", "2", "--mark", *extra]
    if proxy is not None:
        cmd += ["--endpoint", proxy.url]
        proxy.reset_counters()
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    killer = threading.Timer(args.run_timeout, proc.kill)
    killer.start()
    profiles, result = [], None
    try:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "mark" in msg:
                if proxy is not None:
                    profiles.append(profile(proxy.counters(), proxy.request_log(), t0))
                    proxy.reset_counters()
                    t0 = time.monotonic()
                proc.stdin.write("\n")
                proc.stdin.flush()
            else:
                result = msg
        proc.wait()
    finally:
        killer.cancel()
    err = proc.stderr.read()
    shutil.rmtree(cache, ignore_errors=True)
    if result is None:
        return {"name": name, "error": f"exited {proc.returncode}: {err.strip()[-1200:]}"}
    for epoch, prof in zip(result["epochs"], profiles, strict=False):
        epoch["proxy"] = prof
    result["name"] = name
    return result


def check(result: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    if "error" in result:
        return [f"{result['name']}: {result['error'].splitlines()[-1] if result['error'] else ''}"]
    problems = []
    for i, e in enumerate(result["epochs"]):
        if e["samples"] != ref["samples"]:
            problems.append(f"{result['name']} epoch {i}: {e['samples']} samples, "
                            f"expected {ref['samples']}")
        elif e["digest"] != ref["digest"]:
            problems.append(f"{result['name']} epoch {i}: the (label, pixels) multiset differs "
                            "(samples lost and duplicated, or decoded differently)")
    return problems


# -- summary -------------------------------------------------------------------------------------
def stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for where in ("local", "s3"):
        for name, _, _ in CONTENDERS:
            mine = [r for r in runs if r["name"] == name and r["where"] == where
                    and "error" not in r]
            if not mine:
                continue
            key = f"{where}/{name}"
            out[key] = {
                "first_batch_s": stats([r["epochs"][0]["first_batch_s"] for r in mine]),
                "cold_s": stats([r["epochs"][0]["seconds"] for r in mine]),
                "warm_s": stats([r["epochs"][1]["seconds"] for r in mine]),
            }
            if where == "s3":
                cold = [r["epochs"][0].get("proxy", {}) for r in mine]
                warm = [r["epochs"][1].get("proxy", {}) for r in mine]
                out[key]["proxy_cold"] = {k: statistics.median(p[k] for p in cold if k in p)
                                          for k in cold[0] if k != "methods"
                                          and all(isinstance(p.get(k), (int, float))
                                                  for p in cold)}
                out[key]["proxy_cold"]["methods"] = cold[0].get("methods")
                out[key]["proxy_warm"] = {k: warm[0].get(k) for k in
                                          ("connections", "requests", "bytes_down")}
    return out


def fmt_stat(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def print_tables(summary: dict[str, Any], prepared: dict[str, Any]) -> None:
    print("\nPreparation (each tool's own writer, same samples per shard):")
    print(f"  {'tool':26s} {'seconds':>8s} {'MB':>9s} {'files':>6s} {'upload s':>9s}")
    for tool, p in prepared.items():
        print(f"  {TOOL_NAMES[tool]:26s} {p['seconds']:8.2f} {p['bytes'] / 1e6:9.2f} "
              f"{p['files']:6d} {p.get('upload_s', 0):9.2f}")
    print("\nReads (seconds: median [min-max]); proxy columns: the cold S3 epoch (in flight: "
          "most requests at once; 1st shard: s from the first request to the first shard-sized "
          "object received)")
    head = (f"  {'where/contender':26s} {'first batch':>20s} {'cold epoch':>20s} "
            f"{'warm epoch':>20s} {'conns':>6s} {'reqs':>6s} {'MB down':>8s} {'in flight':>9s}"
            f" {'1st shard':>10s}")
    print(head)
    for key, s in summary.items():
        p = s.get("proxy_cold", {})
        conns = f"{p['connections']:.0f}" if "connections" in p else "-"
        reqs = f"{p['requests']:.0f}" if "requests" in p else "-"
        mb = f"{p['bytes_down'] / 1e6:.1f}" if "bytes_down" in p else "-"
        peak = f"{p['peak_in_flight']:.0f}" if "peak_in_flight" in p else "-"
        fb = (f"{p['first_big_done_s'] - p['first_request_s']:.2f}"
              if p.get("first_big_done_s") is not None else "-")
        print(f"  {key:26s} {fmt_stat(s['first_batch_s']):>20s} {fmt_stat(s['cold_s']):>20s} "
              f"{fmt_stat(s['warm_s']):>20s} {conns:>6s} {reqs:>6s} {mb:>8s} {peak:>9s} "
              f"{fb:>10s}")


def rows_for(summary: dict[str, Any]):
    from common import Row

    rows = []
    for where in ("local", "s3"):
        ours = summary.get(f"{where}/ringfeed")
        for name, _, _ in CONTENDERS[1:]:
            theirs = summary.get(f"{where}/{name}")
            for metric, label in (("cold_s", "cold epoch"), ("warm_s", "warm epoch"),
                                  ("first_batch_s", "first batch")):
                if not ours or not theirs or not ours[metric] or not theirs[metric]:
                    continue
                value, peer = ours[metric]["median"], theirs[metric]["median"]
                rows.append(Row("bucket", f"{where} {label} (s), peer/ringfeed", value, "s",
                                peer=name, peer_value=peer, ratio=peer / value if value else None))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3,000 samples, 1 repeat")
    parser.add_argument("--samples", type=int)
    parser.add_argument("--per-shard", type=int, help="samples per shard/chunk (all tools)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=50e6, help="bytes/s (S3 link)")
    parser.add_argument("--latency", type=float, default=0.02, help="s per new connection")
    parser.add_argument("--where", default="local,s3")
    parser.add_argument("--only", help="contender names, comma-separated (ringfeed always)")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--no-setup", action="store_true", help="skip peers/setup.sh")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", help="results as bucket_bench_<tag>[_quick].json")
    args = parser.parse_args(argv)
    samples = args.samples or (3000 if args.quick else 20000)
    per_shard = args.per_shard or (500 if args.quick else 2000)
    repeats = args.repeats or (1 if args.quick else 3)
    wheres = [w for w in args.where.split(",") if w]
    contenders = CONTENDERS
    if args.only:
        wanted = {"ringfeed", *args.only.split(",")}
        contenders = [c for c in CONTENDERS if c[0] in wanted]

    from s3_proxy import FaultProxy, host_port

    if not args.no_setup:
        setup_peers()
    print(f"bucket_bench: {samples} JPEGs 64x64, {per_shard} per shard, {repeats} repeats, "
          f"batch {args.batch}, {args.workers} workers; S3 link {args.bandwidth / 1e6:g} MB/s, "
          f"{args.latency * 1e3:g} ms per connection")
    src = images(samples)
    ref = reference(src)
    work = Path(tempfile.mkdtemp(prefix="bucket-bench-"))
    moto = None
    failures: list[str] = []
    runs: list[dict[str, Any]] = []
    try:
        tools = [t for t in TOOLS if any(c[1] == t for c in contenders)]
        prepared = prepare_all(src, work, per_shard, args.workers, tools)
        proxy = None
        if "s3" in wheres:
            moto, endpoint = start_moto_child()
            upload(endpoint, prepared)
            proxy = FaultProxy(host_port(endpoint), bandwidth=args.bandwidth,
                               connect_latency_s=args.latency, log_requests=True).start()
        for rep in range(repeats):
            order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
            for where in wheres:
                for name, tool, decoder in order:
                    data = (prepared[tool]["dir"] if where == "local"
                            else f"s3://{BUCKET}/{tool}")
                    result = run_read(name, tool, decoder, data, work / f"cache-{name}", args,
                                      proxy if where == "s3" else None)
                    result["where"], result["repeat"] = where, rep
                    problems = check(result, ref)
                    failures += problems
                    if problems:
                        result["failed"] = problems
                        print("  FAILED:", "; ".join(problems))
                    if "error" not in result:
                        e0, e1 = result["epochs"]
                        extra = ""
                        if "proxy" in e0:
                            p = e0["proxy"]
                            extra = (f"  {p['connections']} conns {p['requests']} reqs "
                                     f"{p['bytes_down'] / 1e6:.1f} MB")
                        print(f"  {rep} {where:5s} {name:18s} first batch "
                              f"{e0['first_batch_s']:6.2f} s  cold {e0['seconds']:6.2f} s  "
                              f"warm {e1['seconds']:6.2f} s{extra}", flush=True)
                    runs.append(result)
        if proxy is not None:
            proxy.stop()
    finally:
        if moto is not None:
            moto.stdin.close()
            try:
                moto.wait(10)
            except subprocess.TimeoutExpired:
                moto.kill()
        shutil.rmtree(work, ignore_errors=True)

    from common import finish

    summary = summarize(runs)
    print_tables(summary, prepared)
    if failures:
        print("\nFAILURES (samples lost, duplicated or wrong):")
        for f in failures:
            print("  " + f)
    else:
        print(f"\nevery epoch of every contender: {ref['samples']} samples, the source's "
              "(label, pixels) multiset")
    rows = rows_for(summary)
    data = {"samples": samples, "per_shard": per_shard, "repeats": repeats,
            "batch": args.batch, "workers": args.workers, "bandwidth": args.bandwidth,
            "latency_s": args.latency, "reference": ref, "prepared": prepared,
            "summary": summary, "failures": failures, "runs": runs,
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}
    print()
    name = f"bucket_bench_{args.tag}" if args.tag else "bucket_bench"
    return finish(name, args.quick, args.results, rows, data)


if __name__ == "__main__":
    main()
