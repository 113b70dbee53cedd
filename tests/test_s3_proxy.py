"""tests/s3_proxy.py: the fault/shaping proxy in front of moto's S3, with real boto3 and s3fs
clients (the conftest fixtures `s3_server` and `s3_proxy`)."""

from __future__ import annotations

import errno
import http.client
import os
import socket
import time

import boto3
import pytest
import s3fs
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3_proxy import SLOWDOWN_BODY, FaultProxy, _RequestHeads, _Responses, host_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NO_RETRIES = {"total_max_attempts": 1, "mode": "standard"}


def client(url: str, **config):
    config.setdefault("retries", NO_RETRIES)
    return boto3.client("s3", endpoint_url=url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1",
                        config=Config(**config))


def filesystem(url: str) -> s3fs.S3FileSystem:
    """s3fs without retries (its `retries` is a class attribute in this version: the
    constructor would hand `retries=1` on to aiobotocore's session, which refuses it)."""
    fs = s3fs.S3FileSystem(endpoint_url=url, key="testing", secret="testing",
                           config_kwargs={"retries": {"max_attempts": 1}},
                           skip_instance_cache=True)
    fs.retries = 1
    return fs


def signed_path(s3, bucket: str, key: str) -> str:
    """The path and query of a presigned GET (moto refuses unsigned ones)."""
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})
    return "/" + url.split("://", 1)[1].split("/", 1)[1]


@pytest.fixture
def bucket(s3_proxy: FaultProxy) -> str:
    client(s3_proxy.url).create_bucket(Bucket="bkt")
    return "bkt"


def test_pass_through_is_byte_identical_and_counted(s3_proxy, bucket):
    data = os.urandom(3 * 1024 * 1024 + 17)
    s3 = client(s3_proxy.url)
    s3.put_object(Bucket=bucket, Key="a.bin", Body=data)
    assert s3.get_object(Bucket=bucket, Key="a.bin")["Body"].read() == data
    s3.head_object(Bucket=bucket, Key="a.bin")
    fs = filesystem(s3_proxy.url)
    fs.pipe_file(f"{bucket}/b.bin", data[::-1])
    assert fs.cat_file(f"{bucket}/b.bin") == data[::-1]
    with fs.open(f"{bucket}/a.bin", block_size=1 << 20) as f:    # ranged GETs
        assert f.read() == data
    counts = s3_proxy.counters()
    # create_bucket + put + get + head, then s3fs: put, get, and the open's head + ranges
    assert counts["methods"]["PUT"] == 3
    assert counts["methods"]["HEAD"] >= 1 and counts["methods"]["GET"] >= 3
    assert counts["requests"] == sum(counts["methods"].values())
    # (bytes_down is counted just after each send: the last chunk may not be in it yet)
    assert counts["bytes_up"] > 2 * len(data) and counts["bytes_down"] > 2.5 * len(data)
    # moto closes after every response; the proxy keeps the client's connection open
    assert counts["connections"] < counts["requests"] <= counts["upstream_connections"]
    assert counts["faults"] == {"reset": 0, "stall": 0, "slowdown": 0, "cut": 0}


def test_requests_with_bodies_counted_exactly(s3_proxy, bucket):
    s3 = client(s3_proxy.url)
    s3_proxy.reset_counters()
    s3_proxy.log_requests = True
    for i in range(4):
        s3.put_object(Bucket=bucket, Key=f"k{i}", Body=os.urandom(100_000 * (i + 1)))
    for i in range(4):
        s3.get_object(Bucket=bucket, Key=f"k{i}")["Body"].read()
    s3.list_objects_v2(Bucket=bucket)
    assert s3_proxy.counters()["methods"] == {"PUT": 4, "GET": 5}
    assert s3_proxy.counters()["requests"] == 9
    log = s3_proxy.request_log()
    assert [r["method"] for r in log] == ["PUT"] * 4 + ["GET"] * 5
    assert log[4]["target"].startswith(f"/{bucket}/k0")
    for r in log:
        assert r["t_request"] <= r["t_first_byte"]
    assert [r["bytes"] > 100_000 * i for i, r in enumerate(log[4:8], 1)] == [True] * 4


