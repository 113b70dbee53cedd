"""The remote checkpoint drill (issue 38): kill -9 at random points of 20 checkpoint writes to
S3 (moto's server on 127.0.0.1), half of them synchronous, half in the background
(`checkpoint.async`); after each, `--resume auto` must find the previous complete checkpoint
and the run must end bit-identical to an uninterrupted one. Not part of `make bench`.

    .venv/bin/python benchmarks/checkpoint_drill.py [--reps 20] [--seed 38]

A kill point is a byte budget (train/resilience/faults.py
`kill-in-checkpoint-write:<step>:<bytes>`) over the bytes the write puts out, staged locally
then uploaded: drawn uniformly over that whole range, plus, one time in five, "after every
object but meta.json". The training runs are forked children of this process
(tests/fault_util.py): the real CLI, trainer, store and SIGKILL. Results:
benchmarks/results/checkpoint_drill.json.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, machine, save_json

sys.path.insert(0, str(REPO / "tests"))

from fault_util import assert_same_torch_state, ringfeed_forked, torch_final  # noqa: E402
from s3_proxy import start_moto  # noqa: E402
from train_util import toy_config, write_config, write_toy_shards  # noqa: E402

STEPS, EVERY = 8, 2


def config(work: Path, shards: Path, name: str, checkpoint: dict) -> Path:
    sections = {"model": {"name": "mlp", "args": {"num_classes": 3, "hidden": [512, 512]}},
                "data": {"batch_size": 4, "val_split": None},
                "train": {"max_steps": STEPS, "log_every": 1},
                "checkpoint": {"every_steps": EVERY, "keep": 2, **checkpoint},
                "output": {"dir": str(work / name), "tensorboard": False}}
    return write_config(work / f"{name}.yaml", **toy_config(shards, work / name, **sections))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ringfeed-checkpoint-drill"))
    args = parser.parse_args()
    import shutil

    import s3fs
    import torch

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    server, endpoint = start_moto()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("drill")
    shards = write_toy_shards(args.work / "shards", n_train=96, n_val=8)
    ref = ringfeed_forked(["train", config(args.work, shards, "ref", {})],
                          args.work / "ref.log", timeout=300)
    assert ref.code == 0, ref.output[-3000:]
    reference = torch_final(args.work / "ref", STEPS)
    ckpt = args.work / "ref" / "checkpoints" / f"ckpt-{STEPS:09d}"
    state, meta = (ckpt / "state.pt").stat().st_size, (ckpt / "meta.json").stat().st_size
    out_bytes = 2 * state + meta + 300  # staged (state.pt, meta.json), then state.pt uploaded
    rng = random.Random(args.seed)
    reps = []
    try:
        for i in range(args.reps):
            asynchronous = i % 2 == 1
            step = rng.choice([4, 6])
            budget = 10**9 if rng.random() < 0.2 else rng.randrange(0, out_bytes)
            # (state.pt goes up in one PUT: a budget inside its upload kills once it is up)
            phase = ("staging state.pt" if budget < state else "staging meta.json"
                     if budget < state + meta else "state.pt uploaded" if budget < 10**9
                     else "before meta.json's upload")
            url = f"s3://drill/rep{i}"
            cfg = config(args.work, shards, f"rep{i}", {"dir": url, "storage_options": options,
                                                        "async": asynchronous})
            started = time.monotonic()
            killed = ringfeed_forked(["train", cfg], args.work / f"rep{i}-killed.log",
                                     env={"RINGFEED_FAULT": f"kill-in-checkpoint-write:"
                                                            f"{step}:{budget}"}, timeout=300)
            resumed = ringfeed_forked(["train", cfg, "--resume", "auto"],
                                      args.work / f"rep{i}-resumed.log", timeout=300)
            found = re.search(r"resumed from (\S+) at step (\d+)", resumed.output)
            at = int(found.group(2)) if found else None
            identical = False
            if resumed.code == 0:
                data = fs.cat_file(f"drill/rep{i}/ckpt-{STEPS:09d}/state.pt")
                final = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                try:
                    assert_same_torch_state(reference, final)
                    identical = True
                except AssertionError:
                    identical = False
            rep = {"rep": i, "async": asynchronous, "step": step, "budget": budget,
                   "phase": phase, "killed_code": killed.code, "resumed_code": resumed.code,
                   "resumed_at": at, "expected_at": step - EVERY, "bit_identical": identical,
                   "removed_incomplete": "removed incomplete checkpoint" in resumed.output,
                   "seconds": time.monotonic() - started}
            reps.append(rep)
            print(rep, flush=True)
    finally:
        server.stop()
    ok = all(r["killed_code"] == -9 and r["resumed_code"] == 0 and
             r["resumed_at"] == r["expected_at"] and r["bit_identical"] for r in reps)
    print(f"{sum(r['bit_identical'] for r in reps)}/{len(reps)} bit-identical; all as expected: "
          f"{ok}")
    print(save_json(RESULTS, "checkpoint_drill", {"machine": machine(), "reps": reps,
                                                  "all_ok": ok, "seed": args.seed}))


if __name__ == "__main__":
    main()
