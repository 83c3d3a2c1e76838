"""Fixtures of test_server_http.py and test_server_http_weights.py: two tiny checkpoints, reference
engines on them, servers. A test module loads them with `pytest_plugins = ["tests.server_http_fixtures"]`
(a plugin module, so never imported by name: pytest must import it first to rewrite it)."""

from __future__ import annotations

import pytest

from megatron_trace.models.tiny import make_tiny_checkpoint
from sglang_backend.local import Engine
from sglang_backend.local.server import serve
from tests.server_http_support import KEY


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_checkpoint(root / "a", "qwen2", seed=0), make_tiny_checkpoint(root / "b", "qwen2", seed=1)


@pytest.fixture(scope="module")
def ref(ckpts):
    """Engines called directly: what the server must reproduce, for weights a and b."""
    a, b = Engine(str(ckpts[0])), Engine(str(ckpts[1]))
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture(scope="module")
def srv(ckpts):
    engine = Engine(str(ckpts[0]))
    server = serve(engine, api_key=KEY, max_body_bytes=2 << 20)
    yield server
    server.shutdown()
    engine.shutdown()


@pytest.fixture
def fresh(ckpts):
    """A server of its own, for tests that change weights."""
    engine = Engine(str(ckpts[0]))
    server = serve(engine, api_key=KEY, dist_timeout_s=5)
    yield server
    server.shutdown()
    engine.shutdown()
