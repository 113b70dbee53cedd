"""2-rank smoke run: torch and TF each allreduce and broadcast; each rank writes what it got.

Usage (under horovodrun/mpirun): python hvd_smoke.py OUT_DIR [fail-rank]
With `fail-rank` = R, rank R raises right after init while the others block in an allreduce: the
launcher must end the job with an error instead of hanging.
"""

import json
import socket
import sys
from pathlib import Path

import horovod.torch as hvd_torch
import torch

out_dir = Path(sys.argv[1])
fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1

hvd_torch.init()
rank, size = hvd_torch.rank(), hvd_torch.size()
if rank == fail_rank:
    raise RuntimeError(f"rank {rank}: deliberate failure")

result = {"rank": rank, "size": size, "host": socket.gethostname()}
t = torch.arange(4, dtype=torch.float32) + 10 * rank
result["torch_allreduce_sum"] = hvd_torch.allreduce(t, op=hvd_torch.Sum).tolist()
result["torch_allreduce_avg"] = hvd_torch.allreduce(t, op=hvd_torch.Average).tolist()
b = torch.full((3,), float(rank + 1))
hvd_torch.broadcast_(b, root_rank=0)
result["torch_broadcast"] = b.tolist()
model = torch.nn.Linear(3, 2)  # different random init on every rank until broadcast
hvd_torch.broadcast_parameters(model.state_dict(), root_rank=0)
result["torch_params"] = [p.flatten().tolist() for p in model.parameters()]

import horovod.tensorflow as hvd_tf  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd_tf.init()
x = tf.range(4, dtype=tf.float32) + 10.0 * hvd_tf.rank()
result["tf_allreduce_sum"] = hvd_tf.allreduce(x, op=hvd_tf.Sum).numpy().tolist()
v = tf.Variable(tf.fill([3], float(hvd_tf.rank() + 1)))
hvd_tf.broadcast_variables([v], root_rank=0)
result["tf_broadcast"] = v.numpy().tolist()

(out_dir / f"rank{rank}.json").write_text(json.dumps(result))
