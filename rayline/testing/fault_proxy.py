"""A fault-injecting HTTP proxy in front of an object store's server, on loopback: latency, 503, 500, 403, resets,
cut bodies.

``python -m rayline.testing.fault_proxy --upstream http://127.0.0.1:<port> --port <port> [--config '<JSON>']``

Every request is forwarded unchanged (its Host header and SigV4 signature included) over a pool of keep-alive
connections to the upstream server, after ``latency_ms`` (only those whose path matches ``latency_regex``, when
set). A request whose method is in ``methods`` and whose path matches ``key_regex`` may be faulted instead:
a ``503`` (S3's ``SlowDown``), a ``500`` (``InternalError``), a ``403`` (``AccessDenied``, what a bucket policy
that refuses the caller answers), each in the error format of the server's protocol (``flavor``: ``s3``'s XML,
``gcs``'s JSON API error, ``azure``'s XML with its ``x-ms-error-code``); a ``reset`` (closed with SO_LINGER 0:
the client reads an RST and no answer); or a ``truncate`` (the upstream's answer with its Content-Length but
only the first half of its body, then the connection closed). Which ones: those matching ``always_fail``
(a path regex), the first ``fail_first_n`` requests of each matching path, and a ``fault_rate`` fraction of
the others (drawn with ``seed``).

Two settings play a server or a network that misbehaves without failing: ``strip_conditional`` forwards every
request without its ``If-None-Match`` and ``If-Match`` headers (a gateway that ignores conditional writes), and
``hold_regex`` keeps each request whose method is in ``hold_methods`` and whose path matches until
``POST /__proxy__/release`` (a write that lands long after its writer sent it).

Control, on the proxy's own port: ``POST /__proxy__/config`` (JSON: the fields to change), ``POST
/__proxy__/reset`` (no faults, no latency, counters zeroed, held requests let go), ``POST /__proxy__/release``
(held requests let go), ``GET /__proxy__/stats`` (``delayed`` and ``held`` count requests delayed and held).

Only the standard library (and uvloop when installed): tests and benches start it by path, in its own session,
and stop it by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import re
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

CONTROL = "/__proxy__/"
FAULT_KINDS = ("503", "500", "403", "reset", "truncate")
# What a fault rate draws from unless told otherwise: the faults a retry gets past (a 403 is the caller's own)
DEFAULT_KINDS = ("503", "500", "reset")
FLAVORS = ("s3", "gcs", "azure")
# status line, then the error's code in each flavor: S3's, the JSON API's reason, Azure's x-ms-error-code
_ERRORS = {
    "503": (b"503 Slow Down", {"s3": "SlowDown", "gcs": "backendError", "azure": "ServerBusy"}),
    "500": (b"500 Internal Server Error", {"s3": "InternalError", "gcs": "backendError", "azure": "InternalError"}),
    "403": (b"403 Forbidden", {"s3": "AccessDenied", "gcs": "forbidden", "azure": "AuthorizationPermissionMismatch"}),
}
_MESSAGES = {
    "503": "Please reduce your request rate.",
    "500": "Internal error. Please try again.",
    "403": "Access Denied",
}
_NO_BODY_STATUS = {204, 304}
_CONDITIONAL_HEADERS = (b"if-none-match", b"if-match")


@dataclass
class ProxyConfig:
    """What the proxy does to requests; every field can be changed at run time."""

    latency_ms: float = 0.0
    latency_regex: str = ""  # on the request's path; "" delays every request
    fault_rate: float = 0.0
    fault_kinds: list[str] = field(default_factory=lambda: list(DEFAULT_KINDS))
    methods: list[str] = field(default_factory=lambda: ["GET"])
    key_regex: str = ""  # on the request's path (/bucket/key); "" matches every path
    fail_first_n: int = 0
    always_fail: str | None = None
    seed: int | None = None
    strip_conditional: bool = False  # forward writes without If-None-Match / If-Match
    hold_regex: str | None = None  # on the request's path: held until released
    hold_methods: list[str] = field(default_factory=lambda: ["PUT"])
    flavor: str = "s3"  # the protocol whose error format faults are answered in

    def updated(self, changes: dict[str, Any]) -> ProxyConfig:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown proxy settings {sorted(unknown)}; known: {sorted(known)}")
        new = dataclasses.replace(self, **changes)
        if not set(new.fault_kinds) <= set(FAULT_KINDS) or not new.fault_kinds:
            raise ValueError(f"fault_kinds must be some of {FAULT_KINDS}")
        if new.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, not {new.flavor!r}")
        for pattern in (new.key_regex, new.latency_regex, new.always_fail, new.hold_regex):
            re.compile(pattern or "")
        return new


@dataclass
class _Request:
    method: str
    path: str
    head: bytes  # request line and headers as forwarded, ending in a blank line
    body: bytes
    close: bool


class _State:
    def __init__(self, config: ProxyConfig) -> None:
        self.set(config)

    def set(self, config: ProxyConfig) -> None:
        self.config = config
        self.key = re.compile(config.key_regex)
        self.delayed = re.compile(config.latency_regex)
        self.always = re.compile(config.always_fail) if config.always_fail else None
        self.hold = re.compile(config.hold_regex) if config.hold_regex else None
        self.rng = random.Random(config.seed)
        self.seen: Counter[str] = Counter()  # matching requests per path, for fail_first_n
        self.stats: Counter[str] = Counter()

    def fault_for(self, method: str, path: str) -> str | None:
        """The fault to answer this request with, or None to forward it."""
        cfg = self.config
        if method not in cfg.methods or not self.key.search(path):
            return None
        count = self.seen[path]
        self.seen[path] += 1
        kinds = cfg.fault_kinds
        if (self.always is not None and self.always.search(path)) or count < cfg.fail_first_n:
            return kinds[count % len(kinds)]
        if cfg.fault_rate > 0 and self.rng.random() < cfg.fault_rate:
            return self.rng.choice(kinds)
        return None

    def holds(self, method: str, path: str) -> bool:
        return self.hold is not None and method in self.config.hold_methods and bool(self.hold.search(path))


def _without(head: bytes, names: tuple[bytes, ...]) -> bytes:
    """The message's head without the headers ``names`` (lower case)."""
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if line.partition(b":")[0].strip().lower() not in names)


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The message body as sent (chunked bodies verbatim)."""
    if b"chunked" in (_header(head, b"transfer-encoding") or b"").lower():
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = await reader.readuntil(b"\r\n")
                    parts.append(trailer)
                    if trailer == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    length = _header(head, b"content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return b""


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    method, target, version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
    if (_header(head, b"expect") or b"").lower() == b"100-continue":
        # answer it here: the body is read before anything is forwarded, and upstream never sees the Expect
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = _without(head, (b"expect",))
    body = await _read_body(reader, head)
    connection = (_header(head, b"connection") or b"").lower()
    close = connection == b"close" or (version == "HTTP/1.0" and connection != b"keep-alive")
    return _Request(method, unquote(urlparse(target).path), head, body, close)


class _Upstream:
    """Keep-alive connections to the upstream server, reused one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def exchange(self, request: _Request) -> tuple[bytes, bool]:
        """The upstream's whole answer to ``request``, and whether the client connection must close after it."""
        reused = bool(self.idle)
        conn = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        try:
            return await self._exchange(conn, request)
        except (asyncio.IncompleteReadError, ConnectionError):
            conn[1].close()
            if not reused:
                raise
            # an idle connection the server had closed meanwhile: once more on a fresh one
            return await self._exchange(await asyncio.open_connection(self.host, self.port), request)

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: _Request
    ) -> tuple[bytes, bool]:
        reader, writer = conn
        writer.write(request.head + request.body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        while head.split(b" ", 2)[1].startswith(b"1"):  # an interim 1xx answer: the real one follows
            head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        to_eof = False
        if request.method == "HEAD" or status in _NO_BODY_STATUS:
            body = b""
        elif _header(head, b"content-length") is None and _header(head, b"transfer-encoding") is None:
            body, to_eof = await reader.read(), True  # the body ends with the connection
        else:
            body = await _read_body(reader, head)
        close = to_eof or (_header(head, b"connection") or b"").lower() == b"close"
        if close:
            writer.close()
        else:
            self.idle.append(conn)
        return head + body, to_eof


def _error_answer(kind: str, method: str, path: str, flavor: str) -> bytes:
    status, codes = _ERRORS[kind]
    code, message = codes[flavor], _MESSAGES[kind]
    with_body = method != "HEAD"
    if flavor == "gcs":
        error = {"code": int(status[:3]), "message": message, "errors": [{"reason": code, "message": message}]}
        return _answer(status, b"application/json", json.dumps({"error": error}).encode(), with_body=with_body)
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{path}</Resource><RequestId>rayline-proxy</RequestId></Error>"
    ).encode()
    header = f"x-ms-error-code: {code}" if flavor == "azure" else "x-amz-request-id: rayline-proxy"
    return _answer(status, b"application/xml", body, f"{header}\r\n".encode(), with_body=with_body)


