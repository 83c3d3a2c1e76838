"""Request helpers that test_server_http.py and test_server_http_weights.py share (their fixtures:
server_http_fixtures.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from safetensors.torch import load_file

from sglang_backend.api import WeightBucket

KEY = "test-key"
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def http(url, path, payload=None, *, key=KEY, raw=None, method=None, ctype=None):
    """(status, body bytes, headers) of one request; error statuses are returned, not raised."""
    data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
    headers = {"Content-Type": ctype or ("application/octet-stream" if raw is not None else "application/json")}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def jhttp(*a, **kw):
    status, body, _ = http(*a, **kw)
    return status, (json.loads(body) if body else None)


def bucket_of(path, version) -> WeightBucket:
    return WeightBucket(load_file(str(path / "model.safetensors")), version)
