"""The `ringfeed train` config: schema with defaults, YAML + `--set a.b=value` overrides, and
up-front validation.

Everything here runs before Horovod, torch or TensorFlow is imported, so a bad config costs
about a second and prints one line (`ringfeed: error: ...`, exit 2) on every rank instead of a
traceback after the ranks have started.

Relative paths (data, checkpoint and output dirs) are resolved against the current directory,
as the shell would.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from ringfeed.errors import UserError
from ringfeed.formats.manifest import MANIFEST_NAME, ManifestError
from ringfeed.formats.manifest_index import ManifestIndex, load_index
from ringfeed.pipeline.config import (
    PipelineConfig,
    WeightedSource,
    augment_for,
    canonical_rule_error,
    pipeline_config,
)
from ringfeed.train.backends.horovod_env import launch_problem
from ringfeed.train.checkpoint.files import refuse_earlier_run
from ringfeed.train.checkpoint.store import is_remote
from ringfeed.train.observe.runfiles import checkpoint_dir
from ringfeed.userhooks import IMPORT_PATH

BUILTIN_MODELS = ("mlp", "cnn", "gpt")


class _Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _import_path_or_none(value: str | None, field: str) -> str | None:
    if value is not None and not IMPORT_PATH.match(value):
        raise ValueError(f"{field} must be an import path 'module:function', got {value!r}")
    return value


class ModelSection(_Section):
    name: str = "mlp"  # mlp | cnn | gpt | "package.module:function"
    args: dict[str, Any] = Field(default_factory=dict)
    # How image batches (samples of shape height x width x channels) reach the model. auto: the
    # framework's convention - torch models get (N, C, H, W), a channels_last view of the
    # pipeline's NHWC batch (no copy), TensorFlow/Keras models (N, H, W, C); nchw / nhwc:
    # that layout whatever the framework (TensorFlow's nchw is a transposed copy).
    input_layout: Literal["auto", "nchw", "nhwc"] = "auto"
    # Weights to start from (train/backends/init_weights.py): a torch state_dict file (or one
    # under "model"/"state_dict"), a Keras .weights.h5; read by every rank, checked against
    # the model (one line for a mismatch). A resumed run takes its checkpoint's instead.
    init_from: str | None = None
    # BatchNorm with the batch statistics of all ranks (each forward pass allreduces the
    # per-channel sums; torchvision's --sync-bn): torch only, Horovod's SyncBatchNorm on GPUs
    # and ringfeed's (train/backends/sync_bn.py) on CPUs, where Horovod's refuses to run.
    # Keras 3 has no Horovod SyncBatchNormalization: a tensorflow run refuses it
    sync_batchnorm: bool = False

    @field_validator("name")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v not in BUILTIN_MODELS and not IMPORT_PATH.match(v):
            raise ValueError(
                f"unknown model {v!r} (built-in: {', '.join(BUILTIN_MODELS)}; "
                "or a user model as 'module:function')"
            )
        return v


class NormalizeSection(_Section):
    mean: list[float]
    std: list[float]


def _source_kind(value: Any) -> str:
    return "<mixture>" if isinstance(value, list) else "<path>"


# One source (a path, URL or brace pattern) or a mixture; the tag names which one, so a bad
# entry is reported for that form only (tags in angle brackets are left out of error lines).
SourceSpec = Annotated[Annotated[str, Tag("<path>")] | Annotated[list[WeightedSource],
                                                                  Tag("<mixture>")],
                       Discriminator(_source_kind)]


# PipelineConfig's keys that a run sets from elsewhere, and where
RUN_OWNED_DATA_KEYS = {"split": "data.train_split and data.val_split",
                       "seed": "train.seed (one seed for the model and the data order)",
                       "read_ahead": "nothing: the loop reads ahead while the run goes on"}
RUN_SPLITS = ("train", "val")


class DataSection(PipelineConfig):
    """The pipeline's options (ringfeed.pipeline.PipelineConfig: every key declared there) plus
    what a run adds: where train and val data are, the global batch and the model's fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # a shard dir/URL with manifest.json, or a list/brace pattern of shard URLs, or a weighted
    # mixture: a list of {path, weight} (pipeline/mixture.py); required unless `synthetic`
    train: SourceSpec | None = None
    # No data: one random batch of data.image_size (224) x data.channels (3) images and
    # model.args.num_classes (1000) class ids, made once on the device and trained on at every
    # step (Horovod's pytorch_synthetic_benchmark); data.train, when set, is not read. Needs
    # train.max_steps (one epoch is the run); no validation; the summary's `synthetic` holds
    # samples/s per rank with its 95% interval over the timed steps. The model's speed with
    # the input taken away: the bound a run from shards is compared with
    synthetic: bool = False
    val: SourceSpec | None = None  # default: `train`'s sources (`val_split`)
    train_split: str = "train"
    val_split: str | None = "val"  # null: no validation
    # optimizer steps whose batches are read but not trained on (the step counts, weights and
    # optimizer stay): a spike's steps left out on a rerun from the checkpoint before them
    skip_steps: list[PositiveInt] = Field(default_factory=list)
    # samples per rank in each validation batch (no gradients: often larger); null: batch_size
    val_batch_size: PositiveInt | None = None
    input_key: str | None = None  # default: inferred from the manifest's fields
    target_key: str | None = None
    # A run's defaults differ from a bare pipeline's for these two:
    # images: {mean, std} per channel of x / 255; "auto": a table's features are standardised
    # with the train split's mean/std from the manifest (images are left as they are); null: off
    normalize: NormalizeSection | Literal["auto"] | None = "auto"
    # "auto": on when the split's decoded samples fit cache_limit (the pipeline decides)
    decoded_cache: bool | str = "auto"

    def to_pipeline_config(self, split: str, seed: int = 0, accumulate: int = 1
                           ) -> PipelineConfig:
        """The PipelineConfig that reads the run's `split` ("train" or "val"): this section's
        pipeline keys, with what a run decides itself (the manifest split, the seed, the
        split's augmentation, shuffling, the epoch's tail, normalize, read-ahead, a mixture's
        epoch_samples). Pure: the section is not changed.
        (`ShardPipeline(source, data.to_pipeline_config("train"))`.)"""
        if split not in RUN_SPLITS:
            raise ValueError(f"split must be one of {RUN_SPLITS}, got {split!r}")
        training = split == "train"
        if not training and self.val_split is None:
            raise UserError("data.val_split: null (no validation), so there is no val pipeline")
        normalize = self.normalize
        keys = {k: getattr(self, k) for k in PipelineConfig.model_fields}
        keys.update(
            split=self.train_split if training else self.val_split,
            seed=seed,  # the order and each sample's augmentation: (seed, epoch, key)
            # the split's stages: val_augment, or the eval preset when augment crops at random
            augment=augment_for(self, training),
            shuffle=self.shuffle and training,
            # Validation pads instead of dropping: every sample is scored once, the padding is
            # masked out by __valid__, and all ranks still run the same number of batches.
            balance=self.balance if training else "pad",
            # (auto: tables are standardised by split_batch; images are left as they are)
            normalize=(None if normalize is None or normalize == "auto"
                       else (normalize.mean, normalize.std)),
            read_ahead=training,  # the loop says when no next epoch is coming
            epoch_samples=self.epoch_samples if training else None,
            # validation is in the rank order (it pads); global_batch_size is per optimizer
            # step, the pipeline's per batch: k micro-batches make a step
            order=self.order if training else "rank",
            global_batch_size=(self.global_batch_size // accumulate
                               if training and self.global_batch_size else None),
            skip=self.skip if training else None,
            random_windows=self.random_windows and training,  # (validation: the same windows)
            batch_size=self.batch_size if training else self.val_batch_size or self.batch_size,
        )
        return pipeline_config(None, keys)


