"""TensorFlow 2 + Keras 3 + Horovod: a custom tf.function step (horovod.tensorflow.keras does
not work with Keras 3), a Keras dtype policy for bf16/fp16, LossScaleOptimizer for fp16,
tf.train.Checkpoint for checkpoints.

Accumulation: the k micro-batch gradients are summed locally with plain GradientTapes and
reduced once per optimizer step with `hvd.grouped_allreduce` - the same call
`hvd.DistributedGradientTape` makes for one tape, here applied to the accumulated sum
(horovod.op: adasum: hvd.allreduce per tensor, train/backends/reduce_op.py). Horovod
is handed the underlying tf.Variables (`v.value`): Keras 3 variables have no `.ref()`.
The fp16 finite check (inside LossScaleOptimizer.apply) runs on the reduced gradients, which
are identical on every rank, so an overflow on one rank skips the step on all of them.

A step is one tf.function call: gradients, the grouped allreduce and the agreement allreduce
(loss, save/stop requests) side by side, the update under a tf.cond on the averaged loss being
finite (so a NaN/inf loss applies nothing), and one small vector back to Python.

Local SGD (train.sync_every: H > 1): the same step without the gradient allreduce (each rank
applies its own averaged micro-batch gradients; LossScaleOptimizer checks them per rank), and
every H steps one more tf.function averages the model's trainable variables and, with
sync_optimizer_state, the optimizer's per-variable slots in one grouped allreduce.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError

from ringfeed.errors import model_mismatch
from ringfeed.train.backends.base import (
    STATS_LOSS,
    Groups,
    HorovodBackend,
    Span,
    StepResult,
    choose_gpu,
    metric_sums,
)
from ringfeed.train.backends.init_weights import load_keras
from ringfeed.train.backends.reduce_op import tf_reduce_gradients
from ringfeed.train.data import REGRESS, DataSpec, TrainPipeline, split_batch
from ringfeed.train.mixing import (
    MixAt,
    mix_draw,
    mix_position,
    mixed_loss,
    mixed_tf,
    mixing_on,
    spatial_axes,
)
from ringfeed.train.models import build_model, channels_first
from ringfeed.train.models.outputs import on_logits
from ringfeed.train.observe.profiler import no_span
from ringfeed.train.observe.throughput import FlopCount, count_tf_flops

CHECKPOINT_PREFIX = "tf_checkpoint"
MIX_KEY = "__mix__"  # a micro-batch's MixDraw.vector() in the traced step
POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def cross_entropy(logits: tf.Tensor, targets: tf.Tensor,
                  label_smoothing: float = 0.0) -> tf.Tensor:
    """Per-sample cross entropy; for sequences (B, T, V) the mean over the T positions."""
    return _crossentropy(tf.cast(logits, tf.float32), targets, True, label_smoothing)


def probabilities_cross_entropy(probs: tf.Tensor, targets: tf.Tensor,
                                label_smoothing: float = 0.0) -> tf.Tensor:
    """cross_entropy for a model that ends in a softmax (outputs are probabilities, as
    keras.applications' classifiers give by default): Keras' from_logits=False loss, which
    for a softmax output of the TensorFlow backend reads the logits before it (numerically as
    stable as from_logits=True) and otherwise clips the probabilities."""
    return _crossentropy(probs, targets, False, label_smoothing)


def _crossentropy(outputs: tf.Tensor, targets: tf.Tensor, from_logits: bool,
                  label_smoothing: float) -> tf.Tensor:
    """Keras' cross entropy of integer targets; smoothed, CategoricalCrossentropy's
    (label_smoothing=s): the one-hot targets become (1 - s) x one-hot + s / classes."""
    if label_smoothing:
        onehot = tf.one_hot(tf.cast(targets, tf.int32), tf.shape(outputs)[-1], dtype=outputs.dtype)
        losses = keras.losses.categorical_crossentropy(
            onehot, outputs, from_logits=from_logits, label_smoothing=label_smoothing)
    else:
        losses = keras.losses.sparse_categorical_crossentropy(targets, outputs,
                                                              from_logits=from_logits)
    losses = tf.cast(losses, tf.float32)
    return tf.reduce_mean(losses, axis=1) if losses.shape.rank == 2 else losses


def ends_in_softmax(model: keras.Model) -> bool:
    """Whether the model's (single) output is a softmax: its last layer is a softmax
    Activation/Softmax layer, or a layer with activation="softmax"."""
    if not model.layers or len(model.outputs or ()) > 1:
        return False
    last = model.layers[-1]
    if isinstance(last, keras.layers.Softmax):
        return True
    activation = getattr(last, "activation", None)
    return getattr(activation, "__name__", None) == "softmax"


def accuracy(logits: tf.Tensor, targets: tf.Tensor,
             topk: int | None = None) -> dict[str, tf.Tensor]:
    """Per-sample accuracy and, with more than `topk` classes, top-k accuracy ("top5",
    tf.math.in_top_k: ties count in); for sequences the mean over the positions."""
    predicted = tf.argmax(logits, axis=-1, output_type=tf.int64)
    correct = tf.cast(tf.equal(predicted, tf.cast(targets, tf.int64)), tf.float32)
    metrics = {"accuracy": correct}
    if topk is not None and logits.shape[-1] > topk:
        flat = tf.reshape(tf.cast(logits, tf.float32), [-1, logits.shape[-1]])
        hit = tf.math.in_top_k(tf.reshape(tf.cast(targets, tf.int64), [-1]), flat, topk)
        metrics[f"top{topk}"] = tf.reshape(tf.cast(hit, tf.float32), tf.shape(correct))
    return {name: tf.reduce_mean(v, axis=1) if v.shape.rank == 2 else v
            for name, v in metrics.items()}


def make_optimizer(optim, grad_clip: float | None) -> keras.optimizers.Optimizer:
    """Keras' weight_decay is decoupled (AdamW-style) for every optimizer, unlike torch's SGD
    and Adam, which add it to the gradient. SGD and Adam take None for none at all; AdamW
    requires a float, 0 included."""
    common = {"learning_rate": optim.lr, "global_clipnorm": grad_clip,
              "weight_decay": optim.weight_decay or None}
    if optim.name == "sgd":
        return keras.optimizers.SGD(momentum=optim.momentum, **common)
    beta_1, beta_2 = optim.betas
    if optim.name == "adamw":
        common["weight_decay"] = optim.weight_decay
        return keras.optimizers.AdamW(beta_1=beta_1, beta_2=beta_2, epsilon=1e-8, **common)
    return keras.optimizers.Adam(beta_1=beta_1, beta_2=beta_2, epsilon=1e-8, **common)


def _write_tf_checkpoint(checkpoint: tf.train.Checkpoint, directory: Path) -> None:
    try:
        checkpoint.write(str(Path(directory) / CHECKPOINT_PREFIX))
    except tf.errors.OpError as e:  # a full disk, a read-only directory: the I/O error
        raise OSError(e.message.strip().splitlines()[0]) from e


class TFCheckpoints:
    """The checkpoint payload of TFBackend (CheckpointBackend, train/backends/base.py): model and
    optimizer variables in one tf.train.Checkpoint (Keras keeps the dropout RNG state in the
    model's variables); a resume gives every rank rank 0's state."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    checkpoint: tf.train.Checkpoint
    sync_every: int
    _payload: dict[str, list]
    _steps_var: tf.Variable
    _local_steps: int
    _unsynced: int

    def rng_states(self) -> None:
        # Keras keeps dropout RNG state in each layer's SeedGenerator variable, so it is
        # saved with the model; nothing per rank to gather.
        return None

    def payload(self, rng_states: Any, copy: bool) -> Callable[[Path], None]:
        if self.sync_every > 1:
            self._steps_var.assign(self._local_steps)
        if not copy:
            return lambda directory: _write_tf_checkpoint(self.checkpoint, directory)
        # Host copies (numpy) of every variable's value now; the writer rebuilds the same
        # object graph (lists of variables under the same names) from them, so the checkpoint
        # reads back exactly like one written from the live variables.
        values = {name: [np.array(v.numpy(), copy=True) for v in variables]
                  for name, variables in self._payload.items()}
        steps = int(self._steps_var.numpy()) if self.sync_every > 1 else None

        def write(directory: Path) -> None:
            graph: dict[str, Any] = {name: [tf.Variable(a, trainable=False) for a in arrays]
                                     for name, arrays in values.items()}
            if steps is not None:
                graph["local_sgd_steps"] = tf.Variable(steps, dtype=tf.int64, trainable=False)
            _write_tf_checkpoint(tf.train.Checkpoint(**graph), directory)

        return write

    def read_payload(self, directory: Path) -> None:
        prefix = str(Path(directory) / CHECKPOINT_PREFIX)
        try:
            tf.train.Checkpoint(**self._payload).read(prefix).assert_existing_objects_matched()
        except (ValueError, AssertionError) as e:  # TensorFlow names the first tensor only
            raise model_mismatch(directory, [" ".join(str(e).split()).rstrip(".")]) from None
        if self.sync_every > 1:  # (absent from a sync_every: 1 checkpoint: starts at 0)
            self._steps_var.assign(0)
            tf.train.Checkpoint(local_sgd_steps=self._steps_var).read(prefix).expect_partial()

    def sync_from_root(self, resumed: bool) -> None:
        values = [v.value for v in self.model.variables + self.optimizer.variables]
        if self.sync_every > 1:
            values.append(self._steps_var)
        hvd.broadcast_variables(values, root_rank=0)
        if self.sync_every > 1:
            self._local_steps = int(self._steps_var.numpy())
            self._unsynced = 0  # every rank holds rank 0's state now


class TFReplicas:
    """What ranks average outside the gradient allreduce: Local SGD's replicas (the
    trainable variables and, with sync_optimizer_state, their optimizer slots) and
    BatchNormalization's moving statistics (train.average_bn_stats), before each
    validation and checkpoint. Part of TFBackend, which sets model, optimizer, cfg, dist,
    comm, the counters and the compiled _average."""

    def _replica_variables(self) -> list[tf.Variable]:
        """What a sync averages, in the same order on every rank: the trainable variables,
        then (with sync_optimizer_state) the optimizer's slots made for them (Keras names a
        slot `<variable path with _>_<slot>`: SGD's momentum, Adam's momentum and velocity),
        not its iteration count, learning rate or fp16 loss scale."""
        trainable = [v for v in self.model.trainable_variables]
        slots = []
        if self.cfg.train.sync_optimizer_state:
            shapes = {v.path.replace("/", "_") + "_": tuple(v.shape) for v in trainable}
            slots = [s for s in self.inner_optimizer.variables
                     if any(s.name.startswith(prefix) and tuple(s.shape) == shape
                            for prefix, shape in shapes.items())]
        return [v.value for v in trainable + slots]

    def _average_fn(self) -> None:
        variables = self._replica_variables()
        for variable, mean in zip(variables, hvd.grouped_allreduce(
                [tf.convert_to_tensor(v) for v in variables], op=hvd.Average), strict=True):
            variable.assign(mean)

    def sync_replicas(self) -> None:
        if self._bn_stale and self.cfg.train.average_bn_stats and self.dist.size > 1:
            stats = [v.value for v in self.model.non_trainable_variables
                     if v.name in ("moving_mean", "moving_variance")]  # BatchNormalization's
            if stats:
                means = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in stats],
                                              op=hvd.Average, name="ringfeed_bn_stats")
                for variable, mean in zip(stats, means, strict=True):
                    variable.assign(mean)
        self._bn_stale = False
        if self._unsynced == 0:
            return
        self._average()
        self.comm.sync(sum(int(np.prod(v.shape)) * v.dtype.size
                           for v in self._replica_variables()))
        self._unsynced = 0


