"""NVIDIA DALI's CPU pipeline as one contender of benchmarks/augment_bench.py, in the peers'
venv (benchmarks/.peers-venv, made by benchmarks/peers/setup.sh), pinned to one CPU.

The pipeline of DALI's ResNet-50 example, on the CPU (`device_id=None`, `num_threads=1`):
`fn.readers.file` over an image folder (shuffled), `fn.decoders.image_random_crop` (decodes
only the random crop's region; torchvision's area 0.08-1 and ratio 3/4-4/3, 10 attempts),
`fn.resize` to size x size (linear, antialiased), `fn.flip` by a coin flip, to uint8 NHWC
batches made into one numpy array each.

It runs synchronously (`exec_async=False, exec_pipelined=False`): a batch is computed when
`run()` asks for it, so no work happens outside a timed pass (the bench interleaves contenders
on the same CPU; DALI's prefetch would compute batches while another contender is timed). On
one CPU prefetching adds no throughput.

Protocol (one JSON object a line): after building, prints {"ready": ...}; then for each line
"run" on stdin, one pass of --images images and {"images": n, "seconds": s}; "quit" or EOF
ends it.

    python dali_worker.py --root IMAGES --images N [--batch 64] [--size 224] [--cpu K]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build(root: str, batch: int, size: int, seed: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, seed=seed,
                  exec_async=False, exec_pipelined=False)
    def augment():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True,
                                        initial_fill=1024, name="Reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3],
                                               num_attempts=10)
        images = fn.resize(images, resize_x=size, resize_y=size,
                           interp_type=types.INTERP_LINEAR, antialias=True)
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
        return images, labels

    pipe = augment()
    pipe.build()
    return pipe


def one_pass(pipe, batches: int) -> dict:
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        images, _labels = pipe.run()
        array = images.as_array()          # uint8 NHWC, one array per batch
        n += array.shape[0]
    seconds = time.perf_counter() - start
    if array.dtype.name != "uint8" or array.ndim != 4 or array.shape[3] != 3:
        raise SystemExit(f"DALI gave {array.dtype} {array.shape}, not uint8 NHWC RGB")
    return {"images": n, "seconds": seconds, "rate": n / seconds, "shape": list(array.shape)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--images", type=int, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--cpu", type=int, help="pin to this CPU")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import nvidia.dali

    pipe = build(args.root, args.batch, args.size, args.seed)
    one_pass(pipe, 2)                      # warm-up: allocations, page cache
    print(json.dumps({"ready": True, "version": nvidia.dali.__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(json.dumps(one_pass(pipe, args.images // args.batch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
