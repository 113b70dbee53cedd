"""Streaming shard pipeline: shards (local or remote) -> local cache -> balanced, shuffled,
decoded, batched, resumable batches for every Horovod rank; adapters for PyTorch
(`pipeline.torch.make_loader`) and tf.data (`pipeline.tf.make_dataset`).

Importing this package imports neither torch nor TensorFlow. Guarantees: pipeline/README.md.
"""

from pipeline.core import ShardPipeline, horovod_rank_and_size
from pipeline.errors import PipelineDataError, PipelineError

__all__ = ["ShardPipeline", "PipelineDataError", "PipelineError", "horovod_rank_and_size"]
