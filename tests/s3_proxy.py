"""A real TCP fault and shaping proxy for an HTTP (S3) server, stdlib only.

Put it in front of moto's S3 server (or any HTTP/1.1 server) and point a client's
`endpoint_url` at `proxy.url`::

    server, endpoint = start_moto()
    with FaultProxy(("127.0.0.1", port_of(endpoint)), bandwidth=50e6,
                    connect_latency_s=0.02) as proxy:
        s3 = boto3.client("s3", endpoint_url=proxy.url)
        proxy.outage("reset", 2.0)              # 2 s of connection resets, then "pass"
        print(proxy.counters())                 # connections, requests, bytes, faults

Tests import it from tests/ (on sys.path under pytest); benchmarks add the repo's tests/ folder
to sys.path first. It depends on nothing outside the standard library.

Modes (`set_mode`, `outage`), read by every connection at least every `POLL_S` seconds, so a
change applies to new AND existing connections:

- ``"pass"``: bytes forwarded both ways (with the shaping below).
- ``"reset"``: new connections are accepted, then closed with a TCP RST (SO_LINGER 0);
  existing ones are reset too.
- ``"stall"``: connections are read from but never answered (no byte goes downstream, a
  response under way stops); when the mode changes, every connection that stalled is closed.
- ``"slowdown"``: each HTTP request is answered by the proxy itself with
  ``HTTP/1.1 503 Slow Down`` and S3's ``SlowDown`` XML error (Content-Length set), then the
  connection is closed. A response already under way finishes.
- ``"cut"``: responses are forwarded, but a connection is closed (FIN) once ``cut_after``
  bytes of response have passed on it since it first saw the mode: a body cut short.

Shaping: ``bandwidth`` (bytes/s, server -> client, one token bucket shared by all connections)
and ``connect_latency_s`` (a delay before each new connection is connected upstream, like a
handshake to a remote region). Both off by default; both may be changed at run time.

Keep-alive: moto's server (werkzeug) closes its connection after every response, which real S3
does not. With ``keep_alive=True`` (the default) the proxy reads the responses' framing, drops
their ``Connection: close`` and keeps the client's connection open, opening a new upstream
connection for its next request (without ``connect_latency_s``, which is paid once per client
connection). So ``connections`` counts what a client would open against S3, and
``upstream_connections`` what moto saw.

One thread per connection pair (non-blocking sockets in a selector); the request heads going
upstream are parsed (Content-Length and chunked bodies are skipped), so ``requests`` counts
HTTP requests, also on keep-alive connections and for PUTs with bodies.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

MODES = ("pass", "reset", "stall", "slowdown", "cut")
POLL_S = 0.05                      # how often an idle connection looks at the mode
CHUNK = 256 * 1024                 # bytes read from a socket at once
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n'
                 b"<Error><Code>SlowDown</Code>"
                 b"<Message>Please reduce your request rate.</Message></Error>")


def _rst_close(sock: socket.socket | None) -> None:
    """Close with a TCP RST instead of a FIN (SO_LINGER on, timeout 0)."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.close()
    except OSError:
        pass


