"""torch.distributed (gloo) allreduce under torchrun: the same sizes and many-small test as
allreduce_hvd.py, so the two compare line by line. Rank 0 writes --out."""

from __future__ import annotations

import torch
import torch.distributed as dist
from collective import parse_args, sweep, timed, write


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()

    def make(size: int):
        t = torch.ones(size // 4)
        return lambda: dist.all_reduce(t)

    result = {"ranks": n, "fp32": sweep(args.sizes, args.budget_bytes, n, make, dist.barrier)}
    tensors = [torch.ones(args.small_bytes // 4) for _ in range(args.small_count)]

    def round_() -> None:  # all in flight, then waited for: gloo's best without bucketing
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    result["small"] = {"count": args.small_count, "bytes": args.small_bytes,
                       "unfused_s": timed(round_, args.small_rounds, dist.barrier)}
    if dist.get_rank() == 0:
        write(args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
