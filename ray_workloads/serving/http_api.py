"""The router's request-level helpers: routes, headers, multipart parsing, body limits, the ``/stats``
rate limit, JSON errors. Standard library and Starlette only (``ModelServer`` imports it too)."""

from __future__ import annotations

import math
from collections import OrderedDict
from email.message import Message
from email.parser import HeaderParser

from starlette.requests import Request
from starlette.responses import JSONResponse

from rayline.errors import (
    CorruptImageError,
    EmptyImageError,
    HttpError,
    ImageDecodeError,
    ImageTooLargeError,
    UnsupportedFormatError,
)

KEY_HEADER = "X-Rayline-Key"
VERSION_HEADER = "X-Rayline-Version"
ANSWER_HEADER = "X-Rayline-Model-Version"
MODEL_HEADER = "X-Rayline-Model"
# what each route does → its HTTP method; every one but "models" also under /models/<name>/
ROUTES = {"predict": "POST", "healthz": "GET", "stats": "GET", "models": "GET"}
ROUTE_LIST = (
    "POST /predict, GET /healthz, GET /stats (the default model); "
    "POST /models/<name>/predict, GET /models/<name>/healthz, GET /models/<name>/stats; GET /models"
)
# Bounds of a multipart body (a form with the image and a few fields needs far less): past
# them, 400 before any part is parsed; parsing 10 MiB of tiny parts would cost seconds of CPU
MAX_MULTIPART_PARTS = 16
MAX_PART_HEADER_BYTES = 8 * 1024
# HTTP status of an image the decoder refused, by error type (any other decode error: 422)
DECODE_STATUS: dict[type[ImageDecodeError], int] = {
    EmptyImageError: 400,
    UnsupportedFormatError: 415,
    CorruptImageError: 422,
    ImageTooLargeError: 422,
}


class RateLimit:
    """A token bucket per client: ``burst`` requests at once, then ``per_s`` a second.

    At most ``max_clients`` buckets are kept, and only those not full (a full one is what an unknown
    client starts with). When every kept bucket is still refilling, clients without one share one
    overflow bucket: the limit fails closed, and a flood from many addresses never resets the bucket
    of an address it pushed out.
    """

    def __init__(self, per_s: float, burst: int, max_clients: int = 10_000) -> None:
        self.per_s, self.burst, self.max_clients = per_s, float(burst), max_clients
        # client: (tokens, at), least recently seen first: those refilled first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._overflow = (self.burst, 0.0)

    def retry_after(self, client: str, now: float) -> float | None:
        """None: admitted (one token taken); else the seconds until ``client`` has a token again."""
        self._forget_full(now)
        if client in self._buckets or len(self._buckets) < self.max_clients:
            state = self._buckets.pop(client, (self.burst, now))
            tokens, wait = self._take(state, now)
            self._buckets[client] = (tokens, now)
        else:
            tokens, wait = self._take(self._overflow, now)
            self._overflow = (tokens, now)
        return wait

    def _take(self, state: tuple[float, float], now: float) -> tuple[float, float | None]:
        """The bucket's tokens after this request, and None (admitted) or the seconds to wait."""
        tokens = self._refilled(state, now)
        if tokens >= 1.0:
            return tokens - 1.0, None
        return tokens, (1.0 - tokens) / self.per_s

    def _refilled(self, state: tuple[float, float], now: float) -> float:
        tokens, at = state
        return min(self.burst, tokens + max(0.0, now - at) * self.per_s)

    def _forget_full(self, now: float) -> None:
        """Drop the least recently seen buckets that are full again (amortised: each goes once)."""
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if self._refilled(oldest, now) < self.burst:
                return
            self._buckets.popitem(last=False)

    def clients(self) -> int:
        return len(self._buckets)


def route(path: str) -> tuple[str | None, str]:
    """``(model, action)`` of a request path (model None: the default model); 404 for anything else:
    ``/predict`` → (None, "predict"), ``/models/photos/predict`` → ("photos", "predict")."""
    parts = path.strip("/").split("/")
    if len(parts) == 1 and parts[0] in ROUTES:
        return None, parts[0]
    if len(parts) == 3 and parts[0] == "models" and parts[1] and parts[2] in ROUTES and parts[2] != "models":
        return parts[1], parts[2]
    raise HttpError(404, "NotFound", f"no route {path}; routes: {ROUTE_LIST}")