class TokenBucket:
    """Bytes per second shared by every connection; `take` never blocks."""

    QUANTUM = 16 * 1024            # the least a waiting sender is granted (no tiny packets)

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(2 * self.QUANTUM, rate * 0.05))
        self.tokens = self.burst
        self.last = time.monotonic()
        self.lock = threading.Lock()

    def take(self, want: int) -> tuple[int, float]:
        """(bytes granted now, seconds to wait before asking again when none were)."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            need = min(want, self.QUANTUM)
            if self.tokens >= need:
                granted = min(want, int(self.tokens))
                self.tokens -= granted
                return granted, 0.0
            return 0, (need - self.tokens) / self.rate

    def refund(self, n: int) -> None:
        """Give back granted bytes that could not be sent."""
        if n > 0:
            with self.lock:
                self.tokens = min(self.burst, self.tokens + n)


class _RequestHeads:
    """Splits the client -> server byte stream into HTTP requests (heads and bodies)."""

    MAX_HEAD = 1 << 20

    def __init__(self):
        self.buf = b""
        self.state = "head"        # head | body | chunk_size | chunk_data | trailer
        self.remaining = 0
        self.fields: list[dict[str, str]] = []   # the header fields of each head, in order
        self.requests: list[tuple[str, str, dict[str, str], int]] = []  # + where each began
        self.offset = 0            # stream bytes consumed so far
        self.head_begin = 0        # stream offset where the head being read began

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """Consume bytes; return (method, target) of every request head completed in them."""
        heads = []
        self.buf += data
        while self.buf:
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > self.MAX_HEAD:      # not HTTP: stop parsing
                        self.buf, self.state = b"", "opaque"
                    break
                head, self.buf = self.buf[:end], self.buf[end + 4:]
                begin, self.offset = self.head_begin, self.offset + end + 4
                self.head_begin = self.offset
                lines = head.decode("latin-1").split("\r\n")
                while lines and not lines[0]:               # stray CRLF between requests
                    lines.pop(0)
                if not lines:
                    continue
                parts = lines[0].split(" ")
                heads.append((parts[0], parts[1] if len(parts) > 1 else ""))
                fields = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    fields[name.strip().lower()] = value.strip()
                self.fields.append(fields)
                self.requests.append((*heads[-1], fields, begin))
                if "chunked" in fields.get("transfer-encoding", "").lower():
                    self.state = "chunk_size"
                elif int(fields.get("content-length", "0") or 0) > 0:
                    self.state, self.remaining = "body", int(fields["content-length"])
            elif self.state == "body" or self.state == "chunk_data":
                take = min(self.remaining, len(self.buf))
                self.buf, self.remaining = self.buf[take:], self.remaining - take
                self.offset += take
                if self.remaining == 0:
                    self.state = "head" if self.state == "body" else "chunk_size"
                    self.head_begin = self.offset
            elif self.state == "chunk_size":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    break
                line, self.buf = self.buf[:end], self.buf[end + 2:]
                self.offset += end + 2
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.remaining = "chunk_data", size + 2   # data + CRLF
            elif self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    break
                line, self.buf = self.buf[:end], self.buf[end + 2:]
                self.offset += end + 2
                if not line:
                    self.state = "head"
                    self.head_begin = self.offset
            else:                                            # opaque
                self.offset += len(self.buf)
                self.buf = b""
        return heads


class _Responses:
    """Reads the server -> client stream response by response, so that a client connection can
    stay open when the server closes its side after each response (moto's server, werkzeug,
    always does). Drops the responses' `Connection: close`; says when one ended."""

    def __init__(self):
        self.buf = b""
        self.state = "head"        # head | body | chunk_size | chunk_data | trailer | eof
        self.remaining = 0
        self.methods: list[str] = []   # methods of the requests sent upstream, in order
        self.close_after = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """(bytes for the client, whether a response that asked to close ended in them)."""
        out = bytearray()
        ended_closing = False
        self.buf += data
        while self.buf:
            if self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head, self.buf = self.buf[:end], self.buf[end + 4:]
                lines = head.decode("latin-1").split("\r\n")
                status_line = lines[0].split(" ")
                version = status_line[0]
                code = int(status_line[1]) if len(status_line) > 1 else 200
                fields = {}
                kept = [lines[0]]
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    key = name.strip().lower()
                    fields[key] = value.strip()
                    if key not in ("connection", "keep-alive"):
                        kept.append(line)
                out += ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")
                if 100 <= code < 200:
                    continue                                     # interim: the final one follows
                method = self.methods.pop(0) if self.methods else "GET"
                self.close_after = ("close" in fields.get("connection", "").lower()
                                    or version == "HTTP/1.0")
                if method == "HEAD" or code in (204, 304):
                    self.state, self.remaining = "head", 0
                elif "chunked" in fields.get("transfer-encoding", "").lower():
                    self.state = "chunk_size"
                elif "content-length" in fields:
                    self.state, self.remaining = "body", int(fields["content-length"])
                else:
                    self.state = "eof"                       # delimited by the server's close
                if self.state == "body" and self.remaining == 0:
                    self.state = "head"
                if self.state == "head" and self.close_after:
                    ended_closing = True
            elif self.state == "body" or self.state == "chunk_data":
                take = min(self.remaining, len(self.buf))
                out += self.buf[:take]
                self.buf, self.remaining = self.buf[take:], self.remaining - take
                if self.remaining == 0:
                    if self.state == "body":
                        self.state = "head"
                        ended_closing = ended_closing or self.close_after
                    else:
                        self.state = "chunk_size"
            elif self.state == "chunk_size" or self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    break
                line, self.buf = self.buf[:end], self.buf[end + 2:]
                out += line + b"\r\n"
                if self.state == "trailer":
                    if not line:
                        self.state = "head"
                        ended_closing = ended_closing or self.close_after
                elif int(line.split(b";")[0].strip() or b"0", 16) == 0:
                    self.state = "trailer"
                else:
                    self.state = "chunk_data"
                    self.remaining = int(line.split(b";")[0].strip(), 16) + 2
            else:                                            # eof-delimited body
                out += self.buf
                self.buf = b""
        return bytes(out), ended_closing


