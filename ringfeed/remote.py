"""One retry policy for every call to object storage (shards, indexes, manifests, sharding
output, checkpoints): an outage costs a wait, never the job.

    result = retrying(lambda: fs.cat_file(path), url, "read manifest", policy, counts)

A failed call is classified (`classify`):
  * transient: connection resets and refusals, timeouts, a body cut short, HTTP 5xx;
  * throttle: HTTP 429/503, S3's `SlowDown` (counted apart: the bucket asks for less);
  * permanent: 404 (no such object), 403 (no access), anything that is not a storage error.
Transient and throttled calls are retried with exponential backoff and full jitter (AWS's
"Exponential Backoff and Jitter"; botocore's `standard` mode does the same per request) until
the policy's time budget is spent, then `StorageUnavailable` is raised: exit 75 (sysexits'
EX_TEMPFAIL), which `ringfeed run` and the Slurm scripts relaunch. Permanent errors are raised
as they are, at once, for the caller to name. While a call waits it says so: one warning naming
the URL and the error (again every `report_every_s`), one when it recovers.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from ringfeed.errors import EXIT_STORAGE_UNAVAILABLE, UserError

log = logging.getLogger("ringfeed.storage")

T = TypeVar("T")
Kind = Literal["transient", "throttle", "permanent"]

# The exception types of the libraries that talk to storage, by module: an error raised from
# them that is none of the permanent kinds below is a network or service fault.
_NETWORK_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http.client",
                    "ssl", "socket", "asyncio", "fsspec", "s3fs", "gcsfs", "adlfs", "obstore",
                    "concurrent.futures")
_THROTTLE_WORDS = ("slowdown", "slow down", "throttl", "toomanyrequests", "too many requests",
                   "requestlimitexceeded", "reduce your request rate")
_PERMANENT_CODES = {"NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch", "NotFound", "404", "403", "400", "InvalidRange"}


class StorageUnavailable(UserError):
    """Object storage kept failing for the whole retry budget. A restart can help: exit 75,
    printed as `ringfeed: storage unavailable: ...` (not the not-restartable error line)."""

    exit_code = EXIT_STORAGE_UNAVAILABLE
    label = "storage unavailable"


class BodyCutShort(OSError):
    """A download ended before the object's known size (the connection closed early)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long a remote call keeps trying. `budget_s`: the whole time one call may spend
    failing and waiting (Streaming's download_retry x download_timeout and botocore's retries
    add up to minutes: an outage of a few minutes is survived by default)."""

    budget_s: float = 600.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 20.0
    report_every_s: float = 60.0

    def backoff(self, attempt: int) -> float:
        """The wait before retry `attempt` (0-based): full jitter over an exponential cap."""
        cap = min(self.max_backoff_s, self.first_backoff_s * 2 ** min(attempt, 30))
        return random.uniform(cap / 2, cap)


@dataclass
class RetryCounts:
    """What retrying cost (summed over calls; thread-safe)."""

    retries: int = 0
    throttles: int = 0
    wait_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, kind: Kind, waited: float) -> None:
        with self._lock:
            self.retries += 1
            self.throttles += kind == "throttle"
            self.wait_s += waited

    def as_counts(self) -> dict[str, float]:
        """As pipeline counters (pipeline/stats.py's names)."""
        with self._lock:
            return {"storage_retries": self.retries, "storage_throttles": self.throttles,
                    "storage_wait_s": self.wait_s}


def classify(e: BaseException) -> Kind:
    """Whether retrying `e` can help (see the module's docstring)."""
    if isinstance(e, BodyCutShort):
        return "transient"
    if isinstance(e, FileNotFoundError) and e.__cause__ is not None:
        return classify(e.__cause__)  # fsspec's http: any failure to reach a URL is "not found"
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError,
                      NotADirectoryError)):
        return "permanent"
    status, code = _status_and_code(e)
    text = f"{code or ''} {e}".lower()
    if status in (429, 503) or code in ("429", "503") or any(w in text for w in _THROTTLE_WORDS):
        return "throttle"
    if status is not None and status >= 500:
        return "transient"
    if (status is not None and 400 <= status < 500) or code in _PERMANENT_CODES:
        return "permanent"
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return "throttle" if getattr(e, "errno", None) == 16 else "transient"  # s3fs: EBUSY
    module = type(e).__module__ or ""
    if module.startswith(_NETWORK_MODULES):
        return "transient"
    return "permanent"


