"""The on-disk formats, one module each, that the shard writer (ringfeed.shards) and the reader
(ringfeed.pipeline) both import: the manifest (manifest.py, its binary index manifest_format.py
written and manifest_index.py mapped), tar shards (tarwrite.py written, tarindex.py their index
sidecars, tarread.py foreign tars scanned), member kinds (kinds.py) and values (members.py), and
tar's block arithmetic (tarblocks.py). Nothing here imports the packages above it."""