class _Connection:
    """One client connection and its upstream twin, served by one thread."""

    def __init__(self, proxy: FaultProxy, client: socket.socket):
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.heads = _RequestHeads()
        self.responses = _Responses() if proxy.keep_alive else None
        self.to_up = bytearray()        # client bytes waiting for the upstream socket
        self.to_down = bytearray()      # response bytes waiting for the client
        # whose they are: [log index, bytes] in to_down's order (a response may end, and the
        # log move on, before its bytes are sent)
        self.down_owners: list[list[int]] = []
        self.client_eof = False
        self.upstream_eof = False
        self.stalled = False
        self.cut_left: int | None = None
        self.answer_then_close = False  # a synthetic reply is in to_down: close once sent
        self.unsent = bytearray()       # client bytes not yet handed to to_up
        self.unsent_at = 0              # the stream offset of unsent's first byte
        self.sent_requests = 0          # requests handed to to_up
        self.in_flight = 0              # of those, the ones whose response has not ended
        self.bucket_wait = 0.0          # seconds until the bandwidth bucket has bytes again
        self.up_shut = False
        self.connected_once = False
        self.log: list[dict[str, Any]] = []   # this connection's forwarded requests, in order
        self.log_next = 0                     # the first of them not yet answered in full
        self.cid = next(proxy._ids)
        self.sel = selectors.DefaultSelector()

    # -- helpers ---------------------------------------------------------------------------
    def _connect_upstream(self) -> bool:
        latency = self.proxy.connect_latency_s
        if latency and not self.connected_once:  # a new client connection's handshake
            time.sleep(latency)
        self.connected_once = True
        try:
            sock = socket.create_connection(self.proxy.upstream, timeout=10)
        except OSError:
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.upstream = sock
        self.proxy._count("upstream_connections")
        return True

    def _attribute(self, sent: int) -> None:
        """`sent` bytes just sent to the client, counted to the requests whose responses they
        are (without keep-alive parsing: the newest request's)."""
        now = time.monotonic()
        while sent and self.down_owners:
            owner = self.down_owners[0]
            take = min(sent, owner[1])
            record = self.log[owner[0]]
            if record["t_first_byte"] is None:
                record["t_first_byte"] = now
            record["bytes"] += take
            owner[1] -= take
            sent -= take
            if not owner[1]:
                self.down_owners.pop(0)
        if sent:
            record = self.log[min(self.log_next, len(self.log) - 1)]
            if record["t_first_byte"] is None:
                record["t_first_byte"] = now
            record["bytes"] += sent

    def _slowdown_reply(self, method: str) -> None:
        body = b"" if method == "HEAD" else SLOWDOWN_BODY
        rid = uuid.uuid4().hex[:16].upper()
        head = ("HTTP/1.1 503 Slow Down\r\n"
                "Content-Type: application/xml\r\n"
                f"Content-Length: {len(SLOWDOWN_BODY)}\r\n"
                f"x-amz-request-id: {rid}\r\n"
                "Server: AmazonS3\r\n"
                "Connection: close\r\n\r\n").encode()
        self.to_down += head + body
        self.answer_then_close = True
        self.to_up.clear()
        self.unsent.clear()
        self.proxy._fault("slowdown")

    def _pump_requests(self) -> None:
        """Hand client bytes to the upstream side. In keep-alive mode one request at a time:
        the next request's bytes wait until the response before it has ended (the upstream,
        closing after each response, would lose a request sent behind another: clients do
        pipeline, e.g. processes forked with a pooled connection both using it)."""
        requests = self.heads.requests
        while self.unsent:
            pos = self.unsent_at
            if self.sent_requests < len(requests) and pos >= requests[self.sent_requests][3]:
                if self.in_flight and self.responses is not None:
                    return                            # wait for the response in flight
                method, target, fields, _ = requests[self.sent_requests]
                self.sent_requests += 1
                self.in_flight += 1
                if self.responses is not None:
                    self.responses.methods.append(method)
                if self.proxy.log_requests:
                    record = {"conn": self.cid, "method": method, "target": target,
                              "range": fields.get("range"), "t_request": time.monotonic(),
                              "t_first_byte": None, "t_end": None, "bytes": 0}
                    self.log.append(record)
                    with self.proxy._lock:
                        self.proxy._log.append(record)
                continue
            if self.sent_requests < len(requests):
                end = requests[self.sent_requests][3]      # where the next request begins
            elif self.heads.state == "head":
                end = self.heads.head_begin                # a head still incomplete
            else:
                end = pos + len(self.unsent)               # a body under way
            n = min(len(self.unsent), end - pos)
            if n <= 0:
                return
            self.to_up += self.unsent[:n]
            del self.unsent[:n]
            self.unsent_at += n

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            try:
                self.sel.unregister(self.upstream)
            except (KeyError, ValueError):
                pass
            _close(self.upstream)
        self.upstream = None
        self.upstream_eof = False
        self.up_shut = False

    def _lingering_close(self) -> None:
        """Send FIN, read what the client still sends for a moment, then close: a plain close
        with unread request bytes would make the kernel answer with an RST instead."""
        try:
            self.client.shutdown(socket.SHUT_WR)
            self.client.setblocking(True)
            self.client.settimeout(0.2)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                if not self.client.recv(CHUNK):
                    break
        except OSError:
            pass
        _close(self.client)
        _close(self.upstream)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        proxy = self.proxy
        try:
            self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.client.setblocking(False)
            self._loop()
        except Exception:                                    # noqa: BLE001 - a dead peer
            _close(self.client)
            _close(self.upstream)
        finally:
            self.sel.close()
            proxy._forget(self)

    def _loop(self) -> None:
        proxy = self.proxy
        while True:
            mode = proxy.mode
            if proxy._stopping.is_set():
                _close(self.client)
                _close(self.upstream)
                return
            if mode == "reset":
                proxy._fault("reset")
                _rst_close(self.client)
                _rst_close(self.upstream)
                return
            if mode == "stall":
                if not self.stalled:
                    self.stalled = True
                    proxy._fault("stall")
            elif self.stalled:                               # the stall ended: hang up
                _close(self.client)
                _close(self.upstream)
                return
            if mode == "cut" and self.cut_left is None:
                self.cut_left = proxy.cut_after
            elif mode != "cut":
                self.cut_left = None

            if (mode == "slowdown" and not self.answer_then_close and not self.in_flight
                    and self.sent_requests < len(self.heads.requests)):
                self._slowdown_reply(self.heads.requests[self.sent_requests][0])

            # read from the client: parse heads, answer or forward
            events = self._select(POLL_S)
            if proxy.mode != mode:
                continue                 # changed while waiting: act on the new one first
            if events.get("client_r"):
                data = self._recv(self.client)
                if data is None:
                    pass
                elif not data:
                    self.client_eof = True
                else:
                    proxy._count("bytes_up", len(data))
                    heads = self.heads.feed(data)
                    for method, _target in heads:
                        proxy._request(method)
                    if self.stalled or self.answer_then_close:
                        pass                                 # read, never answered
                    else:
                        self.unsent += data
                        if (mode == "slowdown" and not self.in_flight
                                and self.sent_requests < len(self.heads.requests)):
                            self._slowdown_reply(self.heads.requests[self.sent_requests][0])
            if self.unsent and not self.stalled and not self.answer_then_close:
                self._pump_requests()
            if self.to_up and self.upstream is None and not self.stalled:
                if not self._connect_upstream():
                    _rst_close(self.client)
                    return
            if events.get("up_w") or (self.to_up and self.upstream is not None):
                self._flush(self.upstream, self.to_up)
            if events.get("up_r") and not self.stalled:
                data = self._recv(self.upstream)
                if data is None:
                    pass
                elif not data:
                    self.upstream_eof = True
                elif self.responses is None:
                    self.to_down += data
                else:
                    out, ended = self.responses.feed(data)
                    self.to_down += out
                    if out and self.log_next < len(self.log):
                        self.down_owners.append([self.log_next, len(out)])
                    if ended:
                        self.in_flight = max(0, self.in_flight - 1)
                        if self.log_next < len(self.log):
                            self.log[self.log_next]["t_end"] = time.monotonic()
                            self.log_next += 1
                    if ended and not self.client_eof:
                        # the server closes after this response: the client's connection
                        # stays; its next request gets a new upstream connection
                        self._drop_upstream()
            # downstream, through the cut and the bandwidth limit
            if self.to_down and not self.stalled:
                allowed = len(self.to_down)
                if self.cut_left is not None and not self.answer_then_close:
                    allowed = min(allowed, self.cut_left)
                    if allowed == 0:
                        proxy._fault("cut")
                        _close(self.client)
                        _close(self.upstream)
                        return
                bucket = proxy._bucket if not self.answer_then_close else None
                self.bucket_wait = 0.0
                if bucket is not None and allowed:
                    allowed, self.bucket_wait = bucket.take(allowed)
                if allowed:
                    with proxy._sending if self.log else contextlib.nullcontext():
                        sent = self._send(self.client, self.to_down, allowed)
                        if self.log and sent:
                            self._attribute(sent)
                    if bucket is not None:
                        bucket.refund(allowed - sent)
                    if sent:
                        del self.to_down[:sent]
                        proxy._count("bytes_down", sent)
                        if self.cut_left is not None and not self.answer_then_close:
                            self.cut_left -= sent
                            if self.cut_left <= 0:
                                proxy._fault("cut")
                                _close(self.client)
                                _close(self.upstream)
                                return
            if self.answer_then_close and not self.to_down:
                self._lingering_close()
                return
            if self.upstream_eof and not self.to_down:
                _close(self.client)
                _close(self.upstream)
                return
            if self.client_eof and not self.to_down:
                if self.upstream is None or self.stalled or not self.to_up and self.upstream_eof:
                    _close(self.client)
                    _close(self.upstream)
                    return
                if not self.to_up and not self.up_shut:
                    self.up_shut = True
                    try:
                        self.upstream.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass

    def _select(self, timeout: float) -> dict[str, bool]:
        sel = self.sel
        want = {}
        if self.sent_requests < len(self.heads.requests) and not self.in_flight:
            timeout = 0.0                    # a request waits to go upstream: no sleeping
        # the client is read unless a synthetic answer is going out or it ended
        client_mask = 0
        if not self.client_eof:
            client_mask |= selectors.EVENT_READ
        if self.to_down and not self.stalled:
            if self.bucket_wait > 0:
                timeout = min(timeout, self.bucket_wait)  # the bucket decides when to send
            else:
                client_mask |= selectors.EVENT_WRITE
        want[self.client] = client_mask
        if self.upstream is not None:
            mask = 0
            # read upstream only while the response backlog is small (back pressure)
            if not self.upstream_eof and len(self.to_down) < CHUNK and not self.stalled:
                mask |= selectors.EVENT_READ
            if self.to_up:
                mask |= selectors.EVENT_WRITE
            want[self.upstream] = mask
        for sock, mask in want.items():
            key = sel.get_map().get(sock)
            if mask == 0:
                if key is not None:
                    sel.unregister(sock)
            elif key is None:
                sel.register(sock, mask)
            elif key.events != mask:
                sel.modify(sock, mask)
        if not sel.get_map():
            time.sleep(timeout)
            return {}
        out: dict[str, bool] = {}
        for key, ev in sel.select(timeout):
            side = "client" if key.fileobj is self.client else "up"
            if ev & selectors.EVENT_READ:
                out[side + "_r"] = True
            if ev & selectors.EVENT_WRITE:
                out[side + "_w"] = True
        return out

    @staticmethod
    def _recv(sock: socket.socket | None) -> bytes | None:
        try:
            return sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    @staticmethod
    def _send(sock: socket.socket, buf: bytearray, limit: int) -> int:
        try:
            return sock.send(memoryview(buf)[:limit])
        except (BlockingIOError, InterruptedError):
            return 0

    def _flush(self, sock: socket.socket | None, buf: bytearray) -> None:
        if sock is None or not buf:
            return
        sent = self._send(sock, buf, len(buf))
        del buf[:sent]