def test_request_parser_chunked_and_pipelined():
    heads = _RequestHeads()
    stream = (b"PUT /b/k HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"5\r\nhello\r\n3;ext=1\r\nGET\r\n0\r\n\r\n"
              b"PUT /b/j HTTP/1.1\r\nContent-Length: 8\r\n\r\nGET / HT"
              b"GET /b/j HTTP/1.1\r\nHost: x\r\n\r\n")
    seen = []
    for i in range(0, len(stream), 7):                       # in odd pieces
        seen += heads.feed(stream[i:i + 7])
    assert seen == [("PUT", "/b/k"), ("PUT", "/b/j"), ("GET", "/b/j")]
    responses = _Responses()
    responses.methods = ["HEAD", "GET"]
    out, ended = responses.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\n")
    assert ended and b"Connection" not in out and b"Content-Length: 9" in out
    out, ended = responses.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n4\r\nabcd")
    assert not ended
    out, ended = responses.feed(b"\r\n0\r\n\r\n")
    assert ended and out == b"\r\n0\r\n\r\n"


def test_reset_fails_new_and_open_connections_then_recovers(s3_proxy, bucket):
    s3 = client(s3_proxy.url)
    s3.put_object(Bucket=bucket, Key="k", Body=b"x" * 1000)
    # an open keep-alive connection to the proxy
    raw = http.client.HTTPConnection(*host_port(s3_proxy.url), timeout=5)
    raw.request("GET", signed_path(s3, bucket, "k"))
    assert raw.getresponse().read() == b"x" * 1000
    timer = s3_proxy.outage("reset", 1.0)
    time.sleep(0.2)                                          # the open one sees the mode
    with pytest.raises((BotoConnectionError, HTTPClientError)):   # reset or closed
        s3.get_object(Bucket=bucket, Key="k")["Body"].read()
    with pytest.raises(OSError):
        raw.request("GET", signed_path(s3, bucket, "k"))
        raw.getresponse().read()
    with pytest.raises((ConnectionResetError, BrokenPipeError)):   # an RST, not a FIN
        with socket.create_connection(host_port(s3_proxy.url), timeout=5) as plain:
            plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            plain.recv(100)
    timer.join(5)
    assert s3_proxy.mode == "pass"
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x" * 1000
    assert s3_proxy.counters()["faults"]["reset"] >= 3


def test_slowdown_is_a_throttle_for_botocore_and_s3fs(s3_proxy, bucket):
    from botocore.retries.standard import RetryContext, ThrottledRetryableChecker

    s3 = client(s3_proxy.url)
    s3.put_object(Bucket=bucket, Key="k", Body=b"y" * 500)
    s3_proxy.set_mode("slowdown")
    with pytest.raises(ClientError) as caught:
        s3.get_object(Bucket=bucket, Key="k")
    response = caught.value.response
    assert response["Error"]["Code"] == "SlowDown"
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 503
    context = RetryContext(attempt_number=1, parsed_response=response)
    assert ThrottledRetryableChecker().is_retryable(context)
    with pytest.raises(ClientError, match="SlowDown"):      # a PUT with a body, too
        s3.put_object(Bucket=bucket, Key="k2", Body=os.urandom(2_000_000))
    fs = filesystem(s3_proxy.url)
    with pytest.raises(OSError) as caught:
        fs.cat_file(f"{bucket}/k")
    assert caught.value.errno == errno.EBUSY                  # s3fs's SlowDown / 503
    # the reply itself, as S3 sends it
    raw = http.client.HTTPConnection(*host_port(s3_proxy.url), timeout=5)
    raw.request("GET", f"/{bucket}/k")
    reply = raw.getresponse()
    assert (reply.status, reply.reason) == (503, "Slow Down")
    assert reply.read() == SLOWDOWN_BODY
    assert int(reply.getheader("Content-Length")) == len(SLOWDOWN_BODY)
    s3_proxy.set_mode("pass")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"y" * 500
    assert s3_proxy.counters()["faults"]["slowdown"] >= 4


