"""Helpers for the trainer tests: tiny shard sets and configs, user-model hooks, and the
step-level worker that the equivalence tests run under horovodrun and as one process.

Worker: `python tests/train_util.py steps --framework torch --out OUT.json` runs several
scenarios through the real backend step function (Horovod's allreduce included) on fixed
global batches, each rank feeding its own slice, and writes the final weights per scenario.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FEATURES, CLASSES = 8, 3
GLOBAL_BATCH = 16  # = 2 ranks x 2 micro-batches x 4
STEPS = 6
INJECT_STEP = 2  # the fp16 scenario puts an inf into rank 1's gradient at this step
LOCAL_STEPS = 3  # local SGD's one-window scenarios: 3 local steps, then the averaging


# -- data ---------------------------------------------------------------------------------
def toy_arrays(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A learnable 3-class problem: the label is the argmax of three fixed projections."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    w = np.random.default_rng(1234).normal(size=(FEATURES, CLASSES))
    return x, (x @ w).argmax(1).astype(np.int64)


IMAGE = (4, 4, 2)  # the channels_last scenarios' NHWC inputs


def toy_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """toy_arrays' problem on 4x4x2 images (the label: argmax of three fixed projections)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *IMAGE)).astype(np.float32)
    w = np.random.default_rng(4321).normal(size=(int(np.prod(IMAGE)), CLASSES))
    return x, (x.reshape(n, -1) @ w).argmax(1).astype(np.int64)


def write_toy_shards(out: Path, n_train: int = 480, n_val: int = 96,
                     per_shard: int = 50, draw: int = 0) -> Path:
    """x.npy / y.npy shards with a manifest, written with webdataset's TarWriter; `draw` k
    samples the same problem with seeds 2k (train) and 2k + 1 (val): another dataset of it."""
    import webdataset as wds

    from ringfeed.formats.manifest import Manifest, ShardInfo, Split
    from ringfeed.fsutil import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n, seed in (("train", n_train, 2 * draw), ("val", n_val, 2 * draw + 1)):
        x, y = toy_arrays(n, seed)
        infos = []
        for s, start in enumerate(range(0, n, per_shard)):
            name = f"{split}-{s:06d}.tar"
            with wds.TarWriter(str(out / name)) as sink:
                for i in range(start, min(n, start + per_shard)):
                    sink.write({"__key__": f"{i:06d}", "x.npy": _npy(x[i]), "y.npy": _npy(y[i])})
            infos.append(ShardInfo(name, min(n, start + per_shard) - start,
                                   (out / name).stat().st_size, sha256_file(out / name)))
        splits[split] = Split(infos)
    Manifest(splits=splits, fields={"x.npy": "npy", "y.npy": "npy"}).save(out)
    return out


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_config(path: Path, **sections: Any) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def toy_config(shards: Path, out: Path, framework: str = "torch", **overrides: Any) -> dict:
    """A small, fast config on the toy shards; `overrides` replace whole sections' keys."""
    cfg = {
        "framework": framework,
        "model": {"name": "mlp", "args": {"num_classes": CLASSES, "hidden": [16]}},
        "data": {"train": str(shards), "batch_size": 4},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 2, "log_every": 5},
        "checkpoint": {"every_steps": 10, "keep": 10},
        "output": {"dir": str(out)},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


