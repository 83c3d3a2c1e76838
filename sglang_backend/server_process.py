"""A real SGLang server as a child process, started the way a user starts one.

    with SGLangProcess(ckpt, ["--quantization", "nvfp4", "--kv-k", "fp8"], log_path=...) as srv:
        srv.url  ->  "http://127.0.0.1:43121"

`python -m sglang_backend.launch --backend sglang` in its own session (SGLang forks a scheduler and a
detokenizer; stopping the whole process group leaves none behind), ready once `/health` answers.
Used by the quality probe's SGLang backend and by the test suite's real-server fixtures.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 300  # imports + model load on 2 busy CPU cores take tens of seconds


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy; the message ends with its log's tail."""


_given_ports: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, outside the ephemeral range, never handed out twice here.

    A port from bind(0) lies in the range every outgoing connection draws its source port from: between
    asking for it and the child listening on it, a torchrun rank or gloo pair can take it (CI saw
    EADDRINUSE that way)."""
    low, high = 15000, min(_ephemeral_low(), 65536) - 1
    if high <= low:  # the ephemeral range covers everything: take any unprivileged port
        low, high = 1024, 65535
    for _ in range(200):
        port = random.randint(low, high)
        if port in _given_ports:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}..{high} after 200 tries")


class SGLangProcess:
    def __init__(
        self,
        model_path: str | Path,
        flags: list[str] | tuple[str, ...] = (),
        *,
        log_path: str | Path,
        port: int | None = None,
        env: dict[str, str] | None = None,
        device: str = "cpu",
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [
            sys.executable,
            "-m",
            "sglang_backend.launch",
            "--backend",
            "sglang",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
            "--device",
            device,
            *flags,
        ]
        # stop() ends the process group, which SGLang reads as a crashed scheduler: with its pre-crash
        # diagnostics on (py-spy, CUDA coredump; its defaults) every stop waited 5 s for them. A user's
        # own setting of either variable wins.
        quiet_stop = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**quiet_stop, **os.environ, **(env or {})},
                start_new_session=True,
            )
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def _wait_healthy(self, timeout_s: float) -> None:
        # A process we do not control becomes ready on its own schedule; the deadline only bounds a hang.
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"SGLang exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"SGLang did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the launcher's process group: SGLang and its workers
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def __enter__(self) -> SGLangProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
