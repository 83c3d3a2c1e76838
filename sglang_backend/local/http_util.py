"""HTTP plumbing for the embedded server (FastAPI/uvicorn): auth, body limits, SGLang-shaped errors.

Kept apart from the route table (`server.py`) so the routes read as "what SGLang does" and this
file as "how a request is received safely": one ASGI middleware (`RequestGuard`: bearer token,
body-size limit) in front of every route, exception handlers that give every failure one of
SGLang's JSON error shapes, and a uvicorn protocol that answers a sender who hangs up mid-body.
Every failure becomes an `HTTPError` (or a Starlette 404/405), which the handlers turn into a
response; nothing a client sends may kill the server.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
# Drain at most this much of a refused body before answering: h11 closes a connection whose
# request body is unfinished when the answer ends, and a client still sending then sees a reset
# (EPIPE) instead of our 401/413. Past this cap it does see the reset.
DRAIN_CAP = 256 << 20
BACKLOG = 2048  # uvicorn's (and SGLang's) listen backlog: a burst of clients is never reset


class HTTPError(Exception):
    """An error response. `style` picks SGLang's body shape:
    "message" -> {"error": {"message", "code"}}, "text" -> {"error": "<text>"} (/generate)."""

    def __init__(self, status: int, message: str, style: str = "message"):
        super().__init__(message)
        self.status, self.message, self.style = status, message, style

    def body(self) -> dict[str, Any]:
        if self.style == "text":
            return {"error": self.message}
        return {"error": {"message": self.message, "code": self.status}}


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    # json.dumps, not Starlette's JSONResponse: that one refuses NaN/inf (allow_nan=False), which a
    # logprob of -inf is, and the stdlib server this replaces sent them as Python's json does.
    return Response(json.dumps(payload).encode(), status, headers=headers, media_type="application/json")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it may be reachable from elsewhere


def authorized(header: str | None, api_key: str | None) -> bool:
    """SGLang's `Authorization: Bearer <key>`; constant-time compare so timing leaks nothing."""
    if not api_key:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


class RequestGuard:
    """ASGI middleware in front of every route: the API key (every path but `open_paths`, as
    SGLang's `add_api_key_middleware`), then the body limit: a declared Content-Length over it is
    answered 413 before a byte is read; a chunked body is counted as it arrives."""

    def __init__(self, app, *, api_key: str | None, open_paths: set[str], max_body_bytes: int):
        self.app, self.api_key, self.open_paths, self.limit = app, api_key, open_paths, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in self.open_paths and not authorized(headers.get("authorization"), self.api_key):
            await drain(receive)
            return await json_response(401, {"error": "Unauthorized"})(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await drain(receive)
            return await json_response(413, HTTPError(413, self._too_big(int(declared))).body())(scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                if message.get("more_body", False):
                    await drain(receive)
                raise HTTPError(413, self._too_big(seen, "at least "))
            return message

        await self.app(scope, counted_receive, send)

    def _too_big(self, n: int, prefix: str = "") -> str:
        return (
            f"request body is {prefix}{n} bytes; the limit is {self.limit} bytes "
            f"({self.limit / 2**20:g} MiB, --max-body-mb)"
        )


async def drain(receive) -> None:
    """Read and drop what is left of a request body, up to DRAIN_CAP (see there)."""
    left = DRAIN_CAP
    while left > 0:
        message = await receive()
        left -= len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def read_body(request: Request) -> bytes:
    """The whole body; a short one (the sender hung up mid-body) is a 400 that says so."""
    try:
        data = await request.body()
    except ClientDisconnect:  # gone for good: nobody reads the answer, but say what happened
        raise HTTPError(400, "request body truncated: the client disconnected") from None
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and len(data) != int(declared):
        raise HTTPError(400, f"request body truncated: got {len(data)} of {declared} bytes")
    return data


async def read_json(request: Request, *, required: bool = False) -> dict[str, Any]:
    data = await read_body(request)
    if not data.strip():
        if required:
            raise HTTPError(400, "request body must be a JSON object; got an empty body")
        return {}
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, f"request body must be a JSON object; got {type(obj).__name__}")
    return obj


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers in one of SGLang's shapes (see HTTPError); 404/405 keep their headers."""

    async def on_http_error(request: Request, e: HTTPError) -> Response:
        return json_response(e.status, e.body())

    async def on_starlette_error(request: Request, e: StarletteHTTPException) -> Response:
        await drain(request.receive)  # the router refused before any route read the body
        message = e.detail
        if e.status_code == 404:
            message = f"no endpoint {request.url.path!r}"
        elif e.status_code == 405:
            message = f"{request.url.path} allows {(e.headers or {}).get('Allow', '?')}; got {request.method}"
        return json_response(e.status_code, {"error": {"message": message, "code": e.status_code}}, e.headers)

    async def on_bug(request: Request, e: Exception) -> Response:
        # A bug in a route answers 500 and the server lives on; Starlette re-raises it after this
        # answer, so uvicorn logs the traceback too.
        log.error("internal error on %s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return json_response(500, {"error": {"message": f"internal error: {type(e).__name__}: {e}", "code": 500}})

    app.add_exception_handler(HTTPError, on_http_error)
    app.add_exception_handler(StarletteHTTPException, on_starlette_error)
    app.add_exception_handler(Exception, on_bug)


class HalfCloseH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, except for a sender that half-closes mid-body (a trainer that
    dies during an upload, as tests/test_faults_rollout.py does it): stock uvicorn closes the
    connection on EOF, so the route never answers. Here the route gets the short body, answers
    400 "truncated" on the still-open write side, and the connection closes after that answer."""

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return None  # between requests, or already answered: let asyncio close the transport
        cycle.more_body = False  # the body ends here (read_body sees it short of Content-Length)
        cycle.keep_alive = False
        cycle.message_event.set()
        return True  # keep the transport open for writing the answer


class ReadyUvicorn(uvicorn.Server):
    """uvicorn's server, telling the thread that started it when it accepts connections."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def listen(host: str, port: int) -> socket.socket:
    """Bound and listening before serve() returns: `.url` works at once, a taken port raises here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


def want(d: dict[str, Any], key: str, kind: type | tuple, default: Any = ..., *, style: str = "message") -> Any:
    """Field `key` of a JSON body, type-checked; a missing required field is a 400 naming it."""
    if key not in d or d[key] is None:
        if default is ...:
            raise HTTPError(400, f"missing required field {key!r}", style)
        return default
    v = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON true/false must not pass as ints.
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise HTTPError(400, f"field {key!r} must be {names}; got {type(v).__name__}", style)
    return v


def as_version(v: Any, key: str = "weight_version") -> str | None:
    """A weight version as SGLang keeps it: a string (an int is taken as its decimal string)."""
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, str) and v.strip():
        return v
    raise HTTPError(400, f"{key} must be a non-empty string (or an int); got {v!r}")