# -- running a job in the background and signalling one of its ranks --------------------
def start(cmd: list[Any], env: dict[str, str]) -> subprocess.Popen:
    """Like helpers.run, but returns at once; `finish()` bounds it with a timeout."""
    return subprocess.Popen([str(c) for c in cmd], env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out


def rank_process(launcher: subprocess.Popen, rank: int):
    """The training process of `rank` among the launcher's descendants (psutil.Process)."""
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if (child.environ().get("HOROVOD_RANK") == str(rank)
                    and any(part.endswith("ringfeed") for part in child.cmdline())):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def wait_for_handler(proc: subprocess.Popen, sig: int, timeout: float) -> bool:
    """True once the process catches `sig` (its bit in /proc's SigCgt mask): a signal sent
    before then would meet the default action, whatever the product does later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines()
                          if line.startswith("SigCgt:")), 16)
        if caught >> (sig - 1) & 1:
            return True
        time.sleep(0.01)
    return False


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float) -> bool:
    """True once metrics.jsonl logs a training step >= `step` (False if the job ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and max(train_steps(metrics), default=0) >= step:
            return True
        time.sleep(0.05)
    return False


def train_steps(metrics: Path) -> list[int]:
    """The steps of the training records (not validation) in a metrics.jsonl."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r]


# -- a user loss that turns NaN on one rank -----------------------------------------------
_loss_calls = 0


def nan_on_rank1_at_step3(logits, targets):
    """Cross entropy, except NaN on rank 1's third training call (= step 3)."""
    import torch.nn.functional as F

    global _loss_calls
    losses = F.cross_entropy(logits.float(), targets, reduction="none")
    if logits.requires_grad:
        _loss_calls += 1
        if _loss_calls == 3 and os.environ.get("HOROVOD_RANK", os.environ.get(
                "OMPI_COMM_WORLD_RANK")) == "1":
            return losses * float("nan")
    return losses


def overflow_when_first_is_class_0(logits, targets):
    """Cross entropy, x 1e6 for a batch whose first sample is of class 0 (about one step in
    three, the same steps on every run over the same batches): under fp16 its scaled gradient
    overflows, so GradScaler skips that step and halves its scale."""
    import torch.nn.functional as F

    losses = F.cross_entropy(logits.float(), targets, reduction="none")
    return losses * 1e6 if int(targets[0]) == 0 else losses


# -- user models that inject an inf into one rank's gradient ------------------------------
def inf_mlp_torch(spec, hidden: int = 16):
    """An MLP whose hidden activation's gradient becomes inf while `model.armed` is set:
    Linear's weight gradient on that rank overflows, the loss stays finite."""
    import torch
    from torch import nn

    class Inject(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, armed):
            ctx.save_for_backward(armed)
            return h.view_as(h)

        @staticmethod
        def backward(ctx, grad):
            (armed,) = ctx.saved_tensors
            return torch.where(armed > 0, torch.full_like(grad, float("inf")), grad), None

    class InfMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(spec.input_shape[0], hidden)
            self.fc2 = nn.Linear(hidden, spec.num_classes)
            self.register_buffer("armed", torch.zeros(()), persistent=False)

        def forward(self, x):
            return self.fc2(torch.relu(Inject.apply(self.fc1(x), self.armed)))

    return InfMLP()


def inf_mlp_keras(spec, hidden: int = 16):
    import keras
    import tensorflow as tf

    class Inject(keras.layers.Layer):
        def build(self, shape):
            self.armed = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                         name="armed")

        def call(self, h):
            armed = tf.cast(self.armed, h.dtype)

            @tf.custom_gradient
            def inject(v):
                def grad(dy):
                    return tf.where(armed > 0, tf.fill(tf.shape(dy), tf.constant(np.inf, dy.dtype)),
                                    dy)
                return tf.identity(v), grad
            return inject(h)

    inputs = keras.Input(spec.input_shape)
    h = keras.layers.Dense(hidden)(inputs)
    h = keras.layers.Activation("relu")(Inject(name="inject")(h))
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, dtype="float32")(h))


def inf_mlp(spec, framework: str, hidden: int = 16):
    return (inf_mlp_torch if framework == "torch" else inf_mlp_keras)(spec, hidden)


# -- user models for the recipe keys (issue 46) ---------------------------------------------
def bn_mlp(spec, num_classes: int, hidden: int = 16, framework: str = "torch"):
    """An MLP with a BatchNorm after its hidden layer: each rank's running statistics differ
    (they follow that rank's batches) unless train.average_bn_stats averages them."""
    if framework == "torch":
        from torch import nn

        return nn.Sequential(nn.Linear(spec.input_shape[0], hidden), nn.BatchNorm1d(hidden),
                             nn.ReLU(), nn.Linear(hidden, num_classes))
    import keras

    inputs = keras.Input(spec.input_shape)
    h = keras.layers.BatchNormalization()(keras.layers.Dense(hidden)(inputs))
    h = keras.layers.Activation("relu")(h)
    return keras.Model(inputs, keras.layers.Dense(num_classes, dtype="float32")(h))