def _status_and_code(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and service error code an exception carries (botocore's ClientError,
    aiohttp's ClientResponseError, s3fs's translation, which keeps the ClientError as cause)."""
    for err in (e, e.__cause__):
        if err is None:
            continue
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata", {})
            return meta.get("HTTPStatusCode"), response.get("Error", {}).get("Code")
        status = getattr(err, "status", None)
        if isinstance(status, int):
            return status, None
    return None, None


def _seconds(s: float) -> str:
    return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"


# Socket errors said in words: a library's text ("Connect call failed ('127.0.0.1', 9)") often
# leaves out why the connection failed.
_SOCKET_ERRORS = {errno.ECONNREFUSED: "connection refused", errno.ECONNRESET: "connection reset",
                  errno.ETIMEDOUT: "connection timed out", errno.EHOSTUNREACH: "host unreachable",
                  errno.ENETUNREACH: "network unreachable"}


def describe(e: BaseException) -> str:
    """An exception as one short line: why the connection failed in words when a socket error
    is behind it, then its type and first line."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    # (Python's own socket errors say why by their name: ConnectionResetError)
    why = None if type(e).__module__ == "builtins" else _socket_error(e)
    return f"{why} ({line})" if why and why not in line.lower() else line


def _socket_error(e: BaseException | None) -> str | None:
    """The socket error behind `e` (its cause, context, or aiohttp's os_error), in words."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            return "host name not resolved"
        if isinstance(e, OSError) and e.errno in _SOCKET_ERRORS:
            return _SOCKET_ERRORS[e.errno]
        e = getattr(e, "os_error", None) or e.__cause__ or e.__context__
    return None


def retrying(fn: Callable[[], T], url: str, what: str, policy: RetryPolicy,
             counts: RetryCounts | None = None) -> T:
    """`fn()`, retried under `policy` while it fails with transient or throttled errors.
    Raises the first permanent error as it is, or StorageUnavailable naming `url`, `what` was
    being done and the last error once the budget is spent."""
    started: float | None = None
    reported = 0.0
    attempt = 0
    while True:
        try:
            result = fn()
        except Exception as e:
            kind = classify(e)
            if kind == "permanent":
                raise
            now = time.monotonic()
            if started is None:
                started = now
            spent = now - started
            if spent >= policy.budget_s:
                raise StorageUnavailable(
                    f"{url}: {what} failed for {_seconds(spent)}, the retry budget "
                    f"({_seconds(policy.budget_s)}); last error: {describe(e)} (the job can be "
                    "restarted once storage answers: `ringfeed run` does so with --resume "
                    "auto)") from None
            if attempt == 0 or now - reported >= policy.report_every_s:
                reported = now
                log.warning("storage: %s: %s %s (%s); retrying for up to %s more", url,
                            what, "throttled" if kind == "throttle" else "failed", describe(e),
                            _seconds(policy.budget_s - spent))
            wait = min(policy.backoff(attempt), max(0.0, policy.budget_s - spent))
            time.sleep(wait)
            if counts is not None:
                counts.add(kind, wait)
            attempt += 1
        else:
            if started is not None:
                log.warning("storage: %s: %s recovered after %.1fs (%d retries)", url, what,
                            time.monotonic() - started, attempt)
            return result


def with_timeouts(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """fsspec options for `url` with bounded per-request timeouts where the user set none, so a
    stalled connection fails within a minute and is retried under the policy instead of
    hanging (botocore waits 60 s to connect and 60 s per read, then retries 4 times, by
    default). The user's options win."""
    if not url.startswith(("s3://", "s3a://")):
        return dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 30)
    config.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
    return {**options, "config_kwargs": config}


def read_url(url: str, storage_options: dict[str, Any]) -> bytes:
    """A small remote object (a manifest, an index), read whole in one GET (no HEAD first)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **with_timeouts(url, storage_options))
    return fs.cat_file(path)


def forget_inherited_storage_sessions() -> None:
    """In a forked child (a loader worker): drop s3fs's exit-time closers of the S3 clients
    the parent opened. Those clients belong to the parent (their sockets are shared with it);
    run here, each printed a 'Task exception was never retrieved ... attached to a different
    loop' traceback when the inherited instance was collected."""
    import sys
    import weakref

    s3fs = sys.modules.get("s3fs")
    if s3fs is None:
        return
    close = s3fs.S3FileSystem.close_session
    for finalizer, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
        if info.func is close:
            finalizer.detach()
