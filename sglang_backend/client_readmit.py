"""Dead rollout servers: how `RolloutClient` stops sending to one and when it takes it back (a mixin).

A connection failure (refused, reset, timed out) marks the server dead; it gets no traffic and
weight updates skip it. A background thread probes its `/health` every `probe_interval` s; once
it answers, the server is brought to the current weight version (the client replays the last
update it pushed: the serialized bucket, or the disk path; or a `readmit_hook(url, version)`
pushes them, e.g. for a transport that bypasses the client) and is re-admitted only after its
`/model_info` reports that version. `dead()` lists them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sglang_backend.api import serves_version
from sglang_backend.http_errors import Retryable, RolloutError


class DeadServerReadmission:
    """Marking dead, probing and re-admitting; `RolloutClient` supplies the state and calls below."""

    urls: list[str]
    timeout: float
    probe_interval: float
    readmit_hook: Callable[[str, int], None] | None
    events: list[tuple[float, str, str]]  # (monotonic time, url, "dead"/"readmitted"/...)
    _lock: threading.Lock  # guards the per-server state: _dead, _down_until, events, _prober
    _weights_lock: threading.Lock  # updates and re-admissions never interleave
    _dead: set[str]
    _down_until: dict[str, float]
    _prober: threading.Thread | None
    _closed: threading.Event
    _version: int | str | None  # the last version pushed through the client
    _last_push: tuple[str, Any] | None  # what to replay to a stale server
    _http: Callable[..., tuple[int, bytes]]
    _served_version: Callable[[str], str]
    _push_one: Callable[..., None]

    def dead(self) -> list[str]:
        with self._lock:
            return [u for u in self.urls if u in self._dead]

    def _mark_dead(self, url: str, why: str) -> None:
        with self._lock:
            if url in self._dead:
                return
            self._dead.add(url)
            self.events.append((time.monotonic(), url, f"dead: {why}"))
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe_loop, name="rollout-prober", daemon=True)
                self._prober.start()

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval):
            with self._lock:
                dead = [u for u in self.urls if u in self._dead]
                if not dead:  # under the lock: a server marked dead from now on starts a new prober
                    self._prober = None
                    return
            for url in dead:
                try:
                    self._try_readmit(url)
                except Exception as e:  # still down or not yet loadable: try again next round
                    with self._lock:
                        self.events.append((time.monotonic(), url, f"probe failed: {e}"))

    def _try_readmit(self, url: str) -> bool:
        """Health, then the current weights, then the version check; only then traffic."""
        try:
            if self._http(url, "/health", timeout=min(self.timeout, 10))[0] != 200:
                return False
        except Retryable:
            return False
        with self._weights_lock:
            version, push = self._version, self._last_push
            if version is not None:
                got = self._served_version(url)
                if not serves_version(got, version):
                    if self.readmit_hook is not None:
                        self.readmit_hook(url, version)
                    elif push is not None:
                        kind, (path, body) = push
                        self._push_one(url, path, body if kind == "disk" else None, body if kind == "tensor" else None)
                    else:
                        raise RolloutError(
                            f"server reports version {got}, current is {version}, and there are "
                            "no weights to replay (keep_last_weights=False and no readmit_hook)"
                        )
                    got = self._served_version(url)
                    if not serves_version(got, version):
                        raise RolloutError(f"after catch-up the server reports version {got}, expected {version}")
            with self._lock:
                self._dead.discard(url)
                self._down_until[url] = 0.0
                self.events.append((time.monotonic(), url, f"readmitted at version {version}"))
        return True
