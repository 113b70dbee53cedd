"""ringfeed/remote.py: which storage errors are retried, and the retry loop's budget, counts and
lines. The errors are the real exception types the storage libraries raise (botocore, aiohttp,
fsspec's http wrapping); the end-to-end behaviour against a real S3 server behind a fault proxy
is in tests/test_storage_faults.py."""

from __future__ import annotations

import errno
import logging
import re

import aiohttp
import botocore.exceptions
import pytest

from ringfeed.remote import (
    EXIT_STORAGE_UNAVAILABLE,
    BodyCutShort,
    RetryCounts,
    RetryPolicy,
    StorageUnavailable,
    classify,
    retrying,
    with_timeouts,
)

FAST = RetryPolicy(budget_s=0.5, first_backoff_s=0.01, max_backoff_s=0.02)


def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": code},
         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def wrapped(outer: BaseException, cause: BaseException) -> BaseException:
    """`outer` raised `from cause`, as fsspec and s3fs raise their translations."""
    try:
        raise outer from cause
    except BaseException as e:
        return e


@pytest.mark.parametrize("error, kind", [
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
     "transient"),
    (botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), "transient"),
    (ConnectionResetError(errno.ECONNRESET, "reset by peer"), "transient"),
    (TimeoutError("timed out"), "transient"),
    (aiohttp.ServerDisconnectedError(), "transient"),
    (aiohttp.ClientPayloadError("Response payload is not completed"), "transient"),
    (BodyCutShort("got 10 of 20 bytes"), "transient"),
    (client_error("InternalError", 500), "transient"),
    (client_error("SlowDown", 503), "throttle"),
    (client_error("TooManyRequests", 429), "throttle"),
    (OSError(errno.EBUSY, "Please reduce your request rate."), "throttle"),  # s3fs's SlowDown
    (wrapped(OSError(errno.EBUSY, "SlowDown"), client_error("SlowDown", 503)), "throttle"),
    (client_error("NoSuchKey", 404), "permanent"),
    (client_error("AccessDenied", 403), "permanent"),
    (FileNotFoundError("s3://b/k"), "permanent"),
    (PermissionError("s3://b/k"), "permanent"),
    (ValueError("a bug"), "permanent"),
    # fsspec's http turns any failure to reach a URL into FileNotFoundError(url) from the cause
    (wrapped(FileNotFoundError("http://h/x"), ConnectionRefusedError(111, "refused")),
     "transient"),
])
def test_errors_are_classified_by_whether_a_retry_can_help(error, kind):
    assert classify(error) == kind


def test_transient_failures_are_retried_counted_and_said_once_each_way(caplog):
    failures = [ConnectionResetError(104, "reset"), client_error("SlowDown", 503)]

    def flaky() -> str:
        if failures:
            raise failures.pop(0)
        return "data"

    counts = RetryCounts()
    with caplog.at_level(logging.WARNING, logger="ringfeed.storage"):
        assert retrying(flaky, "s3://b/shard.tar", "download", FAST, counts) == "data"
    assert (counts.retries, counts.throttles) == (2, 1)
    assert counts.wait_s > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one line when it starts failing, one when it recovers
    assert lines[0].startswith("storage: s3://b/shard.tar: download failed (ConnectionResetError")
    assert "recovered after" in lines[1] and "(2 retries)" in lines[1]


def test_a_permanent_error_is_raised_at_once():
    calls = []

    def missing() -> None:
        calls.append(1)
        raise client_error("NoSuchKey", 404)

    with pytest.raises(botocore.exceptions.ClientError):
        retrying(missing, "s3://b/k", "download", FAST)
    assert len(calls) == 1


def test_a_spent_budget_is_the_restartable_error_naming_url_and_last_error():
    def down() -> None:
        raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    with pytest.raises(StorageUnavailable) as info:
        retrying(down, "s3://b/shard.tar", "download", FAST)
    message = str(info.value)
    assert re.match(r"s3://b/shard\.tar: download failed for 0\.\ds, the retry budget \(0\.5s\)"
                    r"; last error: EndpointConnectionError", message), message
    assert "EndpointConnectionError" in message and "\n" not in message
    assert info.value.exit_code == EXIT_STORAGE_UNAVAILABLE == 75
    assert info.value.label == "storage unavailable"


def test_backoff_grows_with_jitter_up_to_its_cap():
    policy = RetryPolicy(first_backoff_s=1.0, max_backoff_s=8.0)
    for attempt, cap in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (10, 8.0)]:
        waits = [policy.backoff(attempt) for _ in range(50)]
        assert all(cap / 2 <= w <= cap for w in waits)
        assert len(set(waits)) > 1


def test_s3_options_get_bounded_timeouts_unless_the_user_set_them():
    options = with_timeouts("s3://b/k", {"endpoint_url": "http://x"})
    assert options["config_kwargs"]["read_timeout"] == 30
    assert options["endpoint_url"] == "http://x"
    mine = with_timeouts("s3://b/k", {"config_kwargs": {"read_timeout": 5}})
    assert mine["config_kwargs"]["read_timeout"] == 5
    assert with_timeouts("gs://b/k", {"a": 1}) == {"a": 1}