def regularized_mlp(spec, l2: float, activity: float, hidden: int = 16):
    """A Keras MLP with the model's own losses: an L2 kernel_regularizer on both layers (the
    Keras ImageNet example's weight decay) and an L1 activity regularizer (an add_loss)."""
    import keras

    reg = keras.regularizers.L2(l2)
    inputs = keras.Input(spec.input_shape)
    h = keras.layers.Dense(hidden, activation="relu", kernel_regularizer=reg,
                           activity_regularizer=keras.regularizers.L1(activity))(inputs)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, kernel_regularizer=reg)(h))


def _arm(backend, on: bool) -> None:
    if backend.name == "torch":
        backend.model.armed.fill_(1.0 if on else 0.0)
    else:
        backend.model.get_layer("inject").armed.assign(1.0 if on else 0.0)


# -- the step-level worker ------------------------------------------------------------------
def _backend(framework: str, accumulate: int, micro: int, spec=None, **train: Any):
    from ringfeed.train.backends.select import make_backend
    from ringfeed.train.config import RunConfig
    from ringfeed.train.data import CLASSIFY, DataSpec

    spec = spec or DataSpec(CLASSIFY, "x.npy", "y.npy", (FEATURES,), num_classes=CLASSES)
    model = train.pop("model", {"name": "mlp", "args": {"hidden": [16]}})
    cfg = RunConfig.model_validate({
        "framework": framework, "model": model,
        "data": {"train": "unused", "batch_size": micro},
        "optim": {"name": train.pop("optim", "sgd"), "lr": 0.1, "momentum": 0.9,
                  "scale_lr_with_world_size": False},
        "train": {"accumulate": accumulate, "seed": 7, **train},
    })
    backend = make_backend(cfg)
    backend.build(spec)
    backend.sync_from_root(resumed=False)
    return backend


def _dist(framework: str) -> tuple[int, int]:
    from ringfeed.train.backends.select import make_backend
    from ringfeed.train.config import RunConfig

    dist = make_backend(RunConfig(framework=framework, data={"train": "unused"})).dist
    return dist.rank, dist.size


def _digest(arrays: list[Any]) -> str:
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def optimizer_arrays(backend) -> list[np.ndarray]:
    """The optimizer's state as arrays (torch: every tensor of every parameter's state; Keras:
    every optimizer variable), in a fixed order."""
    if backend.name == "torch":
        state = backend.optimizer.state
        return [v.detach().cpu().numpy() for p in backend.model.parameters()
                for _, v in sorted(state.get(p, {}).items()) if hasattr(v, "detach")]
    return [v.numpy() for v in backend.optimizer.variables]


def run_scenario(framework: str, accumulate: int, steps: int = STEPS, inject: bool = False,
                 image: bool = False, replica: int | None = None, trace: bool = False,
                 check_metrics: bool = False, **train: Any) -> dict[str, Any]:
    """`steps` optimizer steps on fixed global batches of GLOBAL_BATCH; rank r feeds rows
    [r*G/N, (r+1)*G/N) split into `accumulate` micro-batches. `image`: the built-in cnn on
    toy_images instead of the mlp on toy_arrays. `replica`: one process feeds the rows rank
    `replica` of 2 would (the reference for local SGD's replicas). `trace`: each step records
    digests of the weights and of the optimizer state. `check_metrics` (one rank): each step
    also records the validation metrics of its own batch before it, the model as the step
    sees it (no dropout or BatchNorm here)."""
    from ringfeed.train.data import CLASSIFY, DataSpec

    rank, size = _dist(framework)
    if replica is not None:
        assert size == 1
        rank, size = replica, 2
    per_rank = GLOBAL_BATCH // size
    micro = per_rank // accumulate
    if image:
        train.setdefault("model", {"name": "cnn", "args": {"width": 4, "hidden": 8}})
        train["spec"] = DataSpec(CLASSIFY, "x.npy", "y.npy", IMAGE, num_classes=CLASSES)
    backend = _backend(framework, accumulate, micro, **train)
    x, y = (toy_images if image else toy_arrays)(GLOBAL_BATCH * steps, seed=99)
    initial = backend.weights()
    results = []
    for s in range(steps):
        rows = slice(s * GLOBAL_BATCH + rank * per_rank, s * GLOBAL_BATCH + (rank + 1) * per_rank)
        xs, ys = x[rows], y[rows]
        batches = [{"x.npy": xs[i * micro:(i + 1) * micro], "y.npy": ys[i * micro:(i + 1) * micro]}
                   for i in range(accumulate)]
        if inject:
            _arm(backend, on=(s == INJECT_STEP and rank == 1))
        before = [w.copy() for w in backend.weights()]
        expected = None
        if check_metrics:
            sums = backend.eval_batch({"x.npy": xs, "y.npy": ys})
            expected = {k: v / sums["count"] for k, v in sums.items() if k not in ("count",
                                                                                   "loss")}
        r = backend.train_step(batches, lr=0.1)
        changed = any(not np.array_equal(a, b) for a, b in zip(before, backend.weights(),
                                                               strict=True))
        results.append({"loss": r.loss, "applied": r.applied, "loss_scale": r.loss_scale,
                        "weights_changed": changed, "metrics": r.metrics,
                        "expected_metrics": expected})
        if trace:
            results[-1].update(weights_digest=_digest(backend.weights()),
                               optimizer_digest=_digest(optimizer_arrays(backend)))
    layouts = None
    if framework == "torch":  # which 4-D weights are stored NHWC (channels_last) after training
        import torch

        layouts = [p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                   for p in backend.model.parameters() if p.dim() == 4]
    return {"rank": rank, "size": size, "steps": results, "channels_last": layouts,
            "comm": backend.comm_stats(),
            "initial": [w.astype(np.float64).ravel().tolist() for w in initial],
            "weights": [w.astype(np.float64).ravel().tolist() for w in backend.weights()]}