class FaultProxy:
    """A TCP proxy to `upstream` (host, port) on 127.0.0.1 with switchable faults and shaping.

    `url` is "http://127.0.0.1:PORT" once started. Thread-safe: `set_mode`, `outage`,
    `bandwidth`, `connect_latency_s` and `cut_after` may change while clients are connected.
    """

    def __init__(self, upstream: tuple[str, int], *, mode: str = "pass",
                 bandwidth: float | None = None, connect_latency_s: float = 0.0,
                 cut_after: int = 1024, keep_alive: bool = True, log_requests: bool = False,
                 host: str = "127.0.0.1", port: int = 0):
        self.upstream = (upstream[0], int(upstream[1]))
        self.host, self.port = host, port
        self.connect_latency_s = float(connect_latency_s)
        self.cut_after = int(cut_after)
        self.keep_alive = keep_alive
        self.log_requests = log_requests
        self._log: list[dict[str, Any]] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # held while logged bytes are sent and counted to their requests (then _lock, never the
        # other way round): request_log never sees bytes a client has but the log lacks
        self._sending = threading.Lock()
        self._mode = "pass"
        self._generation = 0
        self._bucket: TokenBucket | None = None
        self.bandwidth = bandwidth
        self.set_mode(mode)
        self._counts: Counter[str] = Counter()
        self._faults: Counter[str] = Counter()
        self._methods: Counter[str] = Counter()
        self._conns: set[_Connection] = set()
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._timers: list[threading.Timer] = []

    # -- configuration ---------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        with self._lock:
            self._mode = mode
            self._generation += 1

    def outage(self, mode: str, seconds: float) -> threading.Timer:
        """Switch to `mode` now and back to "pass" after `seconds` (unless the mode was set
        again in between). Returns the timer (`.join()` waits for the end of the outage)."""
        self.set_mode(mode)
        generation = self._generation

        def back() -> None:
            with self._lock:
                if self._generation == generation:
                    self._mode = "pass"
                    self._generation += 1

        timer = threading.Timer(seconds, back)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return timer

    @property
    def bandwidth(self) -> float | None:
        return self._bucket.rate if self._bucket is not None else None

    @bandwidth.setter
    def bandwidth(self, rate: float | None) -> None:
        self._bucket = TokenBucket(rate) if rate else None

    # -- counters --------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _fault(self, kind: str) -> None:
        with self._lock:
            self._faults[kind] += 1

    def _request(self, method: str) -> None:
        with self._lock:
            self._counts["requests"] += 1
            self._methods[method] += 1

    def counters(self) -> dict[str, Any]:
        """connections (accepted), upstream_connections, requests, bytes_up (client ->
        proxy), bytes_down (proxy -> client), active (connections open now), faults {kind: n},
        methods {HTTP method: n}."""
        with self._lock:
            out: dict[str, Any] = {name: self._counts.get(name, 0) for name in
                                   ("connections", "upstream_connections", "requests",
                                    "bytes_up", "bytes_down")}
            out["active"] = len(self._conns)
            out["faults"] = {kind: self._faults.get(kind, 0)
                             for kind in ("reset", "stall", "slowdown", "cut")}
            out["methods"] = dict(self._methods)
            return out

    def request_log(self) -> list[dict[str, Any]]:
        """With `log_requests=True`: one dict per request forwarded upstream, in arrival order:
        conn (a connection number), method, target, range (the Range header or None),
        t_request / t_first_byte (first response byte sent to the client) / t_end (response
        read from upstream in full; keep-alive mode) in time.monotonic(), bytes (sent down)."""
        with self._sending, self._lock:
            return [dict(r) for r in self._log]

    def reset_counters(self) -> None:
        with self._lock:
            self._log.clear()
            self._counts.clear()
            self._faults.clear()
            self._methods.clear()

    # -- life ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(512)
        listener.settimeout(POLL_S)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stopping.clear()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"fault-proxy-{self.port}")
        self._acceptor.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        for timer in self._timers:
            timer.cancel()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        _close(self._listener)
        self._listener = None
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._count("connections")
            if self._mode == "reset":
                self._fault("reset")
                _rst_close(client)
                continue
            conn = _Connection(self, client)
            thread = threading.Thread(target=conn.run, daemon=True, name=f"fault-proxy-conn-{conn.cid:03d}")
            with self._lock:
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._threads.discard(threading.current_thread())