class OptimSection(_Section):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: PositiveFloat = 0.01  # for one rank and one micro-batch; see scale_lr_with_world_size
    momentum: float = Field(0.9, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    # Horovod's linear scaling rule (pytorch_imagenet_resnet50.py): the peak lr is
    # lr * world_size * accumulate, i.e. proportional to the global batch.
    scale_lr_with_world_size: bool = True
    # Linear warmup to the peak over the first warmup_steps optimizer steps or warmup_epochs
    # epochs (one of the two; epochs become steps at this world size's steps per epoch)
    warmup_steps: NonNegativeInt = 0
    warmup_epochs: NonNegativeFloat = 0.0
    # where the warmup starts: zero (nanoGPT, torchtitan), or one_rank: the rate before
    # world-size scaling, lr x accumulate (Horovod's ImageNet examples: lr -> lr x ranks)
    warmup_start: Literal["zero", "one_rank"] = "zero"
    # after the warmup: constant; cosine down to min_lr_ratio x peak at the last step;
    # multistep: x gamma at each of `milestones` (torch's MultiStepLR)
    schedule: Literal["constant", "cosine", "multistep"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # cosine floor, as a fraction of the peak
    # multistep: the epochs (counted from 0, as MultiStepLR's) from which the rate is x gamma
    # once more, increasing: [30, 60, 80] decays in the 31st, 61st and 81st epochs
    milestones: list[PositiveFloat] = Field(default_factory=list)
    gamma: PositiveFloat = 0.1  # multistep's factor at each milestone

    @model_validator(mode="after")
    def _one_schedule(self) -> OptimSection:
        if self.warmup_steps and self.warmup_epochs:
            raise ValueError("set warmup_steps or warmup_epochs, not both")
        if (self.schedule == "multistep") != bool(self.milestones):
            raise ValueError("multistep needs optim.milestones (epochs, e.g. [30, 60, 80]); "
                             "milestones are for schedule: multistep only")
        if self.milestones != sorted(set(self.milestones)):
            raise ValueError(f"milestones must increase, got {self.milestones}")
        return self


class ProfileSection(_Section):
    """Profile steps start_step .. start_step + steps - 1 (counted from 1, as metrics.jsonl
    counts them) on `ranks`: a torch or TensorFlow profiler trace in <output.dir>/profile/rank<r>/
    plus Horovod's timeline of the same steps (train/observe/profiler.py)."""

    start_step: PositiveInt = 5  # after the first steps' tracing and warm-up
    steps: PositiveInt = 5
    ranks: list[NonNegativeInt] = Field(default_factory=lambda: [0])


class TrainSection(_Section):
    epochs: PositiveInt | None = 1
    max_steps: PositiveInt | None = None  # optimizer steps; wins over epochs when set
    accumulate: PositiveInt = 1  # micro-batches per optimizer step (one allreduce per step)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: PositiveFloat | None = None  # max global L2 norm of the averaged gradient
    seed: int = 0
    fp16_allreduce: bool = False  # compress gradients to fp16 for the allreduce
    # torch: keep 4-D weights in NHWC memory (what tensor cores want for convolutions); the
    # allreduce and broadcasts go through contiguous buffers. Keras layers are NHWC already.
    channels_last: bool = False
    # torch: run the model through torch.compile (TorchInductor). Checkpoints hold the plain
    # module's weights, so compiled and eager runs resume each other's checkpoints.
    compile: bool = False
    # More ranks on a host than GPUs it shows them: an error (exit 2) unless this is set, then
    # ranks share GPUs round-robin (for debugging; each rank then holds its own model copy).
    share_gpus: bool = False
    log_every: PositiveInt = 10
    # end the run after this optimizer step; the lr schedule still plans the whole run
    # (max_steps or epochs): what `ringfeed replay` sets
    stop_after_step: PositiveInt | None = None
    val_every: PositiveInt | None = None  # steps; null: at the end of every epoch
    # batches per rank each validation reads, the first of the val split (the same ones every
    # time, on every rank the same count: nanoGPT's eval_iters, torchtitan's validation
    # steps); null: the whole split
    val_steps: PositiveInt | None = None
    loss: str | None = None  # "module:function"(outputs, targets) -> per-sample losses
    metrics: str | None = None  # "module:function"(outputs, targets) -> {name: per-sample}
    # auto: regress (MSE loss; val mse/mae) when the target is a float, else classify (cross
    # entropy; val accuracy); an integer target can be regressed with `regress`
    task: Literal["auto", "classify", "regress"] = "auto"
    # The built-in cross entropy against targets smoothed to (1 - s) on the class and s / C on
    # every class (torch's CrossEntropyLoss(label_smoothing=s), Keras' CategoricalCrossentropy
    # (label_smoothing=s)); training and validation loss alike
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    # MixUp (torchvision's v2.MixUp, its reference recipe's --mixup-alpha): each training
    # micro-batch (each one of an accumulated step) blended with itself rolled by one sample,
    # lam ~ Beta(a, a), its targets (one-hot, label_smoothing applied) alike; within each rank's
    # micro-batch, as the reference mixes per process; validation never. Classification only;
    # draws from (seed, epoch, step, micro-batch, rank): a resume mixes alike. 0: off
    # (train/mixing.py)
    mixup_alpha: float = Field(0.0, ge=0.0)
    # CutMix (v2.CutMix, --cutmix-alpha), images only, alike: a box of the rolled micro-batch
    # pasted in, lam its complement's share. With mixup_alpha too: one of the two per
    # micro-batch, 50/50 (the reference's RandomChoice). 0: off
    cutmix_alpha: float = Field(0.0, ge=0.0)
    # top-k accuracy ("top5") beside accuracy, in training and validation, where the model has
    # more than k classes; null: off
    topk: PositiveInt | None = 5
    # BatchNorm running statistics (torch running_mean/var, Keras moving_mean/variance)
    # averaged over ranks, in place, before every validation and checkpoint (timm's --dist-bn
    # reduce): all ranks validate with the statistics a checkpoint holds; false: each rank
    # keeps its own and a checkpoint holds rank 0's
    average_bn_stats: bool = True
    # Local SGD: each rank takes this many optimizer steps on its own gradients (no gradient
    # allreduce), then the parameters are averaged across ranks with one allreduce. 1: today's
    # synchronous training, one gradient allreduce per step, unchanged.
    sync_every: PositiveInt = 1
    # With sync_every > 1: average the optimizer's per-parameter moments too (SGD momentum,
    # Adam's two moments), so after every sync all ranks hold the same complete state (a
    # checkpoint is the job's state; a resume is exact). Costs (1 + moments) x the parameter
    # bytes per sync; false sends the parameters only and each rank keeps its own moments.
    sync_optimizer_state: bool = True
    # One device's peak TFLOP/s for MFU (model FLOPs utilisation); null: ringfeed's table of
    # GPUs by name and precision (train/observe/throughput.py), none on CPU
    peak_tflops: PositiveFloat | None = None
    profile: ProfileSection | None = None  # null: off (`ringfeed train --profile`: defaults)
    # The hang watchdog (train/resilience/watchdog.py): no rank making progress for this long
    # ends the job with every live rank's stacks in <output.dir>/hang/, one line naming the
    # stopped rank(s), exit 76 (restartable). null: off (and Horovod's Gloo timeout left alone).
    # Off in elastic runs, where Horovod Elastic handles a lost worker.
    hang_timeout_s: PositiveFloat | None = 300.0
    # Added to hang_timeout_s at start-up (restore), the first step (tracing, compiling),
    # validation, checkpoints and the end (a long checkpoint write on rank 0)
    hang_grace_s: NonNegativeFloat = 600.0
    # A rank whose heartbeats stop for this long (its host lost without a TCP reset, the
    # process stopped; a live rank's watchdog thread beats whatever its main thread does) ends
    # the job as a hang does, the line naming it and its host. Below hang_timeout_s; at least
    # 1 s (a beat every tenth of the shorter bound, 0.2 s at least); null: 15 s, or no bound of
    # its own when hang_timeout_s is not longer. While any rank restores, checkpoints or
    # finishes (a live process may hold the GIL then) silence waits hang_timeout_s.
    silent_timeout_s: float | None = Field(None, ge=1.0)
    # The slowest rank is named in the log when its own work per step (step time less the time
    # in the step's collective) exceeds the median rank's by this fraction of the step time
    straggler_margin: PositiveFloat = 0.2

    @field_validator("loss", "metrics")
    @classmethod
    def _hook(cls, v: str | None, info) -> str | None:
        return _import_path_or_none(v, f"train.{info.field_name}")

    @model_validator(mode="after")
    def _silence_below_hang(self) -> TrainSection:
        # silence past hang_timeout_s is a hang already: a longer silent bound would never act
        if self.hang_timeout_s is not None and self.silent_timeout_s is not None \
                and self.silent_timeout_s >= self.hang_timeout_s:
            raise ValueError(f"silent_timeout_s ({self.silent_timeout_s:g}) must be below "
                             f"hang_timeout_s ({self.hang_timeout_s:g}): lower it or raise "
                             "hang_timeout_s")
        return self


class CheckpointSection(_Section):
    # (`async` is a Python keyword: the attribute is async_write, the YAML key `async`)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    # a local path or any fsspec URL (s3://bucket/run/checkpoints, gs://...); default:
    # <output.dir>/checkpoints
    dir: str | None = None
    # fsspec options for a remote dir (and a checkpoint URL given as resume), as
    # data.storage_options: endpoint_url, key, secret, ...
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # true: every rank copies what it saves to host memory and training goes on while rank 0's
    # background thread writes it (one write at a time; the next save, SIGTERM and the end
    # wait for it)
    async_write: bool = Field(False, alias="async")
    every_steps: PositiveInt | None = None  # plus one at the end of the run
    # also at the end of every N-th epoch (after its validation), as Horovod's examples save
    # one every epoch
    every_epochs: PositiveInt | None = None
    keep: PositiveInt = 3
    save_on_signal: bool = True  # SIGTERM: save and exit 143; SIGUSR1: save and go on
    resume: str = "none"  # none | auto (newest complete checkpoint) | a checkpoint path/URL
    # A checkpoint that cannot be written (disk full, unwritable dir): fail = stop with exit 4;
    # warn = log it and train on without that checkpoint (the summary counts the failures).
    on_error: Literal["fail", "warn"] = "fail"


class ElasticSection(_Section):
    """Horovod Elastic (`ringfeed train --elastic` under `horovodrun --min-np/--max-np
    --host-discovery-script`): see train/RECOVERY.md."""

    enabled: bool = False
    # The in-memory commit (model, optimizer, pipeline position) that a worker failure rolls
    # back to: at most this many steps are redone after one.
    commit_every_steps: PositiveInt = 10


class HorovodSection(_Section):
    """Horovod's own knobs, set as its environment variables before hvd.init() on every rank
    (train/backends/horovod_env.py). A key left null keeps what the launcher or the environment
    gives (horovodrun's --fusion-threshold-mb etc., or HOROVOD_* variables); a key set here wins
    over them, so the config stays the record of how the run was made."""

    fusion_threshold_mb: float | None = Field(None, ge=0)  # HOROVOD_FUSION_THRESHOLD; 0: off
    cycle_time_ms: float | None = Field(None, ge=0)  # HOROVOD_CYCLE_TIME (Horovod: 1 ms)
    # HOROVOD_HIERARCHICAL_ALLREDUCE: takes effect only with NCCL (GPU builds) on >1 host
    hierarchical_allreduce: bool | None = None
    autotune: bool | None = None  # HOROVOD_AUTOTUNE: Bayesian search of fusion/cycle time
    autotune_log: str | None = None  # HOROVOD_AUTOTUNE_LOG: CSV of every tried setting
    autotune_warmup_samples: NonNegativeInt | None = None  # (Horovod: 3)
    autotune_steps_per_sample: PositiveInt | None = None  # (Horovod: 10)
    timeline: str | None = None  # HOROVOD_TIMELINE: Chrome trace written by rank 0
    # auto: whatever the launcher set up (horovodrun: Gloo; mpirun: MPI); gloo / mpi: insist
    # on it (HOROVOD_CONTROLLER and HOROVOD_CPU_OPERATIONS), a launch that cannot give it is
    # a config error.
    controller: Literal["auto", "gloo", "mpi"] = "auto"
    # How the gradients of the ranks combine (train/backends/reduce_op.py). average: their
    # mean, with the lr scaled by ranks (optim.scale_lr_with_world_size). adasum: Horovod's
    # Adasum (per tensor: sum of orthogonal parts, average of parallel ones), which does not
    # shrink the update with more ranks, so it needs optim.scale_lr_with_world_size: false
    # (Horovod's examples: lr x 1 on CPUs, x local ranks on NCCL GPUs); Horovod 0.28.1 runs it
    # only under MPI (mpirun), on a power-of-2 number of ranks; not with local SGD
    # (train.sync_every > 1); torch: not with train.grad_clip or fp16 (Horovod's Adasum
    # optimizer applies each rank's update in the backward pass, before clipping/unscaling).
    op: Literal["average", "adasum"] = "average"
    # op average: gradients are divided by f before the sum and by ranks / f after it, the
    # same mean with less overflow in fp16 sums (Horovod's gradient_predivide_factor)
    gradient_predivide_factor: PositiveFloat = 1.0

    @model_validator(mode="after")
    def _predivide_with_average(self) -> HorovodSection:
        if self.gradient_predivide_factor != 1.0 and self.op != "average":
            raise ValueError(f"gradient_predivide_factor applies to op: average only (op is "
                             f"{self.op}); remove it or set op: average")
        return self

    @field_validator("autotune_log", "timeline")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("expected a file path")
        return v


class OutputSection(_Section):
    dir: str = "runs/ringfeed"
    # Where rank 0's scalars, the config and the summary go besides metrics.jsonl
    # (train/observe/trackers.py): tensorboard (<dir>/tensorboard/), mlflow (MLFLOW_TRACKING_URI),
    # wandb (WANDB_MODE, WANDB_PROJECT); [] for metrics.jsonl alone.
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"])
    # samples.jsonl: the global sample ids (__index__) each step trained on, all ranks, written
    # by rank 0 (an audit of "every sample once"; costs one allgather per log_every steps).
    sample_log: bool = False

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """The key output.loggers replaced: `tensorboard: true|false` still reads as
        loggers [tensorboard] | []."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        on = data.pop("tensorboard")
        if "loggers" in data or not isinstance(on, bool):
            raise ValueError("tensorboard: replaced by output.loggers (a list of tensorboard, "
                             "mlflow, wandb): write loggers: [tensorboard] or loggers: []")
        data["loggers"] = ["tensorboard"] if on else []
        return data

    @field_validator("loggers")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each logger once, got {v}")
        return v


class RunConfig(_Section):
    framework: Literal["torch", "tensorflow"] = "torch"
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    elastic: ElasticSection = Field(default_factory=ElasticSection)
    horovod: HorovodSection = Field(default_factory=HorovodSection)
    output: OutputSection = Field(default_factory=OutputSection)

    @property
    def checkpoint_dir(self) -> str:
        """checkpoint.dir: a local path or a URL (train/checkpoint/store.py)."""
        return checkpoint_dir(self.output.dir, self.checkpoint.dir)

    @property
    def val_source(self) -> str | list[WeightedSource] | None:
        """What validation reads (its `val_split`): data.val, else data.train's sources; a
        mixture is validated on all its sources' samples, per source and overall."""
        if self.data.val_split is None:
            return None
        return self.data.val or self.data.train

    def to_pipeline_config(self, split: str) -> PipelineConfig:
        """The data section's PipelineConfig for `split` ("train" or "val"), seeded with
        train.seed (DataSection.to_pipeline_config)."""
        return self.data.to_pipeline_config(split, seed=self.train.seed,
                                            accumulate=self.train.accumulate)

    def to_yaml(self) -> str:
        dumped = self.model_dump(mode="json", exclude={"data": set(RUN_OWNED_DATA_KEYS)},
                                 by_alias=True)  # (checkpoint.async)
        return yaml.safe_dump(dumped, sort_keys=False)


def launcher_world_size() -> int:
    """The number of ranks, read from the launcher's environment before Horovod starts
    (horovodrun/Gloo, Open MPI, MPICH/PMI); 1 for a plain process."""
    for var in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def template() -> str:
    """All keys with their defaults (`ringfeed train --print-config` without a CONFIG)."""
    return RunConfig(data=DataSection(train="<shard dir with manifest.json>")).to_yaml()


def load_config(path: str | Path, overrides: list[str] = (), resume: str | None = None,
                check_paths: bool = True, elastic: bool = False) -> RunConfig:
    """Load, override, validate. Raises UserError (one line naming the field) on any problem."""
    raw = read_yaml_mapping(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    if elastic:
        _apply_override(raw, "elastic.enabled=true")
    if resume is not None:
        raw.setdefault("checkpoint", {})
        if not isinstance(raw["checkpoint"], dict):
            raise UserError(f"{path}: checkpoint: expected a mapping")
        raw["checkpoint"]["resume"] = resume
    data = raw.get("data")
    for key, instead in RUN_OWNED_DATA_KEYS.items():
        if isinstance(data, dict) and key in data:
            raise UserError(f"{path}: data.{key}: not a key of a run's data section: set {instead}")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(f"{path}: {_describe(e)}") from None
    resolved = resolve_config(cfg, path)
    if check_paths:
        _check_paths(resolved, path)
    return resolved


def resolve_config(cfg: RunConfig, path: str | Path = "config") -> RunConfig:
    """`cfg` checked for consistency, with what it leaves to be worked out settled, as a new
    config (`cfg` is not changed): data.batch_size from data.global_batch_size, and
    data.val_split null when validation was not asked for and local train shards have no split
    of the default name. The same with or without load_config's path checks."""
    data = _check_consistency(cfg, path)
    if not cfg.data.synthetic and _no_default_val_split(cfg):
        data["val_split"] = None  # shards without a val split: no validation unless asked
    if not data:
        return cfg.model_copy(deep=True)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=data, deep=True)},
                          deep=True)