def overfit_builtin(framework: str, name: str, steps: int = 8) -> list[float]:
    """Losses of `steps` steps on one fixed batch: the built-in cnn (uint8 HWC images) and
    gpt (token rows of seq_len + 1) must drive them down."""
    from ringfeed.train.data import CLASSIFY, LM, DataSpec

    rng = np.random.default_rng(5)
    if name == "cnn":
        spec = DataSpec(CLASSIFY, "png", "cls", (8, 8, 1), num_classes=CLASSES)
        cls = rng.integers(0, CLASSES, 8)  # the class sets the brightness: learnable
        png = cls[:, None, None, None] * 90 + rng.integers(0, 60, (8, 8, 8, 1))
        batch = {"png": png.astype(np.uint8), "cls": cls}
        args = {"width": 8}
    else:
        spec = DataSpec(LM, "tokens.npy", None, (16,), vocab_size=20)
        batch = {"tokens.npy": rng.integers(0, 20, (4, 17))}
        args = {"n_layer": 1, "d_model": 32, "n_head": 2}
    backend = _backend(framework, 1, len(next(iter(batch.values()))), spec=spec,
                       model={"name": name, "args": args}, optim="adam")
    lr = 0.03 if name == "cnn" else 0.01
    return [backend.train_step([batch], lr=lr).loss for _ in range(steps)]


SMOOTHING, TOPK = 0.1, 3
FIXED_LOGITS = np.random.default_rng(11).normal(size=(12, 7)).round(3).astype(np.float32)
FIXED_TARGETS = np.random.default_rng(12).integers(0, 7, 12)


def builtin_fns_on_fixed_logits(framework: str) -> dict[str, list[float]]:
    """The built-in loss (train.label_smoothing SMOOTHING) and metrics (train.topk TOPK) of a
    backend, per sample, on FIXED_LOGITS and FIXED_TARGETS."""
    backend = _backend(framework, 1, 4, label_smoothing=SMOOTHING, topk=TOPK)
    if framework == "torch":
        import torch

        logits, targets = torch.from_numpy(FIXED_LOGITS), torch.from_numpy(FIXED_TARGETS)
    else:
        import tensorflow as tf

        logits, targets = tf.constant(FIXED_LOGITS), tf.constant(FIXED_TARGETS)
    values = {"loss": backend.loss_fn(logits, targets), **backend.metrics_fn(logits, targets)}
    return {k: np.asarray(v).astype(np.float64).tolist() for k, v in values.items()}


