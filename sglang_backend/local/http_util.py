"""HTTP plumbing for the embedded server: auth, bounded body reads, SGLang-shaped errors.

Kept apart from the route table (`server.py`) so the routes read as "what SGLang does" and this
file as "how a request is received safely". Every failure here becomes an `HTTPError`, which
the handler turns into a response; nothing a client sends may kill the server.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
from http.server import BaseHTTPRequestHandler
from typing import Any

# Drain at most this much of a refused body before answering: a client still sending a body
# we never read would otherwise see a connection reset instead of our 413/401.
_DRAIN_CAP = 256 << 20


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it may be reachable from elsewhere


def check_auth(handler: BaseHTTPRequestHandler, api_key: str | None) -> None:
    """SGLang's `Authorization: Bearer <key>`; constant-time compare so timing leaks nothing."""
    if not api_key:
        return
    got = handler.headers.get("Authorization", "")
    scheme, _, token = got.partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
    if not ok:
        raise HTTPError(401, "Unauthorized", style="text")


class Body:
    """The request body, read at most once and never past the configured limit."""

    def __init__(self, handler: BaseHTTPRequestHandler, limit: int):
        self.h, self.limit, self.consumed = handler, limit, False
        te = handler.headers.get("Transfer-Encoding", "")
        if te and te.lower() != "identity":
            # No chunked decoding here: refuse up front and drop the connection, whose framing
            # we cannot follow.
            self.h.close_connection = True
            self.consumed = True
            raise HTTPError(411, "chunked request bodies are not supported; send Content-Length")
        raw = handler.headers.get("Content-Length")
        try:
            self.length = int(raw) if raw is not None else 0
            if self.length < 0:
                raise ValueError
        except ValueError:
            self.h.close_connection = True
            self.consumed = True
            raise HTTPError(400, f"bad Content-Length header {raw!r}") from None

    def read(self) -> bytes:
        if self.length > self.limit:
            raise HTTPError(413, f"request body is {self.length} bytes; the limit is {self.limit} bytes "
                                 f"({self.limit / 2**20:g} MiB, --max-body-mb)")
        self.consumed = True
        data = self.h.rfile.read(self.length) if self.length else b""
        if len(data) != self.length:
            self.h.close_connection = True
            raise HTTPError(400, f"request body truncated: got {len(data)} of {self.length} bytes")
        return data

    def json(self, *, required: bool = False) -> dict[str, Any]:
        data = self.read()
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

    def discard(self) -> None:
        """Read and drop an unread body so the client can read our answer; huge ones: hang up."""
        if self.consumed:
            return
        self.consumed = True
        left = self.length
        if left > _DRAIN_CAP:
            self.h.close_connection = True
            return
        try:
            while left > 0:
                chunk = self.h.rfile.read(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass
        self.h.close_connection = True


def send(handler: BaseHTTPRequestHandler, status: int, payload: Any = None, *,
         content_type: str = "application/json", headers: dict[str, str] | None = None) -> None:
    """Write one complete response (always with Content-Length, so keep-alive stays framed)."""
    if payload is None:
        data = b""
    elif isinstance(payload, (bytes, bytearray)):
        data = bytes(payload)
    elif isinstance(payload, str):
        data = payload.encode()
    else:
        data = json.dumps(payload).encode()
    handler.send_response(status)
    if data or content_type != "application/json":
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    if data and handler.command != "HEAD":
        handler.wfile.write(data)


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
