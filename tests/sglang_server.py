"""One real SGLang server process for a test module, started the way a user starts it
(`python -m sglang_backend.launch --backend sglang`), stopped with its whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.ports import free_port

START_TIMEOUT_S = 300  # imports + model load on 2 busy cores take tens of seconds


def start_sglang(ckpt: str, tmp_path_factory, *flags: str, defaults: tuple[str, ...] = ("--max-total-tokens", "4096",
                 "--max-running-requests", "16")):
    """Start a real SGLang server through our launcher (SGLang's CPU engine here), yield its URL once
    /health answers, stop its process group. `flags` go to the launcher after `defaults`."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    guidance_dir = tmp_path_factory.mktemp("guidance")
    cmd = [sys.executable, "-m", "sglang_backend.launch", "--backend", "sglang", "--model-path", ckpt,
           "--port", str(port), "--device", "cpu", *defaults, *flags]
    env = {**os.environ, "TRACE_GUIDANCE_DIR": str(guidance_dir)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"SGLang exited with {proc.returncode} before serving:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang did not answer /health within {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher's process group: SGLang and its workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