def keras_own_losses(l2: float) -> dict[str, Any]:
    """One step of regularized_mlp (L2 `l2` on its kernels, L1 1e-3 on its hidden activations)
    on 16 fixed rows: the step's loss, the data loss and the model's own losses before it (the
    same forward, eagerly), and the weights after it."""
    import tensorflow as tf

    backend = _backend("tensorflow", 1, 16, model={"name": "train_util:regularized_mlp",
                                                   "args": {"l2": l2, "activity": 1e-3}})
    x, y = toy_arrays(16, seed=3)
    sums = backend.eval_batch({"x.npy": x, "y.npy": y})
    backend.model(tf.constant(x), training=True)  # (eager: model.losses of this forward)
    own = float(sum(tf.reduce_sum(v) for v in backend.model.losses))
    result = backend.train_step([{"x.npy": x, "y.npy": y}], lr=0.1)
    return {"loss": result.loss, "data_loss": sums["loss"] / sums["count"], "own": own,
            "weights": [w.astype(np.float64).ravel().tolist() for w in backend.weights()]}


def steps_main(framework: str, out: Path) -> None:
    """The scenarios for this world size; rank 0 writes `out` (every rank's results)."""
    rank, size = _dist(framework)
    scenarios: dict[str, Any] = {}
    if size == 1:
        scenarios["ref"] = run_scenario(framework, 1, topk=2, check_metrics=True)  # 1 x 16
        scenarios["acc2"] = run_scenario(framework, 2)  # 1 rank x 2 micro-batches of 8
        scenarios["acc4"] = run_scenario(framework, 4)  # 1 rank x 4 micro-batches of 4
        scenarios["bf16"] = run_scenario(framework, 1, precision="bf16")
        scenarios["adam_ref"] = run_scenario(framework, 1, optim="adam", grad_clip=0.5)
        scenarios["overfit"] = {name: overfit_builtin(framework, name) for name in ("cnn", "gpt")}
        scenarios["builtin_fns"] = builtin_fns_on_fixed_logits(framework)
        if framework == "tensorflow":
            scenarios["own_losses"] = {str(l2): keras_own_losses(l2) for l2 in (10.0, 0.0)}
        if framework == "torch":
            scenarios["conv_ref"] = run_scenario(framework, 1, image=True)
            scenarios["cl_ref"] = run_scenario(framework, 1, image=True, channels_last=True)
        # local SGD on one rank is plain training; each replica alone, for 2-rank local SGD
        scenarios["lsgd_h4"] = run_scenario(framework, 1, sync_every=4)
        scenarios["lsgd_acc2_h3"] = run_scenario(framework, 2, sync_every=3)
        for r in (0, 1):
            scenarios[f"lsgd_replica{r}"] = run_scenario(framework, 1, steps=LOCAL_STEPS,
                                                         replica=r, sync_every=LOCAL_STEPS)
            scenarios[f"lsgd_adam_replica{r}"] = run_scenario(
                framework, 2, steps=LOCAL_STEPS, replica=r, sync_every=LOCAL_STEPS,
                optim="adam", grad_clip=0.5)
    else:
        scenarios["dp"] = run_scenario(framework, 1, topk=2)  # 2 ranks x 8
        scenarios["dp_acc2"] = run_scenario(framework, 2)  # 2 ranks x 2 micro-batches of 4
        scenarios["adam_dp"] = run_scenario(framework, 1, optim="adam", grad_clip=0.5)
        scenarios["dp_fp16_allreduce"] = run_scenario(framework, 1, fp16_allreduce=True)
        model = {"name": "train_util:inf_mlp", "args": {}}
        scenarios["fp16_inject"] = run_scenario(framework, 1, inject=True, precision="fp16",
                                                model=model)
        if framework == "torch":
            scenarios["cl_dp"] = run_scenario(framework, 1, image=True, channels_last=True)
            scenarios["cl_dp_acc2"] = run_scenario(framework, 2, image=True, channels_last=True)
            scenarios["lsgd_cl_h2"] = run_scenario(framework, 1, image=True, channels_last=True,
                                                   sync_every=2, trace=True)
        # local SGD (train.sync_every)
        scenarios["lsgd_h1"] = run_scenario(framework, 1, sync_every=1)
        scenarios["lsgd_h2"] = run_scenario(framework, 1, sync_every=2, trace=True)
        scenarios["lsgd_h2_params"] = run_scenario(framework, 1, sync_every=2, trace=True,
                                                   sync_optimizer_state=False)
        scenarios["lsgd_adam_h2"] = run_scenario(framework, 1, sync_every=2, trace=True,
                                                 optim="adam", grad_clip=0.5)
        scenarios["lsgd_window"] = run_scenario(framework, 1, steps=LOCAL_STEPS,
                                                sync_every=LOCAL_STEPS)
        scenarios["lsgd_adam_window"] = run_scenario(framework, 2, steps=LOCAL_STEPS,
                                                     sync_every=LOCAL_STEPS, optim="adam",
                                                     grad_clip=0.5)
        scenarios["lsgd_fp16_inject"] = run_scenario(framework, 1, inject=True, precision="fp16",
                                                     model=model, sync_every=2, trace=True)
    if framework == "torch":
        import horovod.torch as hvd
    else:
        import horovod.tensorflow as hvd
    all_ranks = hvd.allgather_object(scenarios)
    if rank == 0:
        out.write_text(json.dumps({"size": size, "ranks": all_ranks}))


