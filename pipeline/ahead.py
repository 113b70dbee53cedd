"""The decode-ahead stage of a worker stream: while the stream waits for its next shard to
download, it decodes samples that later batches need from the shards already open, so the CPU
works during the wait instead of after the last byte.

The shuffle order draws each batch from many shards, so most samples of an open shard are
emitted well after it opened; without this stage their decoding waits for their batch and a
cold epoch from object storage ends with the buffer's decoding still to do (half a worker's
samples in augment_bench's S3 row). A sample decodes to the same values whenever it is decoded
(its augmentation is a function of the seed, the epoch and its key), so decoding early changes
timing only, never a batch.

Bounded by bytes held (`DECODE_AHEAD_BYTES` per stream), in emission order: the samples needed
soonest are decoded first, and nothing is decoded while the bound is reached. Only for the
whole-batch column route (indexed shards, no user decode or transform): a sample whose read or
decode fails is left to the route, which names it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringfeed.pipeline.decode import Decoder
from ringfeed.pipeline.readplan import ReadPlan
from ringfeed.pipeline.shardread import BadSample, IndexedSamples

# decoded samples held ahead, per stream: 64 MiB is ~440 images at 224 x 224 x 3, about the
# buffered samples left when a worker's last shard of an ImageNet-sized epoch arrives
DECODE_AHEAD_BYTES = 64 << 20
LOOKAHEAD_SLOTS = 8192  # emission positions scanned for work each step
GROUP = 8  # samples decoded per step: one step is short, so the stream sees its shard soon


class DecodeAhead:
    """`step(sources, opened)` decodes one group of the earliest needed samples of the open
    sources that are not decoded yet (False: nothing to do); `take(slots)` hands over and
    forgets what was decoded for those slots."""

    def __init__(self, decoder: Decoder, reads: ReadPlan, epoch: int) -> None:
        self.decoder, self.reads, self.epoch = decoder, reads, epoch
        self.position = 0  # emission index (in reads.needed) of the batch being assembled
        self.tried = np.zeros(len(reads.ids), dtype=bool)  # per slot: decoded ahead or tried
        self.decoded: dict[int, tuple[str, dict[str, Any], int]] = {}  # slot -> key, fields, bytes
        self.held = 0

    def step(self, sources: dict[int, Any], opened: int) -> bool:
        """Decode the next group; `opened`: the runs below it are open (in `sources`)."""
        if self.held >= DECODE_AHEAD_BYTES:
            return False
        reads = self.reads
        window = reads.needed[self.position:self.position + LOOKAHEAD_SLOTS]
        runs = reads.run_of[window]
        candidates = window[(runs < opened) & ~self.tried[window]]
        if not len(candidates):
            return False
        run = int(reads.run_of[candidates[0]])
        source = sources.get(run)
        group = candidates[reads.run_of[candidates] == run][:GROUP]
        self.tried[group] = True
        if type(source) is not IndexedSamples:
            return True
        raws = source.get_many(reads.pos_of[group].tolist())
        good = [(int(s), raw) for s, raw in zip(group.tolist(), raws, strict=True)
                if type(raw) is not BadSample]
        if not good:
            return True
        try:
            columns = self.decoder.columns([raw for _, raw in good], self.epoch)
        except Exception:  # the route reads it again and names the bad sample
            return True
        if columns is None:
            return True
        for i, (slot, raw) in enumerate(good):
            fields = {name: values[i] for name, values in columns.items()}
            size = sum(v.nbytes for v in fields.values() if isinstance(v, np.ndarray))
            self.decoded[slot] = (raw["__key__"], fields, size)
            self.held += size
        return True

    def take(self, slots: np.ndarray) -> dict[int, tuple[str, dict[str, Any]]]:
        """What was decoded ahead for `slots` (slot -> (key, fields)), forgotten here."""
        out = {}
        for slot in slots.tolist():
            item = self.decoded.pop(slot, None)
            if item is not None:
                self.held -= item[2]
                out[slot] = item[:2]
        return out
