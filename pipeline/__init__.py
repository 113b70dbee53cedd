"""Streaming shard pipeline: shards (local or remote) -> local cache -> balanced, shuffled,
decoded, batched, resumable batches for every Horovod rank; adapters for PyTorch
(`ringfeed.pipeline.torch.make_loader`) and tf.data (`ringfeed.pipeline.tf.make_dataset`).

`ShardPipeline(source, PipelineConfig(...))`, or keyword options. Importing this package imports
neither torch nor TensorFlow. Guarantees: pipeline/README.md. Its names load on first use, so
the train config can read `PipelineConfig` without loading the reader.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ShardPipeline", "PipelineConfig", "PipelineDataError", "PipelineError",
           "WeightedSource", "horovod_rank_and_size"]

_HOMES = {"ShardPipeline": "ringfeed.pipeline.core",
          "horovod_rank_and_size": "ringfeed.pipeline.core",
          "PipelineConfig": "ringfeed.pipeline.config",
          "WeightedSource": "ringfeed.pipeline.config",
          "PipelineDataError": "ringfeed.pipeline.errors",
          "PipelineError": "ringfeed.pipeline.errors"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ringfeed.pipeline' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