def read_yaml_mapping(path: Path, what: str = "config file",
                      expected: str = "a mapping of sections (framework, model, data, ...)"
                      ) -> dict[str, Any]:
    """A YAML file that must hold a mapping; UserError (one line naming the file) otherwise."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory; give the {what} (a YAML file) itself") from None
    except (PermissionError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the {what} ({e})") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected {expected}")
    return data


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    if not all(parts):  # ".", "a..b", "train.": a key of no name
        raise UserError(f"--set {item!r}: {key.strip()!r} has an empty part; keys are "
                        "SECTION.NAME, e.g. --set train.max_steps=100")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {item!r}: {part} is not a section")
    node[parts[-1]] = value


def _describe(error: ValidationError) -> str:
    """pydantic's errors as one line: `data.batch_size: ... (got 'abc')`; typos get a hint."""
    parts = []
    for err in error.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
                      if not str(p).startswith("<")).lstrip(".")
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key{_hint(err['loc'])}")
        elif err["type"] == "missing":
            parts.append(f"{loc}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, (dict, type(None))) else f" (got {got!r})"
            parts.append(f"{loc}: {msg}{shown}")
    return "; ".join(parts)


def _hint(loc: tuple) -> str:
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    valid = ", ".join(model.model_fields)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {valid})"


