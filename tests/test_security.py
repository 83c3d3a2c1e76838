"""The rollout server's security properties, each checked against the running server.

Loopback bind by default, an API key on every endpoint but the health probes, a constant-time
key compare, a request-body limit, no unpickling of anything from the network, and a weight-update
group that only admits the configured world.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import urllib.request
from pathlib import Path

import pytest

from megatron_trace.models.tiny import make_tiny_checkpoint
from sglang_backend import launch
from sglang_backend.local import Engine, http_util
from sglang_backend.local.server import OPEN_PATHS, serve

KEY = "s3cret-key"
PKG = Path(__file__).resolve().parents[1] / "sglang_backend"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(str(make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", "qwen2", seed=0)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def srv(engine):
    s = serve(engine, api_key=KEY, max_body_bytes=4096)
    yield s
    s.shutdown()


def call(url, path, method="POST", body=b"", key=KEY, ctype="application/json"):
    headers = {"Content-Type": ctype}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=body if method != "GET" else None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_binds_loopback_unless_configured(engine):
    assert launch.parser().parse_args(["--model-path", "x"]).host == "127.0.0.1"
    s = serve(engine)  # the default host
    try:
        assert s.socket.getsockname()[0] == "127.0.0.1"
    finally:
        s.shutdown()
    with pytest.raises(ValueError, match="non-loopback"):
        serve(engine, host="0.0.0.0")  # a public bind needs a key
    assert launch.main(["--model-path", "x", "--host", "0.0.0.0"]) == 2


def test_every_endpoint_but_health_requires_the_key(srv):
    assert OPEN_PATHS == {"/health", "/health_generate"}
    assert len(srv.routes) >= 15
    for path, (methods, _) in srv.routes.items():
        for method in sorted(methods):
            for key in (None, "wrong-key", KEY[:-1], KEY + "x"):
                status, body = call(srv.url, path, method, b"{}", key=key)
                if path in OPEN_PATHS:
                    assert status == 200, (path, method, status)
                else:
                    assert status == 401 and json.loads(body) == {"error": "Unauthorized"}, (path, method, key, status)
    status, _ = call(srv.url, "/model_info", "GET", key=KEY)
    assert status == 200
    req = urllib.request.Request(srv.url + "/model_info", headers={"Authorization": f"Basic {KEY}"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(req, timeout=30)  # the scheme must be Bearer


def test_key_compare_is_constant_time(srv, monkeypatch):
    seen = []
    real = http_util.hmac.compare_digest
    monkeypatch.setattr(http_util.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    assert call(srv.url, "/model_info", "GET", key="guess")[0] == 401
    assert call(srv.url, "/model_info", "GET", key=KEY)[0] == 200
    assert seen == [(b"guess", KEY.encode()), (KEY.encode(), KEY.encode())]
    # and no plain comparison against the key anywhere in the server package
    for f in PKG.rglob("*.py"):
        assert not re.search(r"(==|!=)\s*(self\.|server\.)?api_key\b|\bapi_key\s*(==|!=)", f.read_text()), f


def test_request_body_limit(srv):
    status, body = call(srv.url, "/generate", body=json.dumps({"input_ids": [1] * 5000}).encode())
    assert status == 413 and "4096" in json.loads(body)["error"]["message"]
    status, body = call(srv.url, "/update_weights_from_tensor", body=b"\0" * 10_000, ctype="application/octet-stream")
    assert status == 413
    assert call(srv.url, "/health", "GET", key=None)[0] == 200  # and the server lives on


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/issue9_pickle_ran"),))


def test_nothing_is_unpickled_from_the_network(srv, engine):
    marker = Path("/tmp/issue9_pickle_ran")
    marker.unlink(missing_ok=True)
    payload = pickle.dumps(_Evil())
    status, body = call(srv.url, "/update_weights_from_tensor", body=payload, ctype="application/octet-stream")
    assert status == 400 and b"weight bucket" in body
    # SGLang's own shape: a list of base64 pickles (MultiprocessingSerializer) -> refused
    sg = json.dumps({"serialized_named_tensors": [base64.b64encode(payload).decode()], "flush_cache": True}).encode()
    status, body = call(srv.url, "/update_weights_from_tensor", body=sg)
    assert status == 400 and b"serialized_named_tensors[0]" in body
    status, body = call(
        srv.url, "/update_weights_from_tensor", body=json.dumps({"serialized_named_tensors": [list(payload)]}).encode()
    )
    assert status == 400 and b"no pickle" in body
    assert not marker.exists(), "a pickle from the network was executed"
    assert engine.weight_version == "0"
    # static: nothing in the package can unpickle (torch.load only with weights_only=True, local files)
    for f in PKG.rglob("*.py"):
        src = f.read_text()
        assert not re.search(r"^\s*(import|from)\s+(pickle|cPickle|dill|marshal|shelve)\b", src, re.M), f
        assert "weights_only=False" not in src and "pickle.load" not in src, f
        for m in re.finditer(r"torch\.load\(([^)]*)\)", src):
            assert "weights_only=True" in m.group(1), (f, m.group(0))


@pytest.mark.parametrize("offset, world", [(0, 2), (2, 2), (3, 2), (1, 1), (-1, 4)])
def test_weight_group_only_accepts_the_configured_world(srv, offset, world):
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": offset,
        "world_size": world,
        "group_name": "g",
        "backend": "gloo",
    }
    status, out = call(srv.url, "/init_weights_update_group", body=json.dumps(body).encode())
    assert status == 400 and "rank_offset" in json.loads(out)["error"]["message"]
    assert json.loads(call(srv.url, "/model_info", "GET")[1])["weight_update_groups"] == []
