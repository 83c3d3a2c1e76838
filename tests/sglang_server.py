"""One real SGLang server process for a test module, started the way a user starts it
(`python -m sglang_backend.launch --backend sglang`, through sglang_backend.server_process), stopped
with its whole process group."""

from __future__ import annotations

import pytest

from sglang_backend.server_process import ServerStartError, SGLangProcess


def start_sglang(
    ckpt: str,
    tmp_path_factory,
    *flags: str,
    defaults: tuple[str, ...] = ("--max-total-tokens", "4096", "--max-running-requests", "16"),
):
    """Start a real SGLang server through our launcher (SGLang's CPU engine here), yield its URL once
    /health answers, stop its process group. `flags` go to the launcher after `defaults`."""
    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    guidance_dir = tmp_path_factory.mktemp("guidance")
    try:
        srv = SGLangProcess(ckpt, [*defaults, *flags], log_path=log_path, env={"TRACE_GUIDANCE_DIR": str(guidance_dir)})
    except ServerStartError as e:
        pytest.fail(str(e))
    try:
        yield srv.url
    finally:
        srv.stop()
