"""`RolloutClient`: the RolloutBackend contract over HTTP, to one or more rollout servers.

    client = RolloutClient(["http://10.0.0.1:30000", "http://10.0.0.2:30000"], api_key="k")
    results = client.generate(requests)          # one HTTP call per request, in parallel
    client.update_weights(bucket)                # every server, then a version check

Speaks SGLang's native endpoints (our embedded server, or SGLang with our plugin). Each request
goes to the server with the fewest outstanding requests (ties rotate), so a slow server gets
less work. Connection errors and 5xx are retried on another server with exponential backoff;
a 4xx is the caller's mistake and raises `RolloutError` at once.

Transport: one `httpx.Client` per server (a pooled keep-alive connection per concurrent request;
`timeout` s for connect, each read and each write), whose transport retries a failed connect once
at once (a server restarting on its port); the retry policy above it (`retries` more attempts,
`backoff` x 2^k s apart, 5xx and connection failures only) is tenacity's.

Dead servers (a connection failure) get no traffic until a probe finds them up and caught up
with the current weights: `client_readmit.DeadServerReadmission`. `dead()` lists them.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from megatron_trace.guidance import GuidanceRecord
from sglang_backend.api import (
    GUIDANCE_KEY,
    TRACE_POLICY_PATH,
    GenerateRequest,
    GenerateResult,
    WeightBucket,
    serves_version,
    wire_version,
)
from sglang_backend.client_readmit import DeadServerReadmission
from sglang_backend.http_errors import Retryable, RolloutError, error_message


class RolloutClient(DeadServerReadmission):
    def __init__(
        self,
        urls: list[str] | str,
        api_key: str | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_workers: int = 64,
        probe_interval: float = 2.0,
        keep_last_weights: bool = True,
        readmit_hook: Callable[[str, int], None] | None = None,
    ):
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
        # guidance handle -> its record (or the error fetching it), fetched by generate's worker as
        # soon as the sample finishes: the fetches overlap the batch's other generations
        self._prefetched: dict[str, bytes | RolloutError] = {}
        self.served = {u: 0 for u in self.urls}  # requests each server answered (for balancing checks)
        self.failures = {u: 0 for u in self.urls}  # failed attempts per server (each retried elsewhere)
        # Dead-server handling: see the module docstring.
        self.probe_interval, self.keep_last_weights, self.readmit_hook = probe_interval, keep_last_weights, readmit_hook
        self._dead: set[str] = set()
        self._weights_lock = threading.Lock()  # updates and re-admissions never interleave
        self._version: int | str | None = None  # the last version pushed through this client
        self._last_push: tuple[str, Any] | None = None  # ("tensor", raw bytes, flush) or ("disk", payload)
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self.events: list[tuple[float, str, str]] = []  # (monotonic time, url, "dead"/"readmitted"/...)
        # keepalive_expiry 2 s: below the servers' keep-alive (ours 30 s, uvicorn's default 5 s), so
        # the client drops an idle connection before a server can close it under a new request.
        # trust_env=False: rollout traffic is server to server; an HTTP(S)_PROXY meant for the web
        # must not route it.
        limits = httpx.Limits(
            max_connections=max_workers + 8, max_keepalive_connections=max_workers, keepalive_expiry=2.0
        )
        self._sessions = {
            u: httpx.Client(
                base_url=u, timeout=timeout, trust_env=False, transport=httpx.HTTPTransport(retries=1, limits=limits)
            )
            for u in self.urls
        }

    # -- transport -------------------------------------------------------------------------------
    def _http(
        self,
        url: str,
        path: str,
        payload: Any = None,
        *,
        method: str | None = None,
        raw: bytes | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes]:
        """One HTTP exchange; returns (status, body) for 2xx/4xx, raises Retryable otherwise."""
        headers = {}
        data = raw
        if raw is not None:
            headers["Content-Type"] = "application/octet-stream"
        elif payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            r = self._sessions[url].request(
                method or ("POST" if data is not None else "GET"),
                path,
                content=data,
                headers=headers,
                timeout=timeout or self.timeout,
            )
        except httpx.TransportError as e:  # refused, reset, timed out, cut off mid-answer
            raise Retryable(f"{type(e).__name__}: {e}", dead=True) from None
        if r.status_code >= 500:
            raise Retryable(f"HTTP {r.status_code}: {error_message(r.status_code, r.content)}")
        return r.status_code, r.content

    def _retrying(self) -> Retrying:
        """`retries` more attempts after the first, `backoff` * 2^k s apart, on Retryable only."""
        return Retrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff),
            retry=retry_if_exception_type(Retryable),
        )

    def _call(self, url: str, path: str, payload: Any = None, **kw) -> bytes:
        """Same server, with retries (weight updates must reach *this* server); 4xx raises."""
        try:
            for attempt in self._retrying():
                with attempt:
                    status, body = self._http(url, path, payload, **kw)
        except RetryError as e:
            raise RolloutError(
                f"failed after {self.retries + 1} attempts: {e.last_attempt.exception()}", None, url + path
            ) from None
        if status >= 400:
            raise RolloutError(error_message(status, body), status, url + path)
        return body

    def _pick(self, avoid: set[str]) -> str | None:
        """Least outstanding requests among live servers not yet tried for this request (None: all dead)."""
        now = time.monotonic()
        with self._lock:
            live = [u for u in self.urls if u not in self._dead]
            if not live:
                return None
            pool = (
                [u for u in live if u not in avoid and self._down_until[u] <= now]
                or [u for u in live if u not in avoid]
                or live
            )
            k = next(self._rotate)
            pool = pool[k % len(pool) :] + pool[: k % len(pool)]
            url = min(pool, key=lambda u: self._outstanding[u])
            self._outstanding[url] += 1
            return url

    # -- generation ------------------------------------------------------------------------------
    def _generate_one(self, req: GenerateRequest) -> list[GenerateResult]:
        sp = req.sampling_params.to_dict()
        if req.return_guidance:  # SGLang drops unknown top-level keys; custom_params reach its scheduler
            sp["custom_params"] = {GUIDANCE_KEY: True}
        payload = {"input_ids": list(req.input_ids), "sampling_params": sp, "return_logprob": req.return_logprob}
        if req.return_routed_experts:  # a real SGLang answers it only when launched with --enable-return-routed-experts
            payload["return_routed_experts"] = True
        p = req.sampling_params
        if req.return_logprob and (p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0):
            # SGLang's output_token_logprobs are the unfiltered softmax; the distribution actually
            # sampled from (renormalized over top-k/top-p) comes back as the "selected" sampling logprob.
            payload["return_sampling_mask"], payload["sampling_logprobs_mode"] = True, "selected"
        if req.rid is not None:
            payload["rid"] = req.rid
        tried: set[str] = set()
        try:
            for attempt in self._retrying():
                with attempt:
                    url, status, body = self._generate_attempt(payload, tried, attempt.retry_state.attempt_number - 1)
        except RetryError as e:
            raise RolloutError(
                f"generate failed after {self.retries + 1} attempts; last: {e.last_attempt.exception()}"
            ) from None
        if status >= 400:
            raise RolloutError(error_message(status, body), status, url + "/generate")
        out = json.loads(body)
        results = [GenerateResult.from_sglang(o) for o in (out if isinstance(out, list) else [out])]
        if req.return_guidance:  # both servers keep a sample's record under its rid
            for r in results:
                if r.guidance_handle is None and r.finish_reason.get("type") != "abort":
                    r.guidance_handle = r.rid
        with self._lock:
            self.served[url] += 1
            self._down_until[url] = 0.0
            for r in results:
                if r.guidance_handle:
                    self._handles[r.guidance_handle] = url
        return results

    def _generate_attempt(self, payload: dict, tried: set[str], attempt: int) -> tuple[str, int, bytes]:
        """One try on the least-loaded live server not yet `tried`; a failure marks it (and, for a
        lost connection, marks it dead) and raises Retryable for the retry policy."""
        url = self._pick(tried)
        if url is None:  # every server is dead: wait for the prober to re-admit one
            raise Retryable("no live server (all marked dead; probing /health)")
        try:
            status, body = self._http(url, "/generate", payload)
        except Retryable as e:
            tried.add(url)
            with self._lock:
                self.failures[url] += 1
                self._down_until[url] = time.monotonic() + self.backoff * 2**attempt
            if e.dead:
                self._mark_dead(url, str(e))
            if len(tried) == len(self.urls):
                tried.clear()  # every server failed once: go round again after the backoff
            raise Retryable(f"{url}: {e}", e.dead) from None
        finally:
            with self._lock:
                self._outstanding[url] -= 1
        return url, status, body

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order; a request with n>1 contributes its n results in place."""
        if not requests:
            return []
        with ThreadPoolExecutor(min(len(requests), self.max_workers)) as pool:
            parts = list(pool.map(self._generate_and_prefetch, requests))
        return [r for part in parts for r in part]

    def _generate_and_prefetch(self, req: GenerateRequest) -> list[GenerateResult]:
        results = self._generate_one(req)
        for r in results if req.return_guidance else ():
            if r.guidance_handle:
                try:
                    got: GuidanceRecord | RolloutError = self.fetch_guidance(r.guidance_handle)
                except RolloutError as e:
                    got = e  # fetch_guidance raises it when the caller asks for this record
                with self._lock:
                    self._prefetched[r.guidance_handle] = got
        return results

    def fetch_guidance(self, handle: str) -> GuidanceRecord:
        """The record, read from its bytes on arrival, from the server that produced it (any server, if
        unknown); records of this client's own generate calls were already fetched while the batch ran."""
        with self._lock:
            got = self._prefetched.pop(handle, None)
            url = self._handles.pop(handle, None)
        if isinstance(got, RolloutError):
            raise got
        if got is not None:
            return got
        for u in [url] if url else self.urls:
            try:
                return GuidanceRecord.from_bytes(self._call(u, "/get_guidance", {"rid": handle}))
            except RolloutError as e:
                if url or e.status != 404:
                    raise
        raise RolloutError(f"no server holds guidance record {handle!r}", 404)

    # -- weights ---------------------------------------------------------------------------------
    def _each(self, fn, urls: list[str] | None = None) -> list:
        urls = self.urls if urls is None else urls
        if not urls:
            return []
        with ThreadPoolExecutor(len(urls)) as pool:
            return list(pool.map(fn, urls))

    def _live(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u not in self._dead]

    def _check_versions(self, version: int | str, urls: list[str] | None = None) -> None:
        got = self.weight_versions()
        wrong = {u: v for u, v in got.items() if not serves_version(v, version) and (urls is None or u in urls)}
        if wrong:
            raise RolloutError(f"weight version mismatch after update: expected {version}, servers report {wrong}")

    def _push_one(self, url: str, path: str, payload=None, raw=None) -> None:
        d = json.loads(self._call(url, path, payload, raw=raw))
        if not d.get("success", False):
            raise RolloutError(d.get("message", "update failed"), 400, url + path)

    def _weight_call(self, path: str, payload=None, raw=None) -> list[str]:
        """Push to every live server; one that cannot be reached is marked dead (and caught up on
        re-admission). A refusal (4xx / success false) raises. Returns the servers updated."""

        def one(url):
            try:
                self._push_one(url, path, payload, raw)
                return True
            except RolloutError as e:
                if e.status is not None:
                    raise
                self._mark_dead(url, str(e))
                return False

        live = self._live()
        done = [u for u, ok in zip(live, self._each(one, live)) if ok]
        if not done:
            raise RolloutError(f"no live server took the weight update ({path}); dead: {self.dead()}")
        return done

    def update_weights(self, bucket: WeightBucket, *, flush_cache: bool = True) -> None:
        """Push one bucket to every live server (octet-stream safetensors), then verify each version."""
        raw = bucket.to_bytes()
        path = f"/update_weights_from_tensor?flush_cache={'true' if flush_cache else 'false'}"
        with self._weights_lock:
            done = self._weight_call(path, raw=raw)
            self._check_versions(bucket.version, done)
            self._version = bucket.version
            self._last_push = ("tensor", (path, raw)) if self.keep_last_weights else None

    def update_weights_from_disk(self, path: str, version: int | str, *, flush_cache: bool = True) -> None:
        payload = {"model_path": str(path), "weight_version": wire_version(version), "flush_cache": flush_cache}
        with self._weights_lock:
            done = self._weight_call("/update_weights_from_disk", payload)
            self._check_versions(version, done)
            self._version = version
            self._last_push = ("disk", ("/update_weights_from_disk", payload))

    def weight_versions(self, urls: list[str] | None = None) -> dict[str, str]:
        """Each server's reported version, a string as SGLang names it (default: the live servers)."""
        urls = self._live() if urls is None else urls
        return dict(zip(urls, self._each(self._served_version, urls)))

    def _served_version(self, url: str) -> str:
        info = json.loads(self._call(url, "/model_info"))
        if "weight_version" not in info:
            raise RolloutError("/model_info has no weight_version", None, url + "/model_info")
        return str(info["weight_version"])

    def note_version(self, version: int | str) -> None:
        """The rollout now serves `version`, pushed past this client (e.g. DistributedTransport): a
        re-admitted server must report it; with nothing to replay and no `readmit_hook`, a stale
        server stays out (never serves old weights) until a later push through the client."""
        with self._weights_lock:
            if self._version is None or not serves_version(version, self._version):
                self._version, self._last_push = version, None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop probing dead servers and close the connection pools."""
        self._closed.set()
        for session in self._sessions.values():
            session.close()

    # -- control ---------------------------------------------------------------------------------
    def pause(self, mode: str = "in_place") -> None:
        self._each(lambda u: self._call(u, "/pause_generation", {"mode": mode}), self._live())

    def resume(self) -> None:
        self._each(lambda u: self._call(u, "/continue_generation", {}), self._live())

    def flush_cache(self) -> None:
        """Every live server drops its KV cache; RolloutError if one refuses (requests running)."""
        self._each(lambda u: self._call(u, "/flush_cache", {}), self._live())

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every live server frees the tagged memory (SGLang's endpoint; on CUDA a server frees it only when
        started with `--enable-memory-saver`, which `sglang_backend.launch` passes through; SGLang's CPU
        engine accepts the call and keeps its memory); RolloutError if one refuses."""
        self._each(lambda u: self._call(u, "/release_memory_occupation", {"tags": tags}), self._live())

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._each(lambda u: self._call(u, "/resume_memory_occupation", {"tags": tags}), self._live())

    def health(self) -> bool:
        def ok(u):
            try:
                return self._http(u, "/health", timeout=min(self.timeout, 10))[0] == 200
            except Retryable:
                return False

        return all(self._each(ok))

    def trace_policy(self, url: str) -> dict[str, Any]:
        """`url`'s GET /trace_policy (api.TRACE_POLICY_PATH): its K/V formats, de-biased K, guided layers."""
        return json.loads(self._call(url, TRACE_POLICY_PATH))

    def model_info(self, url: str | None = None) -> dict[str, Any]:
        """`url`'s /model_info, or the first live server's (all serve one model; see weight_versions)."""
        live = self._live()
        return json.loads(self._call(url or (live or self.urls)[0], "/model_info"))
