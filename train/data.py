"""From config to batches: the pipelines a run reads, and what the model is fed.

`DataSpec` says what the model sees (task, input field and shape, classes or vocabulary);
it is inferred from the manifest and one peeked sample, so a config rarely has to name fields.
Tables (`ringfeed shard --format csv|jsonl|parquet`) need nothing named: the input is the
features vector, the task comes from the target's type (an integer class id: classify; a float:
regress, with an MSE loss), the classes from the manifest, and with `data.normalize: auto` the
features are standardised with the train split's mean/std the manifest records.
`split_batch` turns a pipeline batch into (inputs, targets, valid mask); it slices (and
standardises tabular inputs), so it works on numpy arrays, torch tensors and tf tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ringfeed.errors import UserError

if TYPE_CHECKING:  # (type hints only: the pipeline is imported when one is made)
    from ringfeed.formats.manifest import Manifest
    from ringfeed.pipeline.config import PipelineConfig
    from ringfeed.pipeline.mixture import Mixture

CLASSIFY, LM, REGRESS = "classify", "lm", "regress"
TARGET_NAMES = ("y", "label", "labels", "target", "targets", "cls")


class TrainPipeline(Protocol):
    """What the trainer needs of a pipeline (ringfeed.pipeline.ShardPipeline is one): the loop
    its epochs and position, the checkpointer and elastic commits its state, the reporter its
    mixture, example batch and counters, the backends a source for their loaders."""

    @property
    def config(self) -> PipelineConfig: ...  # batch size, loader workers: the backends' loaders
    @property
    def manifest(self) -> Manifest | None: ...  # fields, classes, text: infer_spec()
    @property
    def mixture(self) -> Mixture | None: ...  # a weighted mixture's sources and weights
    @property
    def source_names(self) -> list[str]: ...
    @property
    def epoch(self) -> int: ...
    @property
    def batches_per_epoch(self) -> int: ...
    @property
    def batches_remaining(self) -> int: ...  # of the current epoch, on this rank

    def set_epoch(self, epoch: int) -> None: ...
    def expect_next_epoch(self, expected: bool) -> None: ...  # read it ahead, or not
    def source_of(self, ids: Any) -> tuple[np.ndarray, np.ndarray]: ...  # (source, local id)
    def state_dict(self) -> dict[str, Any]: ...  # its position, for checkpoints and commits
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def stats(self) -> dict[str, Any]: ...  # counters: storage retries and waits, ...
    def example_batch(self) -> dict[str, Any]: ...  # a batch of the real shapes
    def close(self) -> None: ...


@dataclass(frozen=True)
class DataSpec:
    task: str  # "classify" (input -> class), "regress" (input -> numbers), "lm" (tokens -> next)
    input_key: str
    target_key: str | None  # None for lm: targets are the inputs shifted by one
    input_shape: tuple[int, ...]  # one sample, as the model sees it
    # classify: the number of classes; regress: the number of target values (the model's output
    # width either way, which is what the built-in models read)
    num_classes: int | None = None
    vocab_size: int | None = None
    # data.normalize: auto on a table's features: split_batch gives (x - mean) / std
    input_mean: tuple[float, ...] | None = None
    input_std: tuple[float, ...] | None = None
    # regress: the target's train-split mean/std; the loss compares the model's output with the
    # standardised target (so the default optimizer settings suit any target scale) and the
    # metrics report errors of `output * std + mean`, in the target's units
    target_mean: tuple[float, ...] | None = None
    target_std: tuple[float, ...] | None = None

    def require(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            hint = ("set model.args.num_classes, or shard with class names"
                    if name == "num_classes" else "shard text with `ringfeed shard --format text`")
            raise UserError(f"model: cannot infer {name} from the data ({hint})")
        return int(value)


def make_pipeline(cfg, split: str, rank: int, world_size: int):
    """The ShardPipeline for `split` ("train" or "val") of this rank, read as
    cfg.to_pipeline_config(split) says (the data section's options, with what differs between
    training and validation), its images of the run's channel count (run_channels)."""
    from ringfeed.pipeline import ShardPipeline

    training = split == "train"
    source = cfg.data.train if training else cfg.val_source
    if not training and not isinstance(source, str):
        # a mixture is validated on every val sample of every source once (no weights), with
        # the train mixture's names so the per-source metrics line up
        from ringfeed.pipeline.mixture import source_names

        source = [{"path": s.path, "name": name}
                  for s, name in zip(source, source_names(source), strict=True)]
    return ShardPipeline(source, cfg.to_pipeline_config(split), rank=rank,
                         world_size=world_size, channels=run_channels(cfg))