class TFElastic:
    """Horovod Elastic for TFBackend: the state to commit and the retry loop."""

    def elastic_state(self, **values: Any) -> ObjectState:
        variables = self.model.variables + self.optimizer.variables
        return VariablesState([v.value for v in variables], **values)

    def elastic_run(self, fn: Callable) -> Callable:
        def reraised(state, *args, **kwargs):
            # A collective inside a tf.function fails with a TF error; Horovod's wrapper only
            # recognises some op names (not HorovodGroupedAllreduce), so say it here.
            try:
                return fn(state, *args, **kwargs)
            except tf.errors.OpError as e:
                if "Horovod" in (e.message or ""):
                    raise HorovodInternalError(e) from e
                raise

        return hvd.elastic.run(reraised)

    def after_rollback(self) -> None:
        pass


class TFBackend(TFCheckpoints, TFElastic, TFReplicas, HorovodBackend):
    name, hvd, sep = "tensorflow", hvd, "_"

    def __init__(self, cfg):
        self.start(cfg)
        # TensorFlow's pools block rather than spin: splitting them per rank measured no
        # reliably faster demo on the 2-core box, so they keep TensorFlow's sizes
        self.cpu_threads = None
        gpus = tf.config.list_physical_devices("GPU")
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        gpu = choose_gpu((hvd.cross_rank(), os.environ.get("CUDA_VISIBLE_DEVICES"), len(gpus)),
                         self.dist.rank, self.dist.local_rank, hvd.local_size(),
                         cfg.train.share_gpus, self.gpu_gather())
        if gpu is not None:
            tf.config.set_visible_devices(gpus[gpu], "GPU")

    # -- setup --------------------------------------------------------------------------------
    def build(self, spec: DataSpec, accumulate: int | None = None) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.setup_steps(spec, accumulate, (
            functools.partial(cross_entropy, label_smoothing=t.label_smoothing),
            functools.partial(accuracy, topk=t.topk)))
        self._metric_names: tuple[str, ...] = ()  # the step's training metrics (traced)
        self._bn_stale = False  # BatchNorm statistics changed since they were last averaged
        keras.mixed_precision.set_dtype_policy(POLICIES[t.precision])
        keras.utils.set_random_seed(t.seed)
        self.model = build_model("tensorflow", cfg.model.name, dict(cfg.model.args), spec)
        if cfg.model.init_from:
            load_keras(self.model, cfg.model.init_from)
        self._output_fns(cfg, spec)
        self.inner_optimizer = make_optimizer(cfg.optim, t.grad_clip)
        exempt = getattr(self.model, "no_weight_decay", None)  # the built-in gpt's rule
        if callable(exempt):
            self.inner_optimizer.exclude_from_weight_decay(var_list=exempt())
        self.optimizer = (keras.optimizers.LossScaleOptimizer(self.inner_optimizer)
                          if t.precision == "fp16" else self.inner_optimizer)
        self.optimizer.build(self.model.trainable_variables)
        self.compression = hvd.Compression.fp16 if t.fp16_allreduce else hvd.Compression.none
        # what one step's gradient allreduce hands to Horovod (fp16 compression halves it)
        self._grad_bytes = sum(int(np.prod(v.shape)) * (2 if t.fp16_allreduce
                                                         else np.dtype(v.dtype).itemsize)
                               for v in self.model.trainable_variables)
        # Explicit variable lists: a Keras 3 model is not a trackable tree of its variables
        # for tf.train.Checkpoint, and model.variables also holds the dropout RNG states.
        self._payload = {"model": [v.value for v in self.model.variables],
                         "optimizer": [v.value for v in self.optimizer.variables]}
        extra = {}
        if self.sync_every > 1:  # where the sync period stands, for an exact resume
            self._steps_var = tf.Variable(0, dtype=tf.int64, trainable=False)
            extra["local_sgd_steps"] = self._steps_var
        self.checkpoint = tf.train.Checkpoint(**self._payload, **extra)
        # Traced without AutoGraph, as Keras 3's own fit() traces its steps (do_not_convert):
        # the step's control flow is tf.cond, and a user's model, loss or metrics follow Keras
        # 3's rules. Converting the step's Python (and Horovod's) cost ~2.3 s a process.
        self._average = tf.function(self._average_fn, autograph=False)
        self._step = tf.function(self._step_fn, autograph=False)
        self._step_keys = [key for key in (spec.input_key, spec.target_key) if key]
        self._evaluate = tf.function(self._evaluate_fn, autograph=False)
        keras.utils.set_random_seed(self.rank_seed())  # per-rank stream

    def _output_fns(self, cfg: Any, spec: DataSpec) -> None:
        """The image layout the model gets (model.input_layout), and the built-in loss and
        metrics on the logits in its outputs; a classifier ending in a softmax gets the
        cross entropy of probabilities (said once, on rank 0)."""
        self.nchw = channels_first("tensorflow", cfg.model.input_layout, spec)
        t = cfg.train
        if not t.loss and spec.task != REGRESS and ends_in_softmax(self.model):
            self.loss_fn = functools.partial(probabilities_cross_entropy,
                                             label_smoothing=t.label_smoothing)
            if self.dist.is_root:
                print(f"model.name {cfg.model.name}: the model ends in a softmax, so its outputs "
                      "are taken as probabilities (cross entropy with from_logits=False)",
                      flush=True)
        if not t.loss:
            self.loss_fn = on_logits(self.loss_fn, tf.is_tensor, cfg.model.name)
        if not t.metrics:
            self.metrics_fn = on_logits(self.metrics_fn, tf.is_tensor, cfg.model.name)

    def loader(self, pipe: TrainPipeline) -> Any:
        from ringfeed.pipeline.tf import TensorLoader

        return TensorLoader(pipe)

    # -- steps --------------------------------------------------------------------------------
    def _prepare(self, batch: dict[str, Any]) -> tuple[tf.Tensor, tf.Tensor, Any]:
        x, y, valid = split_batch(batch, self.spec)
        return self._as_input(tf.convert_to_tensor(x)), tf.convert_to_tensor(y), valid

    def _as_input(self, x: tf.Tensor) -> tf.Tensor:
        if x.dtype == tf.uint8:
            x = tf.cast(x, tf.float32) / 255.0
        elif x.dtype.is_floating:
            x = tf.cast(x, tf.float32)
        # model.input_layout: nchw under TensorFlow is a transposed copy
        return tf.transpose(x, (0, 3, 1, 2)) if self.nchw else x

    def _step_fn(self, micro: list, settings: tf.Tensor) -> tf.Tensor:
        """The whole optimizer step in one graph: micro-batch gradients, one grouped allreduce
        plus the agreement allreduce of [loss, save, stop, *metrics] (negotiated together), and
        the update applied only if the averaged loss is finite. The loss holds the model's own
        losses (regularizers, add_loss), as Keras' fit adds them. Returns one small vector
        [loss, save, stop, *metrics, applied, grad norm, loss scale]: nothing else leaves the
        graph."""
        variables = self.model.trainable_variables
        self.inner_optimizer.learning_rate.assign(settings[2])
        total = None
        loss_sum = tf.constant(0.0)
        metrics_fn, totals = self.train_metrics_fn(), {}
        for batch in micro:
            x, y, _ = split_batch(batch, self.spec)
            # (the name scope marks the forward ops in a profiler trace; their gradients are
            # named gradient_tape/ringfeed_forward/...)
            mix = batch.get(MIX_KEY)  # train/mixing.py's draw, a tensor; absent: not mixed
            with tf.GradientTape() as tape, tf.name_scope("ringfeed_forward"):
                out = self.model(self._mixed(self._as_input(x), mix), training=True)
                loss = self._training_loss(out, y, mix)
                scaled = self.optimizer.scale_loss(loss)  # identity unless fp16
            if metrics_fn is not None:  # (from the outputs the step has: no second forward)
                for name, values in metrics_fn(out, y).items():
                    totals[name] = totals.get(name, 0.0) + tf.reduce_mean(
                        tf.cast(values, tf.float32))
            grads = tape.gradient(scaled, [v.value for v in variables])
            # Unused variables get zeros; embedding gradients (IndexedSlices) are made dense,
            # Horovod's sparse_as_dense, so they can be summed and reduced with the rest.
            grads = [tf.zeros_like(v.value) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(grads, variables, strict=True)]
            total = grads if total is None else [a + g for a, g in zip(total, grads, strict=True)]
            loss_sum += loss
        k = float(self.accumulate)
        reduced = [g / k for g in total]
        if self.sync_every == 1:  # (local SGD: this rank's own gradients)
            reduced = tf_reduce_gradients(reduced, self.cfg.horovod, hvd, self.compression)
        self._metric_names = tuple(totals)
        stats = hvd.allreduce(tf.concat([[loss_sum / k], settings[:2],
                                         [v / k for v in totals.values()]], 0),
                              op=hvd.Average, name="ringfeed_step_stats")
        fp16 = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        # read before the update may change it (automatic control dependencies keep the order)
        scale = tf.identity(self.optimizer.dynamic_scale.value) if fp16 else tf.constant(1.0)
        norm = tf.linalg.global_norm(reduced) if self.cfg.train.grad_clip else tf.constant(0.0)

        def apply() -> tf.Tensor:
            # LossScaleOptimizer skips the update itself when a reduced gradient is not
            # finite; the same check here reports it
            finite = (tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced])
                      if fp16 else tf.constant(True))
            with tf.name_scope("ringfeed_optimizer_step"):
                self.optimizer.apply(reduced, variables)
            return finite

        # A non-finite loss applies nothing; the loop stops the run on every rank (exit 3).
        applied = tf.cond(tf.math.is_finite(stats[STATS_LOSS]), apply,
                          lambda: tf.constant(False))
        return tf.concat([stats, [tf.cast(applied, tf.float32), norm, scale]], 0)

    def _add_mix(self, batch: dict[str, tf.Tensor], micro: int, at: MixAt) -> None:
        """Micro-batch `micro`'s MixUp/CutMix draw (train/mixing.py) into its MIX_KEY."""
        if not mixing_on(self.cfg.train):
            return
        shape = tuple(batch[self.spec.input_key].shape)
        size = shape[1:3] if len(shape) == 4 else (1, 1)
        draw = mix_draw(self.cfg.train, *mix_position(at), micro, self.dist.rank, *size)
        batch[MIX_KEY] = tf.constant(draw.vector())

    def _mixed(self, x: tf.Tensor, mix: tf.Tensor | None) -> tf.Tensor:
        return x if mix is None else mixed_tf(x, mix, spatial_axes(x.shape.rank, self.nchw))

    def _training_loss(self, out: tf.Tensor, y: tf.Tensor, mix: tf.Tensor | None = None
                       ) -> tf.Tensor:
        """The mean data loss (against MixUp/CutMix's mixed targets under `mix`) plus the
        model's own losses (regularizers, add_loss), as Keras' fit adds them; validation
        reports the data loss alone."""
        loss = tf.reduce_mean(tf.cast(mixed_loss(self.loss_fn, out, y, mix), tf.float32))
        own = self.model.losses  # (weight regularizers are taken from the weights now)
        if own:
            loss += tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in own])
        return loss

    def train_step(self, micro_batches: list[dict[str, Any]], lr: float,
                   requests: tuple[float, float] = (0.0, 0.0), span: Span = no_span,
                   at: MixAt = None) -> StepResult:
        # (`span`: the step's named ranges are name scopes inside its graph)
        started = time.perf_counter()
        keys, k = self._step_keys, self.check_accumulate(micro_batches)
        micro = [{k: tf.convert_to_tensor(b[k]) for k in keys} for b in micro_batches]
        for i, batch in enumerate(micro):
            self._add_mix(batch, i, at)
        self._bn_stale = True
        out = self._step(micro, tf.constant((*requests, lr), tf.float32)).numpy().tolist()
        stats, (applied, norm, scale) = out[:-3], out[-3:]
        if not np.isfinite(stats[STATS_LOSS]):
            return StepResult.from_stats(stats, applied=False, metric_names=self._metric_names)
        self._count_step(int(micro[0][keys[0]].shape[0]) * k)
        fp16 = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        # the collectives run inside the one compiled step: its time is counted as theirs, so
        # this rank's own work is what happens outside it
        return StepResult.from_stats(
            stats, applied=applied > 0 or not fp16, metric_names=self._metric_names,
            grad_norm=norm / scale if self.cfg.train.grad_clip else None,
            loss_scale=scale if fp16 else None, collective_s=time.perf_counter() - started)

    # -- throughput accounting (train/observe/throughput.py) ---------------------------------------
    def count_flops(self, batch: dict[str, Any]) -> FlopCount:
        """Training FLOPs per sample of the model at this batch's shape (the forward and
        gradient traced as a graph, not run)."""
        x = np.asarray(split_batch(batch, self.spec)[0])
        dtype = tf.float32 if x.dtype.kind == "f" else tf.as_dtype(x.dtype)  # as _as_input
        shape = np.transpose(x, (0, 3, 1, 2)).shape if self.nchw else x.shape
        return count_tf_flops(self.model, shape, dtype)

    def accounting_device(self) -> tuple[str | None, str]:
        """(this rank's GPU name, or None on CPU; the dtype its matmuls run in): fp32 counts
        as tf32 while TensorFlow allows TF32 (its default)."""
        precision = self.cfg.train.precision
        if precision == "fp32" and tf.config.experimental.tensor_float_32_execution_enabled():
            precision = "tf32"
        gpus = tf.config.get_visible_devices("GPU")
        if not gpus:
            return None, precision
        details = tf.config.experimental.get_device_details(gpus[0])
        return details.get("device_name", "an unnamed GPU"), precision

    def _evaluate_fn(self, x, y):
        out = self.model(x, training=False)
        return {"loss": tf.cast(self.loss_fn(out, y), tf.float32),
                **{k: tf.cast(v, tf.float32) for k, v in self.metrics_fn(out, y).items()}}

    def eval_batch(self, batch: dict[str, Any], groups: Groups | None = None
                   ) -> dict[str, float]:
        x, y, valid = self._prepare(batch)
        n = int(y.shape[0])
        per_sample = {k: np.broadcast_to(v.numpy(), (n,)).astype(np.float64)
                      for k, v in self._evaluate(x, y).items()}
        valid = None if valid is None else np.asarray(valid, dtype=np.float64)
        return metric_sums(per_sample, valid, lambda v: float(np.sum(v)), groups, lambda m: m)

    def allreduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        summed = hvd.allreduce(tf.constant(list(values.values()), tf.float64), op=hvd.Sum,
                               name="ringfeed_sums")
        return dict(zip(values, summed.numpy().tolist(), strict=True))

    def weights(self) -> list[Any]:
        return [v.numpy().copy() for v in self.model.weights]


class VariablesState(ObjectState):
    """Horovod elastic state over a list of tf.Variables (model and optimizer), plus plain
    values. Horovod's TensorFlowState broadcasts the variables when it is *constructed*, a
    collective that a worker joining a running job would enter alone, and in eager mode its
    sync() does not broadcast them at all; this one broadcasts in sync()."""

    def __init__(self, variables: list[tf.Variable], **values: Any):
        self.variables = variables
        self._save_variables()
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0),
                         get_rank=hvd.rank, **values)

    def _save_variables(self) -> None:
        self._saved_values = [v.numpy() for v in self.variables]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._saved_values, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        hvd.broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()
