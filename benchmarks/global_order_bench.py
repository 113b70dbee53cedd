"""What `order: global` costs against the rank order (issue 40): cold and warm epochs, shard
bytes read and downloaded per rank.

PNG shards (benchmarks/datasets.py) served over loopback HTTP (a child process, optionally
throttled per connection), or read in place (--local); N ranks of one epoch each, run one after the other in this process
(one core's worth of work each, so the times compare), each with its own empty cache directory:
  cold = epoch 0 with an empty cache (download, tar index reads, decode, decoded-cache fill),
  warm = epoch 0 again, by a new pipeline over that cache (gathered from the decoded cache).
Same per-rank batch in both orders (global: global_batch_size = N x batch, canonical_streams C).
An epoch's time is its slowest rank's (wall), and the ranks' CPU seconds summed (less noisy on a
shared machine). Prints one JSON object; does not assert.

    python benchmarks/global_order_bench.py [--local] [--rate BYTES_PER_S] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from pipeline_util import http_server_process  # noqa: E402

from benchmarks.datasets import image_shards  # noqa: E402
from ringfeed.pipeline import ShardPipeline  # noqa: E402


def one_rank(url: str, order: str, rank: int, ranks: int, batch: int, streams: int,
             cache: Path) -> dict[str, float]:
    options = ({"order": "global", "global_batch_size": batch * ranks,
                "canonical_streams": streams} if order == "global" else {"batch_size": batch})
    out: dict[str, float] = {}
    for name in ("cold", "warm"):  # the same epoch twice over one cache directory
        pipe = ShardPipeline(url, rank=rank, world_size=ranks, cache_dir=str(cache),
                             decoded_cache=True, shuffle_buffer=1000, seed=1, **options)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in pipe:
            pass
        out[f"{name}_s"] = time.perf_counter() - started
        out[f"{name}_cpu_s"] = time.process_time() - cpu  # (this process's threads)
        stats = pipe.stats()
        for key in ("bytes_read", "bytes_downloaded", "shards_opened"):
            out[f"{name}_{key}"] = stats[key]
        pipe.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=None, help="bytes/s per connection")
    parser.add_argument("--local", action="store_true", help="read the shard files in place")
    args = parser.parse_args()
    shards = image_shards(args.samples, args.per_shard)
    runs: dict[str, list[list[dict[str, float]]]] = {"rank": [], "global": []}
    with (contextlib.nullcontext(str(shards)) if args.local
          else http_server_process(shards, rate=args.rate)) as url, \
            tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for order in (("rank", "global") if repeat % 2 == 0 else ("global", "rank")):
                runs[order].append([
                    one_rank(url, order, r, args.ranks, args.batch, args.streams,
                             Path(tmp) / f"{order}-{repeat}-{r}") for r in range(args.ranks)])
    summary = {}
    for order, repeats in runs.items():
        summary[order] = {
            "cold_s": statistics.median(max(r["cold_s"] for r in ranks) for ranks in repeats),
            "warm_s": statistics.median(max(r["warm_s"] for r in ranks) for ranks in repeats),
            "cold_cpu_s": statistics.median(sum(r["cold_cpu_s"] for r in ranks)
                                            for ranks in repeats),
            "per_rank": repeats[0],
        }
    summary["cold_ratio"] = summary["global"]["cold_s"] / summary["rank"]["cold_s"]
    summary["warm_ratio"] = summary["global"]["warm_s"] / summary["rank"]["warm_s"]
    summary["cold_cpu_ratio"] = summary["global"]["cold_cpu_s"] / summary["rank"]["cold_cpu_s"]
    summary["setup"] = vars(args)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