# how many of the train split's first images decide a run's channel count (run_channels): a grey
# photo among colour ones is common (ImageNet: ~1 in 400), a grey set's first 32 all grey
CHANNEL_PROBE = 32


def run_channels(cfg) -> int | None:
    """The channel count every image of a run is converted to, one for both splits, so the
    model's input has one shape in every batch (a batch of only grey photos in a colour set, a
    colour image in a grey one): data.channels; 3 with data.augment or data.val_augment; else
    the train split's first images' (CHANNEL_PROBE of them, in manifest order): 1 when all
    are grey, else 3, so a colour set whose first image is grey stays in colour. None: the
    samples hold no image, or the user's data.decode (or the GPU) decodes them."""
    from ringfeed.pipeline import ShardPipeline

    d = cfg.data
    if d.channels is not None:
        return d.channels
    if d.augment is not None or d.val_augment is not None:
        return 3
    if d.decode is not None or d.decode_device != "cpu":
        return None
    # rank 0 of 1: the first sample in manifest order, every rank's; without the user's
    # transform and normalize, so the decoded image itself is looked at
    probe = ShardPipeline(d.train, cfg.to_pipeline_config("train"), rank=0, world_size=1,
                          transform=None, normalize=None)
    try:
        samples = probe.peek_samples(CHANNEL_PROBE)
        counts = {sample[name].shape[-1] for sample in samples
                  for name in probe.decoder.image_fields(sample)}
    finally:
        probe.close()
    if not counts or not counts <= {1, 3}:
        return None
    return 3 if 3 in counts else 1


def infer_spec(cfg, pipe: TrainPipeline) -> DataSpec:
    """Fields from the config or the manifest; shapes from the pipeline's first sample
    (data.synthetic: the config's, synthetic_spec)."""
    if isinstance(pipe, SyntheticPipeline):
        return pipe.spec
    manifest = pipe.manifest
    batch = pipe.example_batch()
    fields = {k: v for k, v in batch.items() if not k.startswith("__")}
    kinds = dict(manifest.fields) if manifest is not None else {}
    text = manifest.text if manifest is not None else None
    columns = (getattr(manifest, "features", None) or {}) if manifest is not None else {}
    input_key = cfg.data.input_key or _guess_input(fields, kinds, text, columns)
    if input_key not in fields:
        raise UserError(f"data.input_key: {input_key!r} is not in the batches "
                        f"(fields: {', '.join(fields)})")
    sample_shape = tuple(np.asarray(fields[input_key]).shape[1:])
    if text is not None and cfg.data.target_key is None and input_key.startswith("tokens"):
        # Token rows, or windows of flat token shards (data.seq_len + 1 ids), hold seq_len + 1
        # ids (or seq_len): inputs t[:-1] predict targets t[1:].
        return DataSpec(LM, input_key, None, (sample_shape[0] - 1,),
                        vocab_size=int(text["vocab_size"]))
    target_key = cfg.data.target_key or _guess_target(fields, kinds, input_key, columns)
    target = np.asarray(fields[target_key])
    task = cfg.train.task if cfg.train.task != "auto" else (
        REGRESS if target.dtype.kind == "f" else CLASSIFY)  # float targets are quantities
    stats = _standardise(cfg, columns.get(input_key), sample_shape)
    if task == REGRESS:
        outputs = int(np.prod(target.shape[1:], dtype=np.int64)) or 1
        entry = columns.get(target_key) or {}
        target_stats = ((tuple(entry["mean"]), tuple(s or 1.0 for s in entry["std"]))
                        if entry.get("mean") is not None and len(entry["mean"]) == outputs
                        else (None, None))
        return DataSpec(REGRESS, input_key, target_key, sample_shape,
                        num_classes=cfg.model.args.get("num_classes") or outputs,
                        input_mean=stats[0], input_std=stats[1],
                        target_mean=target_stats[0], target_std=target_stats[1])
    return DataSpec(CLASSIFY, input_key, target_key, sample_shape,
                    num_classes=cfg.model.args.get("num_classes")
                    or _num_classes(manifest, target_key, columns),
                    input_mean=stats[0], input_std=stats[1])