def test_cut_gives_a_short_body(s3_proxy, bucket):
    data = os.urandom(1_000_000)
    s3 = client(s3_proxy.url)
    s3.put_object(Bucket=bucket, Key="k", Body=data)
    s3_proxy.cut_after = 100_000
    s3_proxy.set_mode("cut")
    raw = http.client.HTTPConnection(*host_port(s3_proxy.url), timeout=5)
    raw.request("GET", signed_path(s3, bucket, "k"))
    reply = raw.getresponse()
    with pytest.raises(http.client.IncompleteRead) as caught:
        reply.read()
    assert 0 < len(caught.value.partial) < 100_000
    assert caught.value.partial == data[:len(caught.value.partial)]
    with pytest.raises(Exception, match="(?i)incomplete|ended|short|expected|connection"):
        s3.get_object(Bucket=bucket, Key="k")["Body"].read()
    s3_proxy.set_mode("pass")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == data
    assert s3_proxy.counters()["faults"]["cut"] == 2


def test_stall_times_out_a_read_then_hangs_up(s3_proxy, bucket):
    from botocore.exceptions import ReadTimeoutError

    s3 = client(s3_proxy.url, read_timeout=0.5, connect_timeout=2)
    s3.put_object(Bucket=bucket, Key="k", Body=b"z" * 100)
    raw = socket.create_connection(host_port(s3_proxy.url), timeout=5)
    s3_proxy.set_mode("stall")
    start = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        s3.get_object(Bucket=bucket, Key="k")
    assert time.monotonic() - start >= 0.4
    raw.sendall(f"GET /{bucket}/k HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    time.sleep(0.2)
    s3_proxy.set_mode("pass")
    assert raw.recv(100) == b""                              # stalled: hung up, unanswered
    raw.close()
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"z" * 100
    assert s3_proxy.counters()["faults"]["stall"] >= 2


def test_bandwidth_and_connect_latency_shape(s3_server):
    data = os.urandom(2_000_000)
    with FaultProxy(host_port(s3_server), bandwidth=4_000_000) as proxy:
        s3 = client(proxy.url)
        s3.create_bucket(Bucket="bkt")
        s3.put_object(Bucket="bkt", Key="k", Body=data)       # upstream: not shaped
        start = time.monotonic()
        assert s3.get_object(Bucket="bkt", Key="k")["Body"].read() == data
        assert time.monotonic() - start >= 0.3               # ~0.45 s at 4 MB/s
        proxy.bandwidth = None
        proxy.connect_latency_s = 0.3
        before = proxy.counters()["connections"]
        fresh = client(proxy.url)                             # a new connection pays it
        start = time.monotonic()
        fresh.head_object(Bucket="bkt", Key="k")
        assert time.monotonic() - start >= 0.3
        fresh.head_object(Bucket="bkt", Key="k")              # once: the connection stays
        assert proxy.counters()["connections"] == before + 1


def test_pipelined_requests_each_answered(s3_proxy, bucket):
    """Two requests sent back to back on one connection (as processes forked with a pooled
    connection do) both get their responses, in order, though moto closes after each."""
    s3 = client(s3_proxy.url)
    s3.put_object(Bucket=bucket, Key="a", Body=b"A" * 300_000)
    s3.put_object(Bucket=bucket, Key="b", Body=b"B" * 1000)
    raw = http.client.HTTPConnection(*host_port(s3_proxy.url), timeout=10)
    raw.connect()
    paths = [signed_path(s3, bucket, "a"), signed_path(s3, bucket, "b")]
    raw.sock.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths))
    for body in (b"A" * 300_000, b"B" * 1000):
        reply = http.client.HTTPResponse(raw.sock)
        reply.begin()
        assert reply.status == 200 and reply.read() == body
    raw.close()
