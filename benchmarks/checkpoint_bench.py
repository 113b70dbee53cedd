"""What a checkpoint costs training, written synchronously and with `checkpoint.async: true`,
to local disk and to S3 (moto's server on 127.0.0.1): the built-in gpt at 12 layers x 768 with
GPT-2's vocabulary (50,257; ~163M parameters) and AdamW on the CPU, one rank, `ringfeed train`
as shipped. Not part of `make bench` (minutes per run).

    .venv/bin/python benchmarks/checkpoint_bench.py [--repeat 3] [--quick]

Per run (a fresh `ringfeed train`, checkpoint every `--every` steps, `keep: 1`), read back from
what every run records: each checkpoint's seconds training was blocked and seconds its write
took (metrics.jsonl's checkpoint events), and each step's time (log_every: 1). A step of an
async run "ran during a write" when it started before that write ended (write start = the
step's record time + the save's blocked seconds). Runs are interleaved (repeat r: sync, then
async, per store; `--merge` adds another invocation's stores, e.g. S3 at a longer interval);
medians and min/max over all checkpoints and runs.

Goals (issue 38): async blocked <= 10% of sync blocked; steps during a write <= 1.2 x the
async run's other steps. Results: benchmarks/results/checkpoint_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import RESULTS, bench_env, free_port, machine, run, save_json

from ringfeed.fsutil import atomic_write_text

VOCAB = 50257  # GPT-2's: the 12 x 768 gpt is then GPT-2 small's size


class Gpt2Vocab:
    """A byte-level tokenizer (ids 0..255) that declares GPT-2's vocabulary size, so the
    model's embedding and output layers have GPT-2 small's shape (`--tokenizer
    checkpoint_bench:Gpt2Vocab`)."""

    vocab_size = VOCAB
    eos_id = VOCAB - 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def token_shards(work: Path, seq: int) -> Path:
    out = work / "tokens"
    if (out / "manifest.json").exists():
        return out
    (work / "text").mkdir(parents=True, exist_ok=True)
    words = " ".join(f"ringfeed checkpoint {i} of the benchmark" for i in range(4000))
    (work / "text" / "a.txt").write_text(words)
    res = run([Path(sys.executable).parent / "ringfeed", "shard", work / "text", out,
               "--format", "text", "--seq-len", str(seq + 1), "--no-progress",
               "--tokenizer", "checkpoint_bench:Gpt2Vocab"], timeout=300,
              env=bench_env(PYTHONPATH=f"{Path(__file__).parent}{os.pathsep}"
                                       f"{bench_env()['PYTHONPATH']}"))
    if res.returncode != 0:
        raise SystemExit(f"sharding failed: {res.output[-2000:]}")
    return out


def parameters(n_layer: int, d_model: int, seq: int) -> int:
    from ringfeed.train.models.torch_models import GPT

    model = GPT(VOCAB, seq, n_layer=n_layer, n_head=max(1, d_model // 64), d_model=d_model)
    return sum(p.numel() for p in model.parameters())


class Moto:
    """moto's S3 server in its own process (its work must not share the trainer's GIL)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
             str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing",
                        "secret": "testing"}
        import s3fs

        deadline = time.monotonic() + 60
        while True:
            try:
                s3fs.S3FileSystem(**self.options, skip_instance_cache=True).mkdir("bench")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_one(work: Path, name: str, shards: Path, args: argparse.Namespace, asynchronous: bool,
            storage: dict | None) -> dict[str, Any]:
    out = work / name
    checkpoint: dict[str, Any] = {"every_steps": args.every, "keep": 1, "async": asynchronous}
    if storage is not None:
        checkpoint.update(dir=f"s3://bench/{name}", storage_options=storage)
    cfg = {"framework": "torch",
           "model": {"name": "gpt", "args": {"n_layer": args.layers, "d_model": args.width,
                                             "n_head": max(1, args.width // 64)}},
           "data": {"train": str(shards), "batch_size": args.batch, "val_split": None,
                    "num_workers": 0},
           "optim": {"name": "adamw", "lr": 1e-4},
           "train": {"max_steps": args.steps, "log_every": 1},
           "checkpoint": checkpoint,
           "output": {"dir": str(out), "tensorboard": False}}
    path = work / f"{name}.yaml"
    atomic_write_text(path, json.dumps(cfg))
    env = bench_env(OMP_NUM_THREADS=str(os.cpu_count()), AWS_ACCESS_KEY_ID="testing",
                    AWS_SECRET_ACCESS_KEY="testing")
    res = run([Path(sys.executable).parent / "ringfeed", "train", path], timeout=args.timeout,
              env=env)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}): {res.output[-3000:]}")
    return measure(out, args.batch)


def measure(out: Path, batch: int) -> dict[str, Any]:
    """Per checkpoint: blocked and write seconds; per step: its seconds and whether a
    background write ran while it started."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}
    events = [r for r in records if r.get("event") == "checkpoint"]
    writes = []
    for e in events:
        start = steps[e["step"]]["time"] + e["blocked_s"]
        writes.append((start, start + e["write_s"]))
    rows = []
    for k, r in sorted(steps.items()):
        step_s = batch / r["samples_per_s"]
        started = r["time"] - step_s
        during = any(a - 0.05 <= started < b for a, b in writes)
        rows.append({"step": k, "step_s": step_s, "during_write": during})
    summary = json.loads((out / "summary.json").read_text())
    return {"checkpoints": [{k: e[k] for k in ("step", "blocked_s", "write_s")} for e in events],
            "steps": rows, "summary": {k: summary[k] for k in (
                "checkpoint_blocked_s", "checkpoint_write_s", "checkpoints_written")}}


def spread(values: list[float]) -> dict[str, float | int]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)} if values else {"median": None, "n": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ringfeed-checkpoint-bench"))
    parser.add_argument("--quick", action="store_true", help="a 2 x 128 gpt, 1 repeat")
    parser.add_argument("--merge", action="store_true",
                        help="add these stores' results to the existing results file")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.layers, args.width, args.steps, args.every = 1, 2, 128, 6, 2
    args.work.mkdir(parents=True, exist_ok=True)
    shards = token_shards(args.work, args.seq)
    stores = args.stores.split(",")
    moto = Moto() if "s3" in stores else None
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.repeat):
            for store in stores:
                for asynchronous in (False, True):
                    name = f"{store}-{'async' if asynchronous else 'sync'}-{r}"
                    started = time.monotonic()
                    result = run_one(args.work, name, shards, args, asynchronous,
                                     moto.options if store == "s3" else None)
                    runs.append({"name": name, "store": store, "async": asynchronous,
                                 "repeat": r, "wall_s": time.monotonic() - started, **result})
                    print(f"{name}: blocked "
                          f"{[round(c['blocked_s'], 2) for c in result['checkpoints']]} s, "
                          f"write {[round(c['write_s'], 2) for c in result['checkpoints']]} s",
                          flush=True)
    finally:
        if moto is not None:
            moto.stop()
    data: dict[str, Any] = {"machine": machine(), "model": {
        "name": "gpt", "n_layer": args.layers, "d_model": args.width, "vocab": VOCAB,
        "seq_len": args.seq, "parameters": parameters(args.layers, args.width, args.seq),
        "optimizer": "adamw", "batch": args.batch}, "runs": runs, "stores": {},
        "settings": {store: {"steps": args.steps, "every": args.every, "repeat": args.repeat}
                     for store in stores}}
    for store in stores:
        mine = [x for x in runs if x["store"] == store]
        sync_blocked = [c["blocked_s"] for x in mine if not x["async"] for c in x["checkpoints"]]
        async_runs = [x for x in mine if x["async"]]
        async_blocked = [c["blocked_s"] for x in async_runs for c in x["checkpoints"]]
        async_write = [c["write_s"] for x in async_runs for c in x["checkpoints"]]
        sync_write = [c["write_s"] for x in mine if not x["async"] for c in x["checkpoints"]]
        # step 1 is the warm-up; step times of the async runs, with and without a write
        during = [s["step_s"] for x in async_runs for s in x["steps"]
                  if s["step"] > 1 and s["during_write"]]
        quiet = [s["step_s"] for x in async_runs for s in x["steps"]
                 if s["step"] > 1 and not s["during_write"]]
        sync_steps = [s["step_s"] for x in mine if not x["async"] for s in x["steps"]
                      if s["step"] > 1]
        row = {"sync_blocked_s": spread(sync_blocked), "async_blocked_s": spread(async_blocked),
               "sync_write_s": spread(sync_write), "async_write_s": spread(async_write),
               "step_s_during_write": spread(during), "step_s_no_write": spread(quiet),
               "step_s_sync_runs": spread(sync_steps)}
        if sync_blocked and async_blocked:
            row["blocked_ratio"] = (statistics.median(async_blocked)
                                    / statistics.median(sync_blocked))
        if during and quiet:
            row["slowdown_during_write"] = statistics.median(during) / statistics.median(quiet)
        data["stores"][store] = row
        print(f"{store}: sync blocked {row['sync_blocked_s']}, async blocked "
              f"{row['async_blocked_s']}, ratio {row.get('blocked_ratio')}; steps during a "
              f"write {row['step_s_during_write']} vs none {row['step_s_no_write']}: "
              f"{row.get('slowdown_during_write')}", flush=True)
    stem = "checkpoint_bench_quick" if args.quick else "checkpoint_bench"
    earlier = RESULTS / f"{stem}.json"
    if args.merge and earlier.exists():  # (e.g. local and s3 run at different intervals)
        before = json.loads(earlier.read_text())
        data["runs"] = [x for x in before["runs"] if x["store"] not in stores] + runs
        data["stores"] = {**{k: v for k, v in before["stores"].items() if k not in stores},
                          **data["stores"]}
        data["settings"] = {**before.get("settings", {}), **data["settings"]}
    print(save_json(RESULTS, stem, data))


if __name__ == "__main__":
    main()
