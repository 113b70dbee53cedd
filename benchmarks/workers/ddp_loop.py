"""The same loop as hvd_torch_loop.py on torch DistributedDataParallel (gloo) under torchrun:
what a user would write without Horovod. Rank 0 writes --out."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peer import batch, model_args, model_input, parse_args, report, spec, time_steps
from torch.nn.parallel import DistributedDataParallel

from ringfeed.train.models import build_model


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        build_model("torch", args.model, model_args(args), spec(args)))  # broadcasts weights
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    images, labels = batch(args, rank)
    x_u8, y = torch.from_numpy(images), torch.from_numpy(labels)
    loss_box = [0.0]

    def step() -> None:
        x = model_input(x_u8.float().div_(255.0), args)
        optimizer.zero_grad()  # set_to_none: torch 2 default
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # bucketed gradient allreduce overlaps the backward pass
        optimizer.step()
        loss_box[0] = loss.item()

    times, wall = time_steps(step, args, dist.barrier)
    if rank == 0:
        report(args, size, times, wall, loss_box[0], peer="torch DDP (gloo)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