def _headers(text: str) -> Message:
    return HeaderParser().parsestr(text.strip("\r\n") + "\r\n\r\n")


def _multipart_parts(body: bytes, boundary: bytes, max_parts: int) -> list[bytes]:
    """The raw parts (headers and content) between the delimiters; 400 past ``max_parts``, found delimiter
    by delimiter: a body of a hundred thousand tiny parts is refused before any header is parsed."""
    delimiter = b"\r\n--" + boundary  # RFC 2046: CRLF belongs to the delimiter, not to the content
    if body.startswith(delimiter[2:]):  # the first delimiter may open the body, without the CRLF
        at = len(delimiter) - 2
    else:
        found = body.find(delimiter)  # past a preamble
        if found < 0:
            return []
        at = found + len(delimiter)
    parts: list[bytes] = []
    while not body.startswith(b"--", at):  # "--" after a delimiter: the closing one
        if len(parts) == max_parts:
            raise HttpError(400, "BadMultipart", f"multipart body has more than {max_parts} parts (the limit)")
        end = body.find(delimiter, at)
        parts.append(body[at:] if end < 0 else body[at:end])
        if end < 0:
            break  # no closing delimiter: the rest is the last part
        at = end + len(delimiter)
    return parts


def _part(chunk: bytes, max_header_bytes: int) -> tuple[str | None, str | None, bytes] | None:
    """``(name, filename, content)`` of one raw part; None without a header block."""
    end = chunk.find(b"\r\n\r\n", 0, max_header_bytes + 4)  # + 4: the blank line ending them
    if end < 0:
        if len(chunk) > max_header_bytes:
            raise HttpError(
                400, "BadMultipart", f"a multipart part's headers are over {max_header_bytes} bytes (the limit)"
            )
        return None
    headers = _headers(chunk[:end].decode("latin-1"))
    name = headers.get_param("name", header="content-disposition")
    return name if isinstance(name, str) else None, headers.get_filename(), chunk[end + 4 :]


def multipart_image(
    body: bytes,
    content_type: str,
    *,
    max_parts: int = MAX_MULTIPART_PARTS,
    max_header_bytes: int = MAX_PART_HEADER_BYTES,
) -> bytes:
    """The image part of a multipart/form-data body: the part named ``file`` or ``image``, else the one
    with a filename, else the only part. 400 over ``max_parts`` parts or ``max_header_bytes`` of headers
    in one part. CPU-bound: the router runs it in a worker thread."""
    boundary = _headers(f"content-type: {content_type}").get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise HttpError(400, "BadMultipart", "multipart/form-data without a boundary parameter")
    raw = _multipart_parts(body, boundary.encode("latin-1"), max_parts)
    parts = [p for p in (_part(chunk, max_header_bytes) for chunk in raw) if p is not None]
    named = [p for p in parts if p[0] in ("file", "image")] or [p for p in parts if p[1] is not None]
    chosen = named or (parts if len(parts) == 1 else [])
    if chosen:
        return chosen[0][2]
    names = [p[0] for p in parts]
    raise HttpError(400, "BadMultipart", f"no image part in the multipart body (parts: {names}); name it 'file'")


def parse_since(raw: str | None) -> float | None:
    """The ``since`` query parameter of ``/stats``: a finite unix time (400 for nan, inf or not a number)."""
    if raw is None:
        return None
    try:
        since = float(raw)
    except ValueError as exc:
        raise HttpError(400, "BadRequest", f"since must be a unix timestamp, got {raw!r}") from exc
    if not math.isfinite(since):  # float() takes "nan" and "inf", which no sample compares sensibly with
        raise HttpError(400, "BadRequest", f"since must be a finite unix timestamp, got {raw!r}")
    return since


def error_response(
    status: int, error: str, detail: str, version: int | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    headers = {**(headers or {}), **({ANSWER_HEADER: str(version)} if version is not None else {})}
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers or None)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 as soon as it is (or is declared) over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise HttpError(400, "BadRequest", f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise HttpError(413, "PayloadTooLarge", f"body is {int(declared)} bytes; the limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, "PayloadTooLarge", f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
