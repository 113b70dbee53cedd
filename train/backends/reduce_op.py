"""horovod.op and horovod.gradient_predivide_factor as Horovod's own arguments.

average: each gradient is the mean over ranks. gradient_predivide_factor f splits the division
as Horovod's DistributedOptimizer and DistributedGradientTape do: x 1/f before the sum
(prescale), x f / ranks after it (postscale and Average), so fp16 sums overflow less; the
result is the mean.

adasum: Horovod's Adasum (Maleki et al. 2020), per tensor even when Horovod fuses several into
one buffer (horovod/common/ops/adasum/adasum.h keeps a dot product and norms per tensor):
Adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, applied pairwise over a power-of-2
number of ranks. torch's DistributedOptimizer then reduces each rank's *update* (its optimizer
step taken on its own gradient, in the backward hook), TensorFlow's allreduce the gradients.
Horovod 0.28.1 has Adasum only for MPI and only for power-of-2 rank counts on CPUs; one rank
has nothing to combine and trains as with average (Horovod's DistributedOptimizer does the
same).

No framework import: `hvd` is the framework's Horovod module.
"""

from __future__ import annotations

from typing import Any

from ringfeed.errors import UserError


def adasum(section: Any, size: int) -> bool:
    """Whether the ranks' gradients combine with Adasum (op adasum and more than one rank)."""
    return section.op == "adasum" and size > 1


def torch_optimizer_args(section: Any, hvd: Any) -> dict[str, Any]:
    """hvd.DistributedOptimizer's op and gradient_predivide_factor."""
    op = hvd.Adasum if adasum(section, hvd.size()) else hvd.Average
    return {"op": op, "gradient_predivide_factor": section.gradient_predivide_factor}


def tf_reduce_gradients(grads: list[Any], section: Any, hvd: Any, compression: Any
                        ) -> list[Any]:
    """The gradients combined over the ranks (inside the step's tf.function)."""
    if adasum(section, hvd.size()):
        # Horovod 0.28.1's grouped_allreduce fails with Adasum (UnboundLocalError: 'tensor',
        # horovod/tensorflow/__init__.py); allreduce takes the tensors one by one, and
        # Horovod's fusion still reduces them in one buffer
        return [hvd.allreduce(g, op=hvd.Adasum, compression=compression) for g in grads]
    f = section.gradient_predivide_factor
    return hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression,
                                 prescale_factor=1.0 / f, postscale_factor=f)


def check_reduce_op(section: Any, size: int, mpi_enabled: bool) -> None:
    """After hvd.init(): Adasum can run on this job (the config check saw only the launch)."""
    if not adasum(section, size):
        return
    if not mpi_enabled:
        raise UserError("horovod.op: adasum needs Horovod's MPI controller (Horovod 0.28.1 has "
                        "no Gloo Adasum); launch with `mpirun ...`, or use op: average")
    if size & (size - 1):
        raise UserError(f"horovod.op: adasum needs a power-of-2 number of ranks (Horovod "
                        f"0.28.1), this job has {size}; launch 2, 4, 8... ranks or use op: "
                        "average")


def drop_adasum_step(optimizer: Any, hvd: Any) -> None:
    """Undo the step Horovod's torch Adasum optimizer began in the backward pass (a step the
    run does not apply: its loss was not finite). Its hooks already replaced each parameter
    with the rank's own update and started that update's allreduce; zero_grad() before step()
    is an AssertionError there. Each allreduce is waited for (every rank started it) and each
    parameter gets back its value from before the step (Horovod 0.28.1's _handles,
    _starting_models, _allreduce_delay). The rank's optimizer state keeps the local step.
    Any other optimizer is left as it is."""
    if not hasattr(optimizer, "_starting_models"):
        return
    for p, (handle, _) in optimizer._handles.items():
        if handle is not None:
            hvd.synchronize(handle)
            p.data.copy_(optimizer._starting_models[p])
        optimizer._allreduce_delay[p] = optimizer.backward_passes_per_step
    optimizer._handles.clear()
