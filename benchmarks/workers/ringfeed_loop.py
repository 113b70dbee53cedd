"""`ringfeed train`'s own loop on one in-memory batch: the trainer (train/loop.py), its real
backend, logger, signal handling and per-step agreement, fed the first batch of the real
loader over and over, so that reading and decoding are out of the picture. Set against the
minimal loops (hvd_torch_loop.py, hvd_tf_loop.py) it isolates the loop's own per-step cost.
Rank 0 writes --out; with --profile it also writes a cProfile of the timed steps there.

    horovodrun -np 2 python benchmarks/workers/ringfeed_loop.py --framework torch \\
        --shards SHARD_DIR --run-dir DIR --out OUT.json [--profile OUT.prof] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from peer import parse_args, report

from ringfeed.train.config import DataSection, RunConfig
from ringfeed.train.loop import SignalRequests, Trainer


class InMemoryTrainer(Trainer):
    """The trainer, except that its loader repeats one real batch, and every step's end is
    time-stamped (the whole step: the loop's logging and bookkeeping included)."""

    profile: Path | None = None
    warmup = 0

    def train(self, signals: SignalRequests) -> bool:
        feed = self.feed
        loader = self.backend.loader(feed.train_pipe)
        iterator = iter(loader)
        batch = next(iterator)
        del iterator
        if hasattr(loader, "close"):
            loader.close()
        feed.train_pipe.close()

        class Repeat:
            def __iter__(self):
                while True:
                    yield batch

        feed.loader, feed.val_loader = Repeat(), None
        self.ends: list[float] = []
        return super().train(signals)

    def step(self, micro, waited, signals) -> bool:
        if len(self.ends) == self.warmup and self.profile is not None and self.dist.is_root:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()
        stop = super().step(micro, waited, signals)
        self.ends.append(time.perf_counter())
        if self.state.step >= self.feed.total_steps and getattr(self, "_profiler", None):
            self._profiler.disable()  # the final checkpoint and summary are not steps
        return stop


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--framework", default="torch", choices=["torch", "tensorflow"])
    extra.add_argument("--shards", type=Path, required=True, help="image shards (manifest.json)")
    extra.add_argument("--run-dir", type=Path, required=True, help="the run's output.dir")
    extra.add_argument("--log-every", type=int, default=None, help="default: --warmup")
    extra.add_argument("--profile", type=Path, default=None, help="cProfile of rank 0's steps")
    extra.add_argument("--compile", action="store_true", help="train.compile: true (torch)")
    own, rest = extra.parse_known_args()
    args = parse_args(rest)
    data = {"train": str(own.shards), "val_split": None, "batch_size": args.batch,
            "num_workers": 0}
    if "decoded_cache" in DataSection.model_fields:  # (absent from older trainers)
        data["decoded_cache"] = False  # only one batch is read
    cfg = RunConfig.model_validate({
        "framework": own.framework,
        "model": {"name": args.model,
                  "args": {"width": args.width} if args.model == "cnn" else {}},
        "data": data,
        "optim": {"name": "sgd", "lr": args.lr, "momentum": 0.9},
        "train": {"max_steps": args.warmup + args.steps, "seed": 0, "compile": own.compile,
                  "log_every": own.log_every or args.warmup},
        "output": {"dir": str(own.run_dir), "tensorboard": False},
    })
    trainer = InMemoryTrainer(cfg)
    trainer.warmup, trainer.profile = args.warmup, own.profile
    code = trainer.run()
    if trainer.dist.is_root:
        if own.profile is not None:
            trainer._profiler.dump_stats(own.profile)
        ends = trainer.ends
        times = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:], strict=False)]
        report(args, trainer.dist.size, times, ends[-1] - ends[args.warmup - 1],
               trainer.reporter.recent_losses[-1], peer=f"ringfeed {own.framework} (in-memory batch)")
    sys.exit(code)


if __name__ == "__main__":
    main()
