"""Flat token shards: the names a shard's reader, the pipeline and the trainer share."""

from __future__ import annotations

# A training window's per-token document index (int32, the window's length): 0 for the
# document the window starts in, +1 at each document start inside it. Present in a batch only
# when the shards record their documents; the built-in gpt's block-causal mask reads it.
DOC_IDS = "doc_ids"