# -- an independent audit of what reaches the model -------------------------------------------
# A user model (recording_mlp) that writes, for every training forward pass, a hash of each
# input row and a digest of the weights it is about to be trained from, to files of its own
# ($RINGFEED_TEST_AUDIT_DIR/forwards-<pid>.jsonl). Nothing the trainer writes is read: its
# samples.jsonl and metrics.jsonl are rewound at a rollback or resume, these files are not.
# From the forwards alone, committed_steps() finds the steps that made the final weights (a
# rolled-back step is a forward whose weights were never built on) and replay() retrains them
# in one process, with the framework's own optimizer, from the weights the first forward saw.
AUDIT_ENV = "RINGFEED_TEST_AUDIT_DIR"
# seconds each audited training forward sleeps: keeps a job that a test stops after step N from
# finishing its few short steps first when the machine is loaded (sleeping costs no CPU)
AUDIT_PACE_ENV = "RINGFEED_TEST_AUDIT_PACE_S"


def row_hash(row: np.ndarray) -> str:
    """A model input row's identity in the audit: a hash of its float32 bytes."""
    return hashlib.blake2b(np.ascontiguousarray(row, np.float32).tobytes(),
                           digest_size=8).hexdigest()


def weights_digest(arrays: list[np.ndarray]) -> str:
    """The identity of a set of weights (bit for bit: ranks hold identical replicas)."""
    h = hashlib.blake2b(digest_size=12)
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()


class ForwardLog:
    """One process's audit file. The first forward also saves the weights it saw
    (`weights-<digest>.npz`, the replay's starting point or a resumed run's restored state)."""

    def __init__(self) -> None:
        self.dir = Path(os.environ[AUDIT_ENV])
        self.path = self.dir / f"forwards-{os.getpid()}.jsonl"
        self.saved_first = False
        self.pace = float(os.environ.get(AUDIT_PACE_ENV) or 0)

    def forward(self, rows: np.ndarray, weights: list[np.ndarray]) -> None:
        digest = weights_digest(weights)
        if not self.saved_first:
            tmp = self.dir / f".weights-{digest}.{os.getpid()}.npz"
            np.savez(tmp, *weights)
            os.replace(tmp, self.dir / f"weights-{digest}.npz")
            self.saved_first = True
        line = json.dumps({"time": time.time(), "weights": digest,
                           "rows": [row_hash(r) for r in rows]})
        with open(self.path, "a") as f:  # one write per forward: a SIGKILL tears at most it
            f.write(line + "\n")
        if self.pace:
            time.sleep(self.pace)


def recording_mlp(spec, num_classes: int, hidden: list[int], framework: str = "torch"):
    """The built-in MLP (torch or Keras), wrapped to log every training forward (ForwardLog).
    Evaluation forwards are not logged."""
    if framework == "torch":
        return _recording_mlp_torch(spec, num_classes, hidden)
    return _recording_mlp_keras(spec, num_classes, hidden)


