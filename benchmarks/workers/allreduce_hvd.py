"""Horovod allreduce under `horovodrun -np N --gloo`: fp32 and fp16-compressed bus bandwidth
per tensor size, and many small tensors with tensor fusion on (default threshold).
--small-only: only the many-small round (the launch sets HOROVOD_FUSION_THRESHOLD=0 for the
fusion-off figure); --knob-run: only the fp32 sweep and the many-small round, under whatever
HOROVOD_CYCLE_TIME / HOROVOD_FUSION_THRESHOLD the launch sets. One fresh job per setting:
re-initialising Horovod in one process (shutdown, init) crashed it here now and then (SIGABRT
under load, or a segfault after another cycle time). Rank 0 writes --out."""

from __future__ import annotations

import os

import horovod.torch as hvd
import torch
from collective import parse_args, sweep, timed, write


def many_small(count: int, nbytes: int, rounds: int) -> float:
    """Seconds per round of `count` async allreduces of `nbytes` each (what a backward pass
    issues, one per gradient), all in flight together, then waited for."""
    tensors = [torch.ones(nbytes // 4) for _ in range(count)]

    def round_() -> None:
        handles = [hvd.allreduce_async(t, name=f"small.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)

    return timed(round_, rounds, hvd.barrier)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()

    def reducer(compression):
        def make(size: int):
            t = torch.ones(size // 4)
            return lambda: hvd.allreduce(t, name="sweep", compression=compression)
        return make

    if args.small_only:
        small_s = many_small(args.small_count, args.small_bytes, args.small_rounds)
        if hvd.rank() == 0:
            write(args.out, {"ranks": n, "small_s": small_s})
        hvd.shutdown()
        return
    fp32 = sweep(args.sizes, args.budget_bytes, n, reducer(hvd.Compression.none), hvd.barrier)
    if args.knob_run:
        result = {"ranks": n, "fp32": fp32, "small_s": many_small(
            args.small_count, args.small_bytes, args.small_rounds)}
        if hvd.rank() == 0:
            write(args.out, result)
        hvd.shutdown()
        return
    result = {
        "ranks": n,
        "fp32": fp32,
        "fp16": sweep(args.sizes, args.budget_bytes, n, reducer(hvd.Compression.fp16),
                      hvd.barrier),
        "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD", "default (128 MB)"),
        "small": {"count": args.small_count, "bytes": args.small_bytes},
    }
    result["small"]["fused_s"] = many_small(args.small_count, args.small_bytes, args.small_rounds)
    if hvd.rank() == 0:
        write(args.out, result)
    hvd.shutdown()


if __name__ == "__main__":
    main()
