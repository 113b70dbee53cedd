"""Storage outage drill: a 2-rank torch job trains from moto's S3 server through the fault proxy
(tests/s3_proxy.py) while the proxy resets every connection for `--outage` seconds mid-epoch;
the final weights are compared, bit for bit, with the same job read from local disk.

    python benchmarks/outage_drill.py --outage 30      # and --outage 300 for five minutes

Prints the outage, how long the job took against the reference, the `storage:` lines the ranks
logged, and whether the weights are identical. Not part of `make bench` (it waits out the
outage); the suite runs a 5 s version (tests/test_storage_faults.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fault_util import logged_step, torch_final, wait_for  # noqa: E402
from helpers import BIN, horovodrun, test_env  # noqa: E402
from s3_proxy import AWS_ENV, FaultProxy, host_port, start_moto  # noqa: E402
from train_util import finish, start, toy_config, write_config, write_toy_shards  # noqa: E402

STEPS = 60


def config(root: Path, name: str, source: str, storage: dict) -> Path:
    sections = {"data": {"batch_size": 4, "num_workers": 1, "val_split": None,
                         "cache_dir": str(root / f"{name}-cache"), "prefetch": 1,
                         "shuffle_buffer": 8, "storage_options": storage},
                "train": {"epochs": 1, "log_every": 1},
                "checkpoint": {"every_steps": 3, "keep": 3},
                "output": {"dir": str(root / name), "tensorboard": False}}
    return write_config(root / f"{name}.yaml", **toy_config(source, root / name, **sections))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=30.0, help="seconds of resets")
    parser.add_argument("--mode", default="reset", help="proxy mode (reset, stall, slowdown)")
    args = parser.parse_args()
    import s3fs
    import torch

    root = Path(tempfile.mkdtemp(prefix="ringfeed-outage-"))
    server, endpoint = start_moto()
    shards = write_toy_shards(root / "shards")
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    fs.mkdir("bucket")
    fs.put(str(shards) + "/", "bucket/toy/", recursive=True)
    t0 = time.monotonic()
    ref = horovodrun(2, [BIN / "ringfeed", "train", config(root, "ref", str(shards), {})],
                     timeout=600)
    ref_s = time.monotonic() - t0
    assert ref.returncode == 0, ref.output[-3000:]
    with FaultProxy(host_port(endpoint), bandwidth=60_000) as proxy:
        storage = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        cfg = config(root, "s3", "s3://bucket/toy", storage)
        t0 = time.monotonic()
        job = start([BIN / "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
                     BIN / "ringfeed", "train", cfg], env=test_env(**AWS_ENV))
        try:
            assert wait_for(lambda: logged_step(root / "s3") >= 2, timeout=300), "no step"
            at = logged_step(root / "s3")
            proxy.outage(args.mode, args.outage)
        finally:
            code, output = finish(job, timeout=args.outage + 900)
        job_s = time.monotonic() - t0
    server.stop()
    a, b = torch_final(root / "ref", STEPS), torch_final(root / "s3", STEPS)
    same = code == 0 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    print(f"outage: {args.mode} for {args.outage:.0f} s from step {at} of {STEPS}")
    print(f"job: exit {code}, {job_s:.1f} s (reference from local disk {ref_s:.1f} s)")
    for line in output.splitlines():
        if "storage:" in line or "ringfeed: " in line or "Traceback" in line:
            print("  " + line.strip()[:200])
    print(f"weights bit-identical to the reference: {same}; tracebacks: "
          f"{output.count('Traceback')}")
    print(f"(run directory: {root}; AWS variables: {','.join(AWS_ENV)}; pid {os.getpid()})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