def _num_classes(manifest, target_key: str, columns: dict[str, Any]) -> int | None:
    """From the manifest: class names, the class ids seen (`classes`), or an integer target
    column's largest value."""
    if manifest is None:
        return None
    if manifest.class_names:
        return len(manifest.class_names)
    classes = getattr(manifest, "classes", None) or {}
    if classes.get("num_classes") and classes.get("field", "cls") == target_key:
        return int(classes["num_classes"])
    entry = columns.get(target_key) or {}
    if entry.get("vocabulary"):
        return len(entry["vocabulary"])
    if entry.get("max") is not None and str(entry.get("dtype", "")).startswith("int"):
        return int(entry["max"]) + 1
    return None


def _standardise(cfg, entry: dict[str, Any] | None, shape: tuple[int, ...]
                 ) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """(mean, std) for data.normalize: auto on a table's features; a constant feature (std 0)
    is only centred."""
    if cfg.data.normalize != "auto" or not entry or entry.get("mean") is None:
        return None, None
    if len(shape) != 1 or len(entry["mean"]) != shape[0]:  # a vector, as tables make
        return None, None
    return tuple(entry["mean"]), tuple(s or 1.0 for s in entry["std"])


def _guess_input(fields: dict[str, Any], kinds: dict[str, str], text,
                 columns: dict[str, Any]) -> str:
    if text is not None:
        tokens = [k for k in fields if k.startswith("tokens")]
        if tokens:
            return tokens[0]
    for k in fields:  # a table's features vector
        if (columns.get(k) or {}).get("role") == "features":
            return k
    for k in fields:
        if kinds.get(k) == "image" or (np.asarray(fields[k]).ndim == 4 and k not in kinds):
            return k
    for k in fields:
        stem = k.split(".")[0]
        if stem not in TARGET_NAMES and np.asarray(fields[k]).dtype != object:
            return k
    raise UserError(f"data.input_key: cannot infer the input field from {', '.join(fields)} "
                    "(set data.input_key)")


def _guess_target(fields: dict[str, Any], kinds: dict[str, str], input_key: str,
                  columns: dict[str, Any]) -> str:
    for k in fields:
        if k != input_key and (kinds.get(k) == "int" or k.split(".")[0] in TARGET_NAMES):
            return k
    numeric = [k for k in fields if k != input_key and (columns.get(k) or {}).get("role")
               == "field" and (columns[k].get("mean") is not None or columns[k].get("vocabulary"))]
    if len(numeric) == 1:  # a table's one numeric --field that is not the input
        return numeric[0]
    raise UserError(f"data.target_key: cannot infer the target field from {', '.join(fields)} "
                    "(set data.target_key)")


def split_batch(batch: dict[str, Any], spec: DataSpec) -> tuple[Any, Any, Any]:
    """(inputs, targets, valid) from one pipeline batch; valid is None when absent."""
    valid = batch.get("__valid__")
    x = batch[spec.input_key]
    if spec.task == LM:
        return x[:, :-1], x[:, 1:], valid
    if spec.input_mean is not None:
        x = standardised(x, spec.input_mean, spec.input_std)
    y = batch[spec.target_key]
    if len(y.shape) == 2 and y.shape[1] == 1:  # per-sample labels stored as shape (1,)
        y = y[:, 0]
    return x, y, valid


