"""The rollout client's errors and the reader of SGLang's error bodies (used by `client.py`).

`RolloutError` is what callers see; `Retryable` is the client's own signal to its retry policy;
`error_message` reads any of SGLang's error shapes (see sglang_backend/local/server.py).
"""

from __future__ import annotations

import json


class RolloutError(RuntimeError):
    """A server refused a request (4xx), or every retry failed. `status` is the HTTP code or None."""

    def __init__(self, message: str, status: int | None = None, url: str | None = None):
        super().__init__(f"{url}: {message}" if url else message)
        self.status, self.url = status, url


class Retryable(Exception):
    """5xx (the server is up but failing) or, with `dead=True`, no usable connection."""

    def __init__(self, message: str, dead: bool = False):
        super().__init__(message)
        self.dead = dead


def error_message(status: int, data: bytes) -> str:
    """The error text of any of SGLang's error shapes (or the raw body)."""
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return data.decode(errors="replace").strip() or f"HTTP {status}"
    if isinstance(d, dict):
        err = d.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in d:
            return str(d["message"])
    return json.dumps(d)