def _recording_mlp_torch(spec, num_classes: int, hidden: list[int]):
    import torch

    from ringfeed.train.models import torch_models

    inner = torch_models.build("mlp", spec, num_classes=num_classes, hidden=hidden)
    log = ForwardLog()

    class Recording(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if self.training:
                log.forward(x.detach().float().cpu().numpy(),
                            [v.detach().cpu().numpy() for v in self.inner.state_dict().values()])
            return self.inner(x)

    return Recording()


def _recording_mlp_keras(spec, num_classes: int, hidden: list[int]):
    import keras
    import tensorflow as tf

    from ringfeed.train.models import keras_models

    inner = keras_models.mlp(spec, num_classes=num_classes, hidden=hidden)
    log = ForwardLog()

    def record(rows: np.ndarray, *weights: np.ndarray) -> np.ndarray:
        log.forward(rows, list(weights))
        return rows

    class Record(keras.layers.Layer):
        """Identity on the input; in training, the input and the weights pass through the log
        inside the step's graph (the weights read before the step's update: the update
        depends on this output)."""

        def call(self, x, training=None):
            if not training:
                return x
            weights = [tf.stop_gradient(w.value) for w in inner.trainable_weights]
            out = tf.numpy_function(record, [x, *weights], x.dtype, stateful=True)
            out.set_shape(x.shape)
            return out

    inputs = keras.Input(spec.input_shape)
    return keras.Model(inputs, inner(Record()(inputs)))


@dataclass(frozen=True)
class Forward:
    process: str
    time: float
    weights: str  # digest of the weights the forward ran with
    rows: list[str]


@dataclass(frozen=True)
class Step:
    weights: str  # digest of the weights the step started from
    rows: list[str]  # every rank's rows of the step


def audited_forwards(audit_dir: Path) -> dict[str, list[Forward]]:
    """Every process's training forwards, in order. A process SIGKILLed mid-write leaves at
    most a torn last line, which is skipped."""
    out = {}
    for f in sorted(Path(audit_dir).glob("forwards-*.jsonl")):
        lines = f.read_text().splitlines()
        records = []
        for i, line in enumerate(lines):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise
            records.append(Forward(f.stem, r["time"], r["weights"], r["rows"]))
        out[f.stem] = records
    return out


def audited_rows(audit_dir: Path) -> list[str]:
    """Every row that reached the model in training, in any step, committed or not."""
    return [h for forwards in audited_forwards(audit_dir).values()
            for fw in forwards for h in fw.rows]


def committed_steps(audit_dir: Path) -> list[Step]:
    """The steps that made the weights of the job's last forward, in order, from the audit
    alone (one forward per rank per step: train.accumulate 1).

    Weights are states; a process's next forward after one at state A runs at A's successor
    B - unless B was seen before A (a rollback to a commit: B is old). Successors form a tree
    from the first state; the committed steps are its path to the state of the latest
    forward. A step's rows: the forwards at its state whose process next trained from the
    path's next state (or from nothing more: the run ended, or that process died), never
    those continued on an abandoned branch. If a rollback failed to restore the weights, the
    abandoned steps stay on the path and their samples show up twice."""
    forwards = audited_forwards(audit_dir)
    first_seen: dict[str, float] = {}
    for fws in forwards.values():
        for fw in fws:
            first_seen[fw.weights] = min(fw.time, first_seen.get(fw.weights, fw.time))
    parent: dict[str, str] = {}
    successor: dict[tuple[str, int], str | None] = {}  # (process, index) -> next state
    for process, fws in forwards.items():
        for i, fw in enumerate(fws):
            nxt = fws[i + 1].weights if i + 1 < len(fws) else None
            successor[process, i] = nxt
            if nxt is not None and nxt != fw.weights and first_seen[nxt] > fw.time:
                assert parent.setdefault(nxt, fw.weights) == fw.weights, \
                    f"state {nxt} reached from two states"
    last = max((fw for fws in forwards.values() for fw in fws), key=lambda fw: fw.time)
    path = [last.weights]
    while path[-1] in parent:
        path.append(parent[path[-1]])
    path.reverse()
    following = dict(zip(path, [*path[1:], None], strict=True))
    steps = {state: [] for state in path}
    for process, fws in forwards.items():
        for i, fw in enumerate(fws):
            if fw.weights in steps and successor[process, i] in (following[fw.weights], None):
                steps[fw.weights].extend(fw.rows)
    return [Step(state, steps[state]) for state in path]


def first_weights(audit_dir: Path, digest: str) -> list[np.ndarray]:
    """The weights a process saw at its first forward, saved under their digest."""
    with np.load(Path(audit_dir) / f"weights-{digest}.npz") as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def toy_row_ids(n: int = 480) -> dict[str, int]:
    """Row hash -> sample id for write_toy_shards' train split."""
    x, _ = toy_arrays(n, 0)
    return {row_hash(r): i for i, r in enumerate(x)}


@dataclass
class Replay:
    """The result of retraining audited steps in one process."""

    losses: list[float]  # each step's loss before its update
    weights: list[np.ndarray]  # the framework's parameter order and layout
    optimizer: list[np.ndarray]  # SGD momentum, one per weight


def replay(framework: str, initial: list[np.ndarray], batches: list[tuple[np.ndarray,
           np.ndarray]], lrs: list[float], momentum: float,
           drop_optimizer_state_at: int | None = None) -> Replay:
    """Plain SGD with momentum (the framework's own optimizer: torch's and Keras' momentum
    differ when the lr changes) on the toy MLP (one hidden ReLU layer), one step per batch
    on the batch's mean cross entropy, from `initial`. `drop_optimizer_state_at`: start the
    optimizer afresh before that step (what a resume that lost the momentum would do)."""
    if framework == "torch":
        return _replay_torch(initial, batches, lrs, momentum, drop_optimizer_state_at)
    return _replay_keras(initial, batches, lrs, momentum, drop_optimizer_state_at)


def _replay_torch(initial, batches, lrs, momentum, drop_at) -> Replay:
    import torch
    import torch.nn.functional as F

    w1, b1, w2, b2 = (torch.tensor(a) for a in initial)
    net = torch.nn.Sequential(torch.nn.Linear(w1.shape[1], w1.shape[0]), torch.nn.ReLU(),
                              torch.nn.Linear(w2.shape[1], w2.shape[0]))
    with torch.no_grad():
        for p, value in zip(net.parameters(), (w1, b1, w2, b2), strict=True):
            p.copy_(value)
    losses = []
    opt = None
    for i, ((x, y), lr) in enumerate(zip(batches, lrs, strict=True)):
        if opt is None or i == drop_at:
            opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(net(torch.tensor(x)), torch.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return Replay(losses, [p.detach().numpy().copy() for p in net.parameters()],
                  [opt.state[p]["momentum_buffer"].numpy().copy() for p in net.parameters()])


def _replay_keras(initial, batches, lrs, momentum, drop_at) -> Replay:
    import keras
    import tensorflow as tf

    k1, _, k2, _ = initial
    net = keras.Sequential([keras.Input((k1.shape[0],)),
                            keras.layers.Dense(k1.shape[1], activation="relu"),
                            keras.layers.Dense(k2.shape[1])])
    net.set_weights(initial)
    losses = []
    opt = None
    for i, ((x, y), lr) in enumerate(zip(batches, lrs, strict=True)):
        if opt is None or i == drop_at:
            opt = keras.optimizers.SGD(momentum=momentum)
            opt.build(net.trainable_variables)
        opt.learning_rate.assign(lr)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, net(x, training=True), from_logits=True))
        opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
        losses.append(float(loss))
    return Replay(losses, [w.numpy().copy() for w in net.trainable_weights],
                  [m.numpy().copy() for m in opt.momentums])


def checkpoint_arrays(framework: str,
                      ckpt: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A checkpoint's model weights and SGD momentum, in the framework's parameter order."""
    if framework == "torch":
        import torch

        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        optimizer = state["optimizer"]["state"]
        return ([v.numpy() for v in state["model"].values()],
                [optimizer[i]["momentum_buffer"].numpy() for i in sorted(optimizer)])
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(ckpt / "tf_checkpoint"))

    def listed(group: str) -> list[np.ndarray]:  # model.variables / optimizer.variables order
        keys = [k for k in reader.get_variable_to_shape_map()
                if k.startswith(f"{group}/") and k.endswith("/.ATTRIBUTES/VARIABLE_VALUE")]
        arrays = [reader.get_tensor(k) for k in sorted(keys, key=lambda k: int(k.split("/")[1]))]
        # floats with a shape: weights, momentum (not seed states, iterations, the lr)
        return [a for a in arrays if a.ndim and np.issubdtype(a.dtype, np.floating)]

    return listed("model"), listed("optimizer")


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b], ([x.shape for x in a],
                                                          [y.shape for y in b])
    return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b,
                                                                             strict=True))



if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["steps"])
    parser.add_argument("--framework", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    steps_main(args.framework, args.out)
