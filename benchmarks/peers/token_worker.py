"""One contender of benchmarks/token_bench.py in its own process: write LitData's token chunks
of a token stream, or read token windows (ringfeed's flat token shards or LitData's chunks)
for whole epochs with the tool's own loader, and report tokens/s.

LitData runs in the peers' venv (benchmarks/.peers-venv, peers/setup.sh); ringfeed in the
repository's .venv. Prints one JSON line (the last line of stdout).

    python token_worker.py prepare --stream S.npy --starts D.npy --out DIR --chunk-tokens N
    python token_worker.py read --tool ringfeed|litdata --data DIR --seq-len 1024 \\
        [--batch 8] [--workers 2] [--epochs 2]

prepare: `litdata.optimize` with `item_loader=TokensLoader()`, one item per document (the
stream's tokens from each start to the next, in the stream's dtype), as LitData's
tokenized-corpus recipe does; chunks of `--chunk-tokens` tokens.
read: ringfeed's `ShardPipeline` with `seq_len` + `make_loader`; LitData's `StreamingDataset`
with `TokensLoader(block_size=seq_len + 1)` + `StreamingDataLoader`. Both shuffled (seed 0),
`--workers` loader processes, batches of `--batch` windows of seq_len + 1 tokens; tokens count
as windows x seq_len (the tokens a step trains on).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np


def prepare(stream_path: Path, starts_path: Path, out: Path, chunk_tokens: int,
            workers: int) -> dict:
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    starts = np.load(starts_path)
    bounds = [(int(a), int(b)) for a, b in zip(starts, [*starts[1:], -1], strict=True)]
    per_task = -(-len(bounds) // (4 * workers))  # a few tasks a worker, documents in order
    inputs = [(str(stream_path), bounds[i:i + per_task])
              for i in range(0, len(bounds), per_task)]
    start = time.perf_counter()
    litdata.optimize(fn=_documents, inputs=inputs, output_dir=str(out),
                     chunk_size=chunk_tokens, item_loader=TokensLoader(),
                     num_workers=workers, mode="overwrite", start_method="fork")
    seconds = time.perf_counter() - start
    files = [p for p in out.rglob("*") if p.is_file()]
    return {"tool": "litdata", "seconds": seconds, "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def _documents(task: tuple[str, list[tuple[int, int]]]) -> Iterator[np.ndarray]:
    """LitData's optimize fn: each document of the task as its own array of tokens."""
    path, bounds = task
    stream = np.load(path, mmap_mode="r")
    for lo, hi in bounds:
        yield np.array(stream[lo:hi if hi >= 0 else len(stream)])


def make_loader(tool: str, data: str, seq_len: int, batch: int, workers: int
                ) -> tuple[Iterable[Any], Callable[[Any], Any]]:
    """An iterable of batches (a tensor of windows, or ringfeed's batch dict), one epoch per
    iteration, and how to take the windows out of a batch."""
    if tool == "ringfeed":
        from ringfeed.pipeline import ShardPipeline
        from ringfeed.pipeline.torch import make_loader as rf_loader

        pipe = ShardPipeline(data, batch_size=batch, num_workers=workers, seed=0,
                             seq_len=seq_len)
        loader = rf_loader(pipe)
        key = next(k for k in pipe.example_batch() if k.startswith("tokens"))

        def windows(b: dict[str, Any]) -> Any:
            return b[key][b["__valid__"]]
        return loader, windows
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    dataset = litdata.StreamingDataset(data, item_loader=TokensLoader(block_size=seq_len + 1),
                                       shuffle=True, seed=0)
    loader = litdata.StreamingDataLoader(dataset, batch_size=batch, num_workers=workers,
                                         persistent_workers=workers > 0)
    return loader, lambda b: b


def read(args: argparse.Namespace) -> dict:
    import torch  # noqa: F401  (both loaders': not part of either's time)

    start = time.perf_counter()
    loader, windows = make_loader(args.tool, args.data, args.seq_len, args.batch, args.workers)
    out = {"tool": args.tool, "seq_len": args.seq_len, "build_s": time.perf_counter() - start,
           "epochs": []}
    for _ in range(args.epochs):
        count = 0
        t = time.perf_counter()
        for b in loader:
            w = windows(b)
            count += int(w.shape[0])
            assert w.shape[1] == args.seq_len + 1, w.shape
        seconds = time.perf_counter() - t
        out["epochs"].append({"seconds": seconds, "windows": count,
                              "tokens_per_s": count * args.seq_len / seconds})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "read"])
    parser.add_argument("--tool", default="litdata", choices=["ringfeed", "litdata"])
    parser.add_argument("--stream")
    parser.add_argument("--starts")
    parser.add_argument("--out")
    parser.add_argument("--chunk-tokens", type=int, default=1 << 22)
    parser.add_argument("--data")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        result = prepare(Path(args.stream), Path(args.starts), Path(args.out),
                         args.chunk_tokens, args.workers)
    else:
        result = read(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