def _answer(status: bytes, content_type: bytes, body: bytes, headers: bytes = b"", with_body: bool = True) -> bytes:
    """A whole HTTP/1.1 answer; ``headers``: more header lines, each ending in CRLF."""
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\n" + headers
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    return head + body if with_body else head


def _cut_short(answer: bytes) -> bytes:
    """The answer's head (its Content-Length unchanged) and the first half of its body (at least one byte less)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n" + body[: len(body) // 2]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close the client's connection so that it reads an RST, not an answer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _json_answer(status: bytes, payload: Any) -> bytes:
    return _answer(status, b"application/json", json.dumps(payload).encode())


class Proxy:
    def __init__(self, upstream: str, config: ProxyConfig) -> None:
        parsed = urlparse(upstream)
        self.upstream = _Upstream(parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.state = _State(config)
        self.released = asyncio.Event()

    def release(self) -> None:
        """Let every held request go on, and hold the next ones afresh."""
        self.released.set()
        self.released = asyncio.Event()

    def control(self, request: _Request) -> bytes:
        action = (request.method, request.path[len(CONTROL) :])
        try:
            if action == ("GET", "stats"):
                return _json_answer(b"200 OK", {**self.state.stats, "config": dataclasses.asdict(self.state.config)})
            if action == ("POST", "config"):
                changes = json.loads(request.body or b"{}")
                stats = self.state.stats
                self.state.set(self.state.config.updated(changes))
                self.state.stats = stats  # a new setting keeps the counts; reset zeroes them
            elif action == ("POST", "reset"):
                self.state.set(ProxyConfig())
                self.release()
            elif action == ("POST", "release"):
                self.release()
            else:
                return _json_answer(b"404 Not Found", {"error": f"no control {request.method} {request.path}"})
        except (ValueError, TypeError) as exc:
            return _json_answer(b"400 Bad Request", {"error": str(exc)})
        return _json_answer(b"200 OK", dataclasses.asdict(self.state.config))

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (request := await _read_request(reader, writer)) is not None:
                if request.path.startswith(CONTROL):
                    writer.write(self.control(request))
                    await writer.drain()
                    continue
                if not await self.proxy(request, writer) or request.close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def proxy(self, request: _Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request (forwarded or faulted); False when the client connection is done."""
        stats = self.state.stats
        stats["requests"] += 1
        stats[f"method_{request.method}"] += 1
        if self.state.config.latency_ms > 0 and self.state.delayed.search(request.path):
            stats["delayed"] += 1
            await asyncio.sleep(self.state.config.latency_ms / 1000)
        if self.state.holds(request.method, request.path):
            stats["held"] += 1
            await self.released.wait()
        if self.state.config.strip_conditional:
            # the signature still names them: moto ignores it
            request = dataclasses.replace(request, head=_without(request.head, _CONDITIONAL_HEADERS))
        fault = self.state.fault_for(request.method, request.path)
        if fault is not None:
            stats["faults"] += 1
            stats[f"fault_{fault}"] += 1
        if fault == "reset":
            _reset(writer)
            return False
        if fault is not None and fault != "truncate":
            writer.write(_error_answer(fault, request.method, request.path, self.state.config.flavor))
            await writer.drain()
            return True
        try:
            answer, close = await self.upstream.exchange(request)
        except (OSError, asyncio.IncompleteReadError):
            stats["upstream_errors"] += 1
            _reset(writer)  # what a client of a dead server sees
            return False
        if fault == "truncate":
            writer.write(_cut_short(answer))
            await writer.drain()
            writer.transport.close()  # a clean close after the partial body: the client finds it short
            return False
        stats["forwarded"] += 1
        writer.write(answer)
        await writer.drain()
        return not close


async def serve(upstream: str, port: int, config: ProxyConfig) -> None:
    proxy = Proxy(upstream, config)
    server = await asyncio.start_server(proxy.serve_connection, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the server, http://host:port")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", default="{}", help="ProxyConfig fields as JSON")
    args = parser.parse_args(argv)
    config = ProxyConfig().updated(json.loads(args.config))
    try:
        import uvloop  # less CPU per request: the bench measures throughput through this process

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(args.upstream, args.port, config))


if __name__ == "__main__":
    main()