def _check_consistency(cfg: RunConfig, path: str | Path) -> dict[str, Any]:
    """Raises a UserError for keys that do not go together; returns the data keys they settle
    ({"batch_size": ...} from global_batch_size), without changing `cfg`."""
    t, d = cfg.train, cfg.data
    settled: dict[str, Any] = _check_synthetic(cfg, path)
    if t.epochs is None and t.max_steps is None:
        raise UserError(f"{path}: train: set train.epochs or train.max_steps")
    if cfg.elastic.enabled and d.order == "global":
        raise UserError(f"{path}: data.order: global keeps one global batch at every world "
                        "size, which elastic runs do not (they keep the per-rank batch and "
                        "scale the lr); use data.order: rank with elastic, or ringfeed run's "
                        "relaunch at another world size for the global order")
    if cfg.elastic.enabled and d.global_batch_size is not None:
        raise UserError(f"{path}: data.global_batch_size: elastic runs keep the per-rank batch "
                        "(data.batch_size) when the world size changes and scale the lr with it; "
                        "set data.batch_size instead")
    if d.global_batch_size is not None:
        ranks = launcher_world_size()
        per_step = ranks * t.accumulate
        if d.global_batch_size % per_step:
            raise UserError(
                f"{path}: data.global_batch_size={d.global_batch_size} is not divisible by "
                f"ranks ({ranks}) x train.accumulate ({t.accumulate}) = {per_step}"
            )
        settled["batch_size"] = d.global_batch_size // per_step
        if d.order == "global":
            micro = d.global_batch_size // t.accumulate
            problem = canonical_rule_error(
                micro, d.canonical_streams, ranks, field="data.",
                batch_label=f"data.global_batch_size={d.global_batch_size} / train.accumulate "
                            f"({t.accumulate}) = {micro}")
            if problem:
                raise UserError(f"{path}: {problem}")
    elif d.order == "global":
        raise UserError(f"{path}: data.order: global needs data.global_batch_size (the samples "
                        "of one optimizer step over all ranks)")
    _check_local_sgd(cfg, path)
    _check_reduction(cfg, path)
    from ringfeed.train.observe.trackers import missing_package

    missing = missing_package(cfg.output.loggers)
    if missing:
        raise UserError(f"{path}: {missing}")
    problem = launch_problem(cfg.horovod, os.environ)
    if problem:
        raise UserError(f"{path}: {problem}")
    if d.decode_device == "cuda" and cfg.framework != "torch":
        raise UserError(f"{path}: data.decode_device: 'cuda' (nvJPEG through torchvision) "
                        f"needs framework torch, not {cfg.framework}; use 'cpu'")
    if cfg.train.compile and cfg.framework != "torch":
        raise UserError(f"{path}: train.compile: torch.compile is for framework torch (the "
                        "TensorFlow step is already one traced tf.function); set it false")
    if isinstance(d.normalize, NormalizeSection) and len(d.normalize.mean) != len(d.normalize.std):
        raise UserError(f"{path}: data.normalize: mean and std must have the same length")
    if cfg.checkpoint.resume not in ("none", "auto") and not is_remote(cfg.checkpoint.resume) \
            and not Path(cfg.checkpoint.resume).exists():  # (a URL is looked at on rank 0)
        raise UserError(f"{path}: checkpoint.resume: {cfg.checkpoint.resume} does not exist "
                        "(use auto, none or a checkpoint directory)")
    _check_user_modules(cfg, path)
    return settled


