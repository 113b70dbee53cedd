"""Where data parallelism stops: the memory every rank holds for the built-in gpt's parameters,
gradients and AdamW state (each Horovod rank keeps a full replica of all three), measured by
summing the real tensors after one optimizer step, plus the activations of one micro-batch
(CUDA: peak allocated; CPU: not measured, reported as null).

    python benchmarks/model_memory.py [--out benchmarks/results/model_memory.json]

A model fits ringfeed's data-parallel design while state + activations fit one GPU; past that,
see README "When to use something else" (FSDP, DeepSpeed ZeRO, Megatron-LM).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ringfeed.train.models.torch_models import GPT  # noqa: E402

# (n_layer, d_model, n_head): the default, then GPT-2 small's and medium's shapes
SIZES = [(2, 128, 4), (12, 768, 12), (24, 1024, 16)]
VOCAB, SEQ = 50257, 1024


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(n_layer: int, d_model: int, n_head: int, device: str, batch: int) -> dict:
    model = GPT(VOCAB, SEQ, n_layer=n_layer, n_head=n_head, d_model=d_model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, VOCAB, (batch, SEQ), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    activations = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else None
    optimizer.step()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    row = {"n_layer": n_layer, "d_model": d_model, "n_head": n_head,
           "parameters": sum(p.numel() for p in params),
           "param_bytes": tensor_bytes(params),
           "grad_bytes": tensor_bytes(p.grad for p in params),
           "optimizer_bytes": tensor_bytes(state),
           "activation_bytes_per_microbatch": activations, "microbatch": batch}
    row["state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/model_memory.json")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch for the activations")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [measure(*size, device=device, batch=args.batch) for size in SIZES]
    print(f"{'layers':>6} {'d_model':>7} {'params':>8} {'params+grads+AdamW':>19} "
          f"{'bytes/param':>11}")
    for r in rows:
        print(f"{r['n_layer']:>6} {r['d_model']:>7} {r['parameters'] / 1e6:>7.1f}M "
              f"{r['state_bytes'] / 2**30:>16.2f} GiB {r['state_bytes'] / r['parameters']:>11.1f}")
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"device": device, "vocab": VOCAB, "seq_len": SEQ,
                               "rows": rows}, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
