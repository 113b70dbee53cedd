"""A minimal hand-written Horovod PyTorch loop (pytorch_synthetic_benchmark.py style): the
built-in model, SGD in hvd.DistributedOptimizer, one in-memory batch, nothing else. The
baseline for `ringfeed train`'s per-step overhead. Rank 0 writes --out."""

from __future__ import annotations

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from peer import batch, model_args, model_input, parse_args, report, spec, time_steps

from ringfeed.train.models import build_model


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(0)
    model = build_model("torch", args.model, model_args(args), spec(args))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(), op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    images, labels = batch(args, hvd.rank())
    x_u8, y = torch.from_numpy(images), torch.from_numpy(labels)
    loss_box = [0.0]

    def step() -> None:
        # the trainer converts each uint8 batch the same way, and lays it out as the model takes
        x = model_input(x_u8.float().div_(255.0), args)
        optimizer.zero_grad()  # set_to_none: torch 2 default
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # waits for the gradient allreduce
        loss_box[0] = loss.item()

    times, wall = time_steps(step, args, hvd.barrier)
    if hvd.rank() == 0:
        report(args, hvd.size(), times, wall, loss_box[0], peer="horovod torch loop")
    hvd.shutdown()


if __name__ == "__main__":
    main()