def _check_synthetic(cfg: RunConfig, path: str | Path) -> dict[str, Any]:
    """data.train is required unless data.synthetic; a synthetic run's data keys it settles
    ({"val_split": None}: nothing to validate on)."""
    d = cfg.data
    if not d.synthetic:
        if d.train is None:
            raise UserError(f"{path}: data.train: required key is missing (a shard directory "
                            "with manifest.json; or data.synthetic: true for no data)")
        return {}
    if cfg.train.max_steps is None:
        raise UserError(f"{path}: data.synthetic: set train.max_steps (synthetic data has no "
                        "epochs: one epoch is the whole run)")
    if d.val is not None:
        raise UserError(f"{path}: data.val: a synthetic run does not validate; remove data.val "
                        "or set data.synthetic: false")
    if cfg.model.name == "gpt":
        raise UserError(f"{path}: data.synthetic: makes images and class ids, not tokens; train "
                        "model gpt on token shards (ringfeed shard --format text)")
    return {"val_split": None}


def _check_user_modules(cfg: RunConfig, path: str | Path) -> None:
    """Every "module:function" of the config names a module Python finds (on PYTHONPATH)."""
    t, d = cfg.train, cfg.data
    for field, value in (("model.name", cfg.model.name if ":" in cfg.model.name else None),
                         ("data.decode", d.decode), ("data.transform", d.transform),
                         ("train.loss", t.loss), ("train.metrics", t.metrics)):
        if value is not None:
            module = value.split(":")[0]
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise UserError(f"{path}: {field}: module {module!r} not found "
                                "(is it on PYTHONPATH?)")