# -- moto and the environment ---------------------------------------------------------------
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def aws_test_env(setenv=None) -> dict[str, str]:
    """Set the fake AWS credentials and region moto accepts (and no EC2 metadata lookups).

    `setenv(name, value)` defaults to writing os.environ; pass pytest's `monkeypatch.setenv`
    so a test's changes are undone. Returns the variables."""
    for name, value in AWS_ENV.items():
        if setenv is None:
            os.environ[name] = value
        else:
            setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        if setenv is None:
            os.environ.pop(name, None)
    return dict(AWS_ENV)


def start_moto(set_env: bool = True):
    """Start moto's S3 server on 127.0.0.1 (a free port) in this process's threads.

    Returns (server, endpoint_url); `server.stop()` ends it. Every moto server of a process
    shares one in-memory store: it is emptied first, so each server starts with no bucket."""
    import urllib.request

    from moto.server import ThreadedMotoServer

    if set_env:
        aws_test_env()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                           timeout=30).close()
    return server, endpoint


def host_port(url: str) -> tuple[str, int]:
    """("127.0.0.1", 5000) from "http://127.0.0.1:5000"."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host, int(port)


def moto_server_fixture(monkeypatch):
    """The body of an `s3_server` pytest fixture: yields moto's endpoint URL."""
    aws_test_env(monkeypatch.setenv)
    server, endpoint = start_moto(set_env=False)
    try:
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def moto_for_module() -> Iterator[str]:
    """moto's server for a module-scoped fixture: its endpoint URL, with the fake AWS
    environment set for the module and restored after it."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        aws_test_env(mp.setenv)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            mp.delenv(name, raising=False)
        server, endpoint = start_moto(set_env=False)
        try:
            yield endpoint
        finally:
            server.stop()


def fault_proxy_fixture(endpoint: str, **options):
    """The body of an `s3_proxy` pytest fixture: yields a started FaultProxy in front of the
    S3 endpoint URL."""
    proxy = FaultProxy(host_port(endpoint), **options).start()
    try:
        yield proxy
    finally:
        proxy.stop()
