"""Errors the pipeline raises. Both print as one line through the `ringfeed` CLI (UserError)."""

from __future__ import annotations

from ringfeed.errors import UserError


class PipelineError(UserError):
    """A pipeline that cannot be built as configured (bad source, bad option, bad state)."""


class PipelineDataError(PipelineError):
    """Data that cannot be read: the message names the shard URL and, where known, the sample key.

    Raised for `on_error="fail"` on a corrupt tar, truncated shard or undecodable sample, and under
    either policy for a missing shard, an unreachable URL or a checksum mismatch (after retries).
    """