def _check_local_sgd(cfg: RunConfig, path: str | Path) -> None:
    t = cfg.train
    if t.sync_every == 1:
        return
    if cfg.elastic.enabled:
        raise UserError(f"{path}: train.sync_every: local SGD (sync_every={t.sync_every}) does "
                        "not run under elastic; use sync_every: 1 or elastic.enabled: false")
    if t.fp16_allreduce:
        raise UserError(f"{path}: train.fp16_allreduce: local SGD (sync_every={t.sync_every}) "
                        "averages the parameters, which must not be rounded to fp16; "
                        "set one of them off")


def _check_reduction(cfg: RunConfig, path: str | Path) -> None:
    """model.sync_batchnorm and horovod.op: adasum with the keys they do not go with."""
    if cfg.model.sync_batchnorm and cfg.framework != "torch":
        raise UserError(f"{path}: model.sync_batchnorm: torch only (Horovod 0.28.1's Keras "
                        "SyncBatchNormalization is built on Keras 2's BatchNormalization, "
                        "which Keras 3 does not have); set it false (train.average_bn_stats "
                        "still averages the running statistics)")
    if cfg.horovod.op != "adasum":
        return
    t = cfg.train
    conflicts = (
        (cfg.optim.scale_lr_with_world_size, "optim.scale_lr_with_world_size: true",
         "Adasum does not shrink the update as ranks are added (Horovod's examples keep the "
         "lr); set optim.scale_lr_with_world_size: false"),
        (t.sync_every > 1, f"train.sync_every: {t.sync_every}",
         "local SGD averages replicas, not each step's updates; use one of them"),
        (cfg.framework == "torch" and t.grad_clip is not None, "train.grad_clip",
         "Horovod's torch Adasum applies each rank's update in the backward pass, before "
         "clipping; remove grad_clip or use op: average"),
        (cfg.framework == "torch" and t.precision == "fp16", "train.precision: fp16",
         "Horovod's torch Adasum applies the update before the loss scale is checked; use "
         "bf16 or fp32, or op: average"))
    for conflict, key, why in conflicts:
        if conflict:
            raise UserError(f"{path}: horovod.op: adasum with {key}: {why}")


