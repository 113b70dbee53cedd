"""A short real Horovod torch training run for tests/test_multinode.py (one process per host).

Each rank starts from its own random weights, takes rank 0's by broadcast, then runs a few SGD
steps of a linear model on its half of each global batch of a synthetic regression set, with
hvd.DistributedOptimizer averaging the gradients. It writes OUT/rank{r}.json with: where it ran
(eth0's IPv4 address and its network-namespace id), what every rank reported (allgathered, so it
crossed the hosts), its final weights, and on rank 0 the same run done in one process on the full
batches without Horovod, which the distributed weights must match.

Usage: python multinode_worker.py OUT_DIR [--steps N] [--iface eth0]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
from pathlib import Path

import torch

FEATURES = 8
GLOBAL_BATCH = 16
LR = 0.1
SIOCGIFADDR = 0x8915  # <linux/sockios.h>


def iface_ipv4(name: str) -> str:
    """IPv4 address of interface `name` in this process's network namespace (no traffic sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def synthetic_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank (fixed seed), float64 so sums compare tightly."""
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
    batches = []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g, dtype=torch.float64)
        batches.append((x, x @ w_true + 0.01 * torch.randn(GLOBAL_BATCH, 1, generator=g, dtype=torch.float64)))
    return batches


def new_model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, 1).double()


def flat_weights(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def sgd(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--iface", default="eth0")
    args = parser.parse_args()

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    where = {"address": iface_ipv4(args.iface), "netns": os.readlink("/proc/self/ns/net"),
             "rank": rank}
    everyone = hvd.allgather_object(where)

    model = new_model(seed=100 + rank)  # differs per rank until the broadcast
    initial_local = flat_weights(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    initial = flat_weights(model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters())
    # Each rank's half of every global batch: the averaged gradient is the full batch's.
    batches = [(x[rank::size], y[rank::size]) for x, y in synthetic_batches(args.steps)]
    local_losses = sgd(model, optimizer, batches)
    final = flat_weights(model)

    report = {**where, "size": size, "everyone": everyone, "initial_local": initial_local,
              "initial": initial, "final": final, "local_losses": local_losses,
              "all_final": hvd.allgather_object(final)}
    if rank == 0:
        reference = new_model(seed=100)
        sgd(reference, torch.optim.SGD(reference.parameters(), lr=LR), synthetic_batches(args.steps))
        report["reference_final"] = flat_weights(reference)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(args.out / f"rank{rank}.json")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