def standardised(x: Any, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """(x - mean) / std in float32 over the last axis, for a numpy array, a torch tensor (on its
    device) or a tf tensor (eager or in a tf.function)."""
    mean_ = np.asarray(mean, np.float32)
    scale = (1.0 / np.asarray(std, np.float64)).astype(np.float32)
    if isinstance(x, np.ndarray):
        return (x.astype(np.float32) - mean_) * scale
    if type(x).__module__.startswith("torch"):
        import torch

        return (x.float() - torch.from_numpy(mean_).to(x.device)) * torch.from_numpy(scale).to(
            x.device)
    import tensorflow as tf

    return (tf.cast(x, tf.float32) - mean_) * scale


# data.synthetic: the spec when the config leaves it out, as Horovod's
# pytorch_synthetic_benchmark.py has it (3 x 224 x 224 images, 1000 classes)
SYNTHETIC_IMAGE_SIZE = 224
SYNTHETIC_CLASSES = 1000


def synthetic_spec(cfg) -> DataSpec:
    """data.synthetic's spec from the config alone: images of data.image_size (224) x
    data.channels (3), model.args.num_classes (1000) classes."""
    size = cfg.data.image_size or SYNTHETIC_IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else size
    classes = cfg.model.args.get("num_classes") or SYNTHETIC_CLASSES
    return DataSpec(CLASSIFY, "jpg", "cls", (int(height), int(width), cfg.data.channels or 3),
                    num_classes=int(classes))


class SyntheticPipeline:
    """data.synthetic: one batch of this rank's, standard-normal pixels and uniform class ids
    of the spec's shape, made once (on the training device by `loader()`) and trained on at
    every step, so a run measures the model and the allreduce with the input taken away. An
    epoch is the whole run (train.max_steps steps); its position is all a checkpoint holds of
    it, so a synthetic run resumes like any other. A TrainPipeline (no manifest, no mixture,
    no validation split)."""

    manifest = None
    mixture = None

    def __init__(self, cfg, rank: int, world_size: int):
        self.spec = synthetic_spec(cfg)
        self.batch_size, self.rank, self.seed = cfg.data.batch_size, rank, cfg.train.seed
        self.samples_per_step = cfg.data.batch_size * cfg.train.accumulate  # per rank
        self.batches_per_epoch = cfg.train.max_steps * cfg.train.accumulate
        self.epoch, self.consumed = 0, 0
        self._batch: dict[str, np.ndarray] | None = None

    @property
    def config(self) -> None:  # (no pipeline options: nothing is read)
        return None

    @property
    def source_names(self) -> list[str]:
        return []

    @property
    def batches_remaining(self) -> int:
        return self.batches_per_epoch - self.consumed

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.consumed = epoch, 0

    def expect_next_epoch(self, expected: bool) -> None:
        pass  # (nothing to read ahead)

    def source_of(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids)
        return np.zeros_like(ids), ids

    def state_dict(self) -> dict[str, Any]:
        return {"synthetic": True, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("synthetic"):
            raise UserError("data.synthetic: this checkpoint was trained on shards; resume it "
                            "without data.synthetic, or start the synthetic run elsewhere "
                            "(output.dir or --resume none)")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])

    def stats(self) -> dict[str, Any]:
        return {}

    def example_batch(self) -> dict[str, Any]:
        """The batch every step trains on, as numpy arrays (made at the first call)."""
        if self._batch is None:
            rng = np.random.default_rng((self.seed, self.rank))
            n = self.batch_size
            self._batch = {
                "jpg": rng.standard_normal((n, *self.spec.input_shape), dtype=np.float32),
                "cls": rng.integers(0, self.spec.num_classes, n, dtype=np.int64),
                "__index__": np.arange(self.rank * n, (self.rank + 1) * n, dtype=np.int64),
                "__valid__": np.ones(n, dtype=bool)}
        return self._batch

    def loader(self, backend: Any, framework: str) -> SyntheticLoader:
        """The loader over the example batch, its inputs and targets copied to the training
        device once: torch's backend.device, TensorFlow's first GPU when it sees one."""
        batch = dict(self.example_batch())
        fields = (self.spec.input_key, self.spec.target_key)
        if framework == "torch":
            import torch

            device = getattr(backend, "device", torch.device("cpu"))
            batch.update({k: torch.from_numpy(batch[k]).to(device) for k in fields})
        else:
            import tensorflow as tf

            gpus = tf.config.list_logical_devices("GPU")
            with tf.device(gpus[0].name if gpus else "/CPU:0"):
                batch.update({k: tf.identity(tf.constant(batch[k])) for k in fields})
        return SyntheticLoader(self, batch)

    def close(self) -> None:
        self._batch = None


class SyntheticLoader:
    """Every iter() hands out the one device batch for what is left of the pipeline's epoch,
    each counted as consumed when handed out (as the pipelines' loaders count theirs)."""

    def __init__(self, pipe: SyntheticPipeline, batch: dict[str, Any]):
        self.pipe, self.batch = pipe, batch

    def __iter__(self):
        while self.pipe.batches_remaining > 0:
            self.pipe.consumed += 1
            yield self.batch
