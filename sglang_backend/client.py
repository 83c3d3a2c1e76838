"""`RolloutClient`: the RolloutBackend contract over HTTP, to one or more rollout servers.

    client = RolloutClient(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], api_key="k")
    results = client.generate(requests)          # one HTTP call per request, in parallel
    client.update_weights(bucket)                # every server, then a version check

Speaks SGLang's native endpoints (our embedded server, or SGLang with our plugin). Each request
goes to the server with the fewest outstanding requests (ties rotate), so a slow server gets
less work. Connection errors and 5xx are retried on another server with exponential backoff;
a 4xx is the caller's mistake and raises `RolloutError` at once. Stdlib only (`urllib`).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_backend.api import GenerateRequest, GenerateResult, WeightBucket


class RolloutError(RuntimeError):
    """A server refused a request (4xx), or every retry failed. `status` is the HTTP code or None."""

    def __init__(self, message: str, status: int | None = None, url: str | None = None):
        super().__init__(f"{url}: {message}" if url else message)
        self.status, self.url = status, url


class _Retryable(Exception):
    pass


def _message(status: int, data: bytes) -> str:
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


class RolloutClient:
    def __init__(self, urls: list[str] | str, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff: float = 0.5, max_workers: int = 64):
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.api_key, self.timeout, self.retries, self.backoff = api_key, timeout, retries, backoff
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._outstanding = {u: 0 for u in self.urls}
        self._down_until = {u: 0.0 for u in self.urls}  # failed servers sit out a backoff period
        self._rotate = itertools.count()
        self._handles: dict[str, str] = {}  # guidance handle -> the server holding its record
        self.served = {u: 0 for u in self.urls}  # requests each server answered (for balancing checks)

    # -- transport -------------------------------------------------------------------------------
    def _http(self, url: str, path: str, payload: Any = None, *, method: str | None = None,
              raw: bytes | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        """One HTTP exchange; returns (status, body) for 2xx/4xx, raises _Retryable otherwise."""
        headers = {}
        data = raw
        if raw is not None:
            headers["Content-Type"] = "application/octet-stream"
        elif payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url + path, data=data, headers=headers,
                                     method=method or ("POST" if data is not None else "GET"))
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            if e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {_message(e.code, body)}") from None
            return e.code, body
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None

    def _call(self, url: str, path: str, payload: Any = None, **kw) -> bytes:
        """Same server, with retries (weight updates must reach *this* server); 4xx raises."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                status, body = self._http(url, path, payload, **kw)
            except _Retryable as e:
                last = str(e)
                if attempt < self.retries:
                    time.sleep(self.backoff * 2**attempt)
                continue
            if status >= 400:
                raise RolloutError(_message(status, body), status, url + path)
            return body
        raise RolloutError(f"failed after {self.retries + 1} attempts: {last}", None, url + path)

    def _pick(self, avoid: set[str]) -> str:
        """Least outstanding requests among healthy servers not yet tried for this request."""
        now = time.monotonic()
        with self._lock:
            pool = [u for u in self.urls if u not in avoid and self._down_until[u] <= now] \
                or [u for u in self.urls if u not in avoid] or list(self.urls)
            k = next(self._rotate)
            pool = pool[k % len(pool):] + pool[:k % len(pool)]
            url = min(pool, key=lambda u: self._outstanding[u])
            self._outstanding[url] += 1
            return url

    # -- generation ------------------------------------------------------------------------------
    def _generate_one(self, req: GenerateRequest) -> list[GenerateResult]:
        payload = {"input_ids": list(req.input_ids), "sampling_params": req.sampling_params.to_dict(),
                   "return_logprob": req.return_logprob, "return_guidance": req.return_guidance}
        if req.rid is not None:
            payload["rid"] = req.rid
        tried: set[str] = set()
        last = ""
        for attempt in range(self.retries + 1):
            url = self._pick(tried)
            try:
                status, body = self._http(url, "/generate", payload)
            except _Retryable as e:
                last = f"{url}: {e}"
                tried.add(url)
                with self._lock:
                    self._down_until[url] = time.monotonic() + self.backoff * 2**attempt
                if len(tried) == len(self.urls):
                    tried.clear()  # every server failed once: go round again after the backoff
                if attempt < self.retries:
                    time.sleep(self.backoff * 2**attempt)
                continue
            finally:
                with self._lock:
                    self._outstanding[url] -= 1
            if status >= 400:
                raise RolloutError(_message(status, body), status, url + "/generate")
            out = json.loads(body)
            results = [GenerateResult.from_sglang(o) for o in (out if isinstance(out, list) else [out])]
            with self._lock:
                self.served[url] += 1
                self._down_until[url] = 0.0
                for r in results:
                    if r.guidance_handle:
                        self._handles[r.guidance_handle] = url
            return results
        raise RolloutError(f"generate failed after {self.retries + 1} attempts; last: {last}")

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order; a request with n>1 contributes its n results in place."""
        if not requests:
            return []
        with ThreadPoolExecutor(min(len(requests), self.max_workers)) as pool:
            parts = list(pool.map(self._generate_one, requests))
        return [r for part in parts for r in part]

    def fetch_guidance(self, handle: str) -> bytes:
        """The record's bytes, from the server that produced it (any server, if unknown)."""
        with self._lock:
            url = self._handles.pop(handle, None)
        for u in [url] if url else self.urls:
            try:
                return self._call(u, "/get_guidance", {"handle": handle})
            except RolloutError as e:
                if url or e.status != 404:
                    raise
        raise RolloutError(f"no server holds guidance record {handle!r}", 404)

    # -- weights ---------------------------------------------------------------------------------
    def _each(self, fn) -> list:
        with ThreadPoolExecutor(len(self.urls)) as pool:
            return list(pool.map(fn, self.urls))

    def _check_versions(self, version: int) -> None:
        got = self.weight_versions()
        wrong = {u: v for u, v in got.items() if v != version}
        if wrong:
            raise RolloutError(f"weight version mismatch after update: expected {version}, servers report {wrong}")

    def _weight_call(self, path: str, payload=None, raw=None):
        def one(url):
            d = json.loads(self._call(url, path, payload, raw=raw))
            if not d.get("success", False):
                raise RolloutError(d.get("message", "update failed"), 400, url + path)
        self._each(one)

    def update_weights(self, bucket: WeightBucket, *, flush_cache: bool = True) -> None:
        """Push one bucket to every server (octet-stream safetensors), then verify each version."""
        raw = bucket.to_bytes()
        self._weight_call(f"/update_weights_from_tensor?flush_cache={'true' if flush_cache else 'false'}", raw=raw)
        self._check_versions(bucket.version)

    def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True) -> None:
        self._weight_call("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version),
                                                         "flush_cache": flush_cache})
        self._check_versions(version)

    def weight_versions(self) -> dict[str, int]:
        infos = self._each(lambda u: json.loads(self._call(u, "/model_info")))
        return {u: int(i.get("weight_version") or 0) for u, i in zip(self.urls, infos)}

    # -- control ---------------------------------------------------------------------------------
    def pause(self, mode: str = "in_place") -> None:
        self._each(lambda u: self._call(u, "/pause_generation", {"mode": mode}))

    def resume(self) -> None:
        self._each(lambda u: self._call(u, "/continue_generation", {}))

    def flush_cache(self) -> None:
        """Every server drops its KV cache; RolloutError if one refuses (requests running)."""
        self._each(lambda u: self._call(u, "/flush_cache", {}))

    def health(self) -> bool:
        def ok(u):
            try:
                return self._http(u, "/health", timeout=min(self.timeout, 10))[0] == 200
            except _Retryable:
                return False
        return all(self._each(ok))

    def model_info(self) -> dict[str, Any]:
        """The first server's /model_info (all serve one model; see weight_versions for each)."""
        return json.loads(self._call(self.urls[0], "/model_info"))
