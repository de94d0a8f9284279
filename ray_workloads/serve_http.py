"""The router's request-level helpers: routes, headers, multipart parsing, JSON errors, version choice.

Standard library and Starlette only; used by ``serve_app.Router`` (and ``ModelServer`` for the
status of an undecodable image).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from email.message import Message
from email.parser import HeaderParser

from starlette.requests import Request
from starlette.responses import JSONResponse

from ray_workloads.images import (
    CorruptImageError,
    EmptyImageError,
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
# HTTP status of an image the decoder refused, by error type (any other decode error: 422)
DECODE_STATUS: dict[type[ImageDecodeError], int] = {
    EmptyImageError: 400,
    UnsupportedFormatError: 415,
    CorruptImageError: 422,
    ImageTooLargeError: 422,
}


def choose_version(weights: Mapping[int, float], key: str | None, rng: random.Random) -> int | None:
    """Weighted choice; with a key, deterministic (hash of the key), so one key sees one version."""
    live = [(v, w) for v, w in sorted(weights.items()) if w > 0]
    if not live:
        return None
    total = sum(w for _, w in live)
    if key:
        point = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
    else:
        point = rng.random()
    point *= total
    acc = 0.0
    for version, weight in live:
        acc += weight
        if point < acc:
            return version
    return live[-1][0]


class HttpError(Exception):
    """A request answered with a 4xx/5xx JSON error."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


def route(path: str) -> tuple[str | None, str]:
    """``(model, action)`` of a request path (model None: the default model); 404 for anything else.

    ``/predict`` → (None, "predict"), ``/models/photos/predict`` → ("photos", "predict"),
    ``/models`` → (None, "models").
    """
    parts = path.strip("/").split("/")
    if len(parts) == 1 and parts[0] in ROUTES:
        return None, parts[0]
    if len(parts) == 3 and parts[0] == "models" and parts[1] and parts[2] in ROUTES and parts[2] != "models":
        return parts[1], parts[2]
    raise HttpError(404, "NotFound", f"no route {path}; routes: {ROUTE_LIST}")


def _headers(text: str) -> Message:
    return HeaderParser().parsestr(text.strip("\r\n") + "\r\n\r\n")


def multipart_image(body: bytes, content_type: str) -> bytes:
    """The image part of a multipart/form-data body (standard library only).

    The part named ``file`` or ``image``, else the one with a filename, else the only part.
    """
    boundary = _headers(f"content-type: {content_type}").get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise HttpError(400, "BadMultipart", "multipart/form-data without a boundary parameter")
    parts: list[tuple[str | None, str | None, bytes]] = []
    for chunk in body.split(b"--" + boundary.encode("latin-1"))[1:]:
        if chunk.startswith(b"--"):
            break  # the closing delimiter
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep:
            continue
        headers = _headers(head.decode("latin-1"))
        name = headers.get_param("name", header="content-disposition")
        parts.append(
            (
                name if isinstance(name, str) else None,
                headers.get_filename(),
                content[:-2] if content.endswith(b"\r\n") else content,
            )
        )
    named = [p for p in parts if p[0] in ("file", "image")] or [p for p in parts if p[1] is not None]
    chosen = named or (parts if len(parts) == 1 else [])
    if chosen:
        return chosen[0][2]
    names = [p[0] for p in parts]
    raise HttpError(400, "BadMultipart", f"no image part in the multipart body (parts: {names}); name it 'file'")


def error_response(status: int, error: str, detail: str, version: int | None = None) -> JSONResponse:
    headers = {ANSWER_HEADER: str(version)} if version is not None else None
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


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