def _check_paths(cfg: RunConfig, path: str | Path) -> None:
    """Shards exist and hold the splits asked for; checkpoints are not silently mixed. Checks
    only: `cfg` is a resolved config (resolve_config) and is not changed."""
    sources = ([] if cfg.data.synthetic  # (data.train, if set, is not read)
               else list(_paths("data.train", cfg.data.train, cfg.data.train_split)))
    if cfg.val_source is not None:
        sources += _paths("data.val" if cfg.data.val else "data.train", cfg.val_source,
                          cfg.data.val_split)
    if cfg.data.epoch_samples is not None and isinstance(cfg.data.train, str):
        raise UserError(f"{path}: data.epoch_samples: only a weighted mixture (data.train "
                        "as a list of {path, weight}) has it")
    for field, source, split in sources:
        if "://" in source or any(c in source for c in "{*,"):
            continue  # remote or a shard list: the pipeline checks it (with retries)
        if not Path(source).exists():
            raise UserError(f"{path}: {field}: {source} does not exist (run `ringfeed shard` "
                            "first, or fix the path)")
        try:  # manifest.bin, memory-mapped: no per-rank parse of a 10^6-shard JSON
            index = manifest_index(source)
            index.split(split)
        except ManifestError as e:
            raise UserError(f"{path}: {field}: {e}") from None
        fields = index.header["manifest"].get("fields") or {}
        for key_field in ("input_key", "target_key"):
            key = getattr(cfg.data, key_field)
            if key and fields and key not in fields:
                raise UserError(f"{path}: data.{key_field}: {key!r} is not a field of {source} "
                                f"(fields: {', '.join(fields)})")
    # (Elastic runs check this when they start training: a worker joining a running job finds
    # the job's own checkpoints here.)
    # (A remote checkpoint.dir is listed once, on rank 0, when training starts.)
    if not cfg.elastic.enabled and not is_remote(cfg.checkpoint_dir):
        try:
            refuse_earlier_run(cfg.checkpoint.resume, cfg.checkpoint_dir)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None


def _paths(field: str, source: str | list[WeightedSource], split: str | None
           ) -> list[tuple[str, str, str | None]]:
    """(config field, path, split) of a source, or of each source of a mixture."""
    if isinstance(source, str):
        return [(field, source, split)]
    return [(f"{field}[{i}].path", entry.path, split) for i, entry in enumerate(source)]


def _no_default_val_split(cfg: RunConfig) -> bool:
    """True when validation was not asked for explicitly and the local train shards (of any
    source of a mixture) have no split of the default name."""
    d = cfg.data
    if d.val is not None or "val_split" in d.model_fields_set or d.val_split is None:
        return False
    for _, source, _ in _paths("data.train", d.train, None):
        manifest_file = Path(source) / MANIFEST_NAME
        try:
            if manifest_file.is_file() and d.val_split not in manifest_index(
                    source).split_names:
                return True
        except ManifestError:
            return False  # reported below, with the field named
    return False


def manifest_index(source: str) -> ManifestIndex:
    """The local manifest's binary index (beside it, else built once in memory)."""
    path = Path(source)
    return load_index(path / MANIFEST_NAME if path.is_dir() else path, None)
