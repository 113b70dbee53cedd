"""ringfeed: WebDataset tar shards -> local cache -> Horovod ring-allreduce workers.

The package's layers, each importing only those below it:
- ringfeed.train     (train/ at the repository root): config, loop, backends, tune, the CLI;
- ringfeed.pipeline  (pipeline/): shards -> cache -> balanced, shuffled, decoded batches;
- ringfeed.shards    (shards/): `ringfeed shard | verify | inspect`, the writer;
- ringfeed.formats   (here): manifest, tar index, member kinds - what the writer and reader share;
- ringfeed.errors, ringfeed.fsutil: the user-facing error and atomic file writes.
"""
