"""The embedded server over real loopback HTTP: SGLang's endpoint shapes, errors and weight paths."""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_trace.guidance import GuidanceRecord  # noqa: E402
from megatron_trace.models.tiny import make_tiny_checkpoint  # noqa: E402
from sglang_backend.api import WeightBucket  # noqa: E402
from sglang_backend.local import Engine  # noqa: E402
from sglang_backend.local.server import serve  # noqa: E402
from sglang_backend.weight_group import WeightGroup, WeightSender  # noqa: E402
from tests.ports import free_port
from tests.waiting import wait_until

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


def bucket_of(path, version) -> WeightBucket:
    return WeightBucket(load_file(str(path / "model.safetensors")), version)


# -- /generate -----------------------------------------------------------------------------------
def test_generate_single_matches_engine(srv, ref):
    status, out = jhttp(
        srv.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "return_logprob": True, "rid": "r1"}
    )
    assert status == 200 and isinstance(out, dict)
    want = ref[0].generate(input_ids=[1, 2, 3], sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == want["output_ids"]
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "0" and meta["cached_tokens"] == 0
    assert meta["finish_reason"]["type"] == "length"
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None and t[0] <= 0 for t in triples)
    assert [t[0] for t in triples] == pytest.approx(
        [t[0] for t in want["meta_info"]["output_token_logprobs"]], abs=1e-5
    )


def test_generate_batch_and_n(srv, ref):
    status, out = jhttp(srv.url, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": GREEDY})
    assert status == 200 and [len(o["output_ids"]) for o in out] == [6, 6]
    want = ref[0].generate(input_ids=[[5, 6], [7, 8, 9]], sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == [w["output_ids"] for w in want]
    assert "output_token_logprobs" not in out[0]["meta_info"]  # return_logprob defaults to False
    sp = [{"max_new_tokens": 3, "n": 2, "temperature": 1.0}, {"max_new_tokens": 4, "n": 2}]
    status, out = jhttp(
        srv.url, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": sp, "rid": ["a", "b"]}
    )
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    assert [len(o["output_ids"]) for o in out] == [3, 3, 4, 4]
    status, out = jhttp(srv.url, "/generate", {"input_ids": [4], "sampling_params": {"n": 3, "max_new_tokens": 2}})
    assert status == 200 and isinstance(out, list) and len(out) == 3


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}}, "bogus_key"),
        ({"input_ids": [1, 99999]}, "vocabulary"),
        ({"input_ids": [[1], [-1]]}, "vocabulary"),
        ({"text": "hello", "input_ids": [1]}, "text"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ],
)
def test_generate_rejects(srv, body, needle):
    status, out = jhttp(srv.url, "/generate", body)
    assert status == 400 and needle in out["error"]


def test_unknown_top_level_key_ignored(srv):
    status, out = jhttp(
        srv.url, "/generate", {"input_ids": [1, 2], "sampling_params": GREEDY, "stream": False, "whatever": {"x": 1}}
    )
    assert status == 200 and len(out["output_ids"]) == 6


def test_bad_requests_never_kill_the_server(srv):
    status, body, _ = http(srv.url, "/generate", raw=b"{not json", ctype="application/json")
    assert status == 400 and "malformed JSON" in json.loads(body)["error"]["message"]
    status, out = jhttp(srv.url, "/generate", raw=b"[1, 2]", ctype="application/json")
    assert status == 400 and "JSON object" in out["error"]["message"]
    status, out = jhttp(srv.url, "/generate", raw=b"x" * (3 << 20))
    assert status == 413 and str(2 << 20) in out["error"]["message"]
    status, out = jhttp(srv.url, "/nope")
    assert status == 404
    status, body, headers = http(srv.url, "/generate", method="GET")
    assert status == 405 and "POST" in headers["Allow"]
    assert http(srv.url, "/health", key=None)[0] == 200


def test_auth(srv):
    for path, payload in [
        ("/generate", {"input_ids": [1]}),
        ("/flush_cache", {}),
        ("/model_info", None),
        ("/update_weights_from_tensor", {"serialized_named_tensors": []}),
        ("/update_weights_from_disk", {"model_path": "/x"}),
        ("/pause_generation", {}),
    ]:
        for key in (None, "wrong-key"):
            status, out = jhttp(srv.url, path, payload, key=key)
            assert (status, out) == (401, {"error": "Unauthorized"}), (path, key)
    for path in ("/health", "/health_generate"):
        status, body, _ = http(srv.url, path, key=None)
        assert status == 200 and body == b""


def test_concurrent_clients(srv, ref):
    prompts = [[i + 1, (3 * i) % 300 + 4, 7] for i in range(8)]
    want = [o["output_ids"] for o in ref[0].generate(input_ids=prompts, sampling_params=GREEDY)]
    got = [None] * 8

    def go(i):
        got[i] = jhttp(srv.url, "/generate", {"input_ids": prompts[i], "sampling_params": GREEDY})[1]["output_ids"]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert got == want


def test_pause_blocks_generate_until_continue(srv):
    assert jhttp(srv.url, "/pause_generation", {"mode": "in_place"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    box = {}
    t = threading.Thread(
        target=lambda: box.update(r=jhttp(srv.url, "/generate", {"input_ids": [3], "sampling_params": GREEDY}))
    )
    try:
        t.start()
        wait_until(lambda: srv.engine.scheduler.waiting, "the paused server to queue the request")
        assert t.is_alive() and "r" not in box and jhttp(srv.url, "/model_info")[1]["paused"] is True
        assert http(srv.url, "/health_generate", key=None)[0] == 200
    finally:
        assert jhttp(srv.url, "/continue_generation", {})[0] == 200
    t.join(30)
    assert box["r"][0] == 200 and len(box["r"][1]["output_ids"]) == 6
    assert jhttp(srv.url, "/pause_generation", {"mode": "later"})[0] == 400


def test_flush_cache_and_model_info(srv):
    for method in ("GET", "POST"):
        status, body, headers = http(srv.url, "/flush_cache", {} if method == "POST" else None, method=method)
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for path in ("/model_info", "/get_model_info"):
        status, info = jhttp(srv.url, path)
        assert status == 200 and info["is_generation"] is True and info["architectures"] == ["qwen2"]
        assert info["weight_version"] == "0" and "model_path" in info


# -- weights -------------------------------------------------------------------------------------
def test_update_weights_octet_stream_and_nan(fresh, ref, ckpts):
    prompt = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
    before = jhttp(fresh.url, "/generate", prompt)[1]["output_ids"]
    status, out = jhttp(fresh.url, "/update_weights_from_tensor", raw=bucket_of(ckpts[1], 5).to_bytes())
    assert status == 200 and out["success"] is True
    after = jhttp(fresh.url, "/generate", prompt)[1]
    assert after["output_ids"] == ref[1].generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"] != before
    assert after["meta_info"]["weight_version"] == "5" and jhttp(fresh.url, "/model_info")[1]["weight_version"] == "5"
    bad = bucket_of(ckpts[0], 6)
    bad.tensors["model.norm.weight"] = bad.tensors["model.norm.weight"].clone().fill_(float("nan"))
    status, out = jhttp(fresh.url, "/update_weights_from_tensor", raw=bad.to_bytes())
    assert status == 400 and out["success"] is False and "NaN" in out["message"]
    assert jhttp(fresh.url, "/model_info")[1]["weight_version"] == "5"
    assert jhttp(fresh.url, "/generate", prompt)[1]["output_ids"] == after["output_ids"]
    status, out = jhttp(fresh.url, "/update_weights_from_tensor", raw=b"\x05\x00garbage")
    assert status == 400 and "truncated" in out["error"]["message"]


def test_update_weights_json_base64_and_version(fresh, ref, ckpts):
    tensors = load_file(str(ckpts[1] / "model.safetensors"))
    names = sorted(tensors)
    parts = [base64.b64encode(save({k: tensors[k] for k in names[i::2]})).decode() for i in (0, 1)]
    status, out = jhttp(
        fresh.url,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": parts, "weight_version": "9", "flush_cache": True},
    )
    assert status == 200 and out["success"], out
    got = jhttp(fresh.url, "/generate", {"input_ids": [4, 5], "sampling_params": GREEDY})[1]
    assert got["output_ids"] == ref[1].generate(input_ids=[4, 5], sampling_params=GREEDY)["output_ids"]
    assert got["meta_info"]["weight_version"] == "9"
    assert jhttp(fresh.url, "/update_weights_from_tensor", {"serialized_named_tensors": [{"pickle": 1}]})[0] == 400
    assert jhttp(fresh.url, "/update_weight_version", {"new_version": "11"})[0] == 200
    assert jhttp(fresh.url, "/model_info")[1]["weight_version"] == "11"


def test_update_weights_from_disk(fresh, ref, ckpts, tmp_path):
    status, out = jhttp(fresh.url, "/update_weights_from_disk", {"model_path": str(ckpts[1]), "weight_version": "3"})
    assert status == 200 and out["success"], out
    got = jhttp(fresh.url, "/generate", {"input_ids": [9], "sampling_params": GREEDY})[1]
    assert got["output_ids"] == ref[1].generate(input_ids=[9], sampling_params=GREEDY)["output_ids"]
    other = make_tiny_checkpoint(tmp_path / "q3", "qwen3")
    for path in (tmp_path / "missing", other):
        status, out = jhttp(fresh.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": 4})
        assert status == 400 and out["success"] is False and "version 3" in out["message"]
    assert jhttp(fresh.url, "/model_info")[1]["weight_version"] == "3"


def _init_group(url, port, box, **kw):
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
        **kw,
    }
    box["init"] = jhttp(url, "/init_weights_update_group", body)


def test_update_weights_from_distributed(fresh, ref, ckpts):
    assert (
        jhttp(
            fresh.url,
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2},
        )[0]
        == 400
    )
    assert (
        jhttp(
            fresh.url,
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
        )[0]
        == 400
    )
    port, box = free_port(), {}
    t = threading.Thread(target=_init_group, args=(fresh.url, port, box))
    t.start()
    sender = WeightSender("127.0.0.1", port, 2, group_name="g", timeout_s=20)
    t.join(30)
    assert box["init"][0] == 200 and box["init"][1]["success"]
    named = load_file(str(ckpts[1] / "model.safetensors"))
    named = {k: v.to(torch.bfloat16) if "norm" in k else v for k, v in named.items()}  # mixed dtypes on the wire
    desc = {**WeightSender.describe(named), "group_name": "g", "weight_version": "7", "flush_cache": True}
    t = threading.Thread(target=lambda: box.update(upd=jhttp(fresh.url, "/update_weights_from_distributed", desc)))
    t.start()
    sender.send(named)
    t.join(30)
    assert box["upd"][0] == 200 and box["upd"][1]["success"], box["upd"]
    assert jhttp(fresh.url, "/model_info")[1]["weight_version"] == "7"
    got = jhttp(fresh.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})[1]["output_ids"]
    direct = Engine(str(ckpts[0]))  # the same tensors loaded in-process: what the wire must give
    try:
        assert direct.update_weights_from_tensor(named)[0]
        assert got == direct.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"]
    finally:
        direct.shutdown()
    # an interrupted transfer: the sender stops half way; the server keeps version 7
    t = threading.Thread(
        target=lambda: box.update(
            upd=jhttp(fresh.url, "/update_weights_from_distributed", {**desc, "weight_version": "8"})
        )
    )
    t.start()
    sender.send(dict(list(named.items())[:3]))
    sender.close()
    t.join(30)
    assert box["upd"][0] == 400 and "still serving version 7" in box["upd"][1]["message"]
    assert jhttp(fresh.url, "/model_info")[1]["weight_version"] == "7"
    assert jhttp(fresh.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})[1]["output_ids"] == got
    assert jhttp(fresh.url, "/destroy_weights_update_group", {"group_name": "g"})[0] == 400  # dropped on failure


def test_weight_group_dtypes():
    """bf16, uint8 and float8 (sent as bytes: gloo has no float8) arrive bit-exact."""
    port = free_port()
    named = {
        "a": torch.randn(3, 4).to(torch.bfloat16),
        "b": torch.arange(10, dtype=torch.uint8),
        "c": torch.randn(8).to(torch.float8_e4m3fn),
    }
    box = {}

    def recv():
        g = WeightGroup("127.0.0.1", port, 1, 2, "t", timeout_s=20)
        box["got"] = dict(
            g.receive(list(named), [t.dtype for t in named.values()], [list(t.shape) for t in named.values()])
        )

    t = threading.Thread(target=recv)
    t.start()
    WeightSender("127.0.0.1", port, 2, group_name="t", timeout_s=20).send(named)
    t.join(30)
    for k, v in named.items():
        assert box["got"][k].dtype == v.dtype and torch.equal(box["got"][k].view(torch.uint8), v.view(torch.uint8))


# -- guidance ------------------------------------------------------------------------------------
def test_guidance_roundtrip(ckpts):
    engine = Engine(str(ckpts[0]), quantization="nvfp4")
    server = serve(engine, api_key=KEY)
    try:
        status, out = jhttp(
            server.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "return_guidance": True}
        )
        handle = out["meta_info"]["guidance_handle"]
        status, body, headers = http(server.url, "/get_guidance", {"rid": handle})
        assert status == 200 and headers["Content-Type"] == "application/octet-stream"
        assert GuidanceRecord.from_bytes(body).nbytes() > 0
        status, out = jhttp(server.url, "/get_guidance", {"rid": handle})
        assert status == 404 and handle in out["error"]["message"]
    finally:
        server.shutdown()
        engine.shutdown()


def test_refuses_public_host_without_key(ckpts):
    engine = Engine(str(ckpts[0]))
    try:
        with pytest.raises(ValueError, match="api"):
            serve(engine, host="0.0.0.0")
    finally:
        engine.shutdown()


# -- launch --------------------------------------------------------------------------------------
def test_launch_local_and_sglang_stub(ckpts, capsys):
    from sglang_backend.launch import main

    # --backend sglang execs a real SGLang server (the test command installs it): test_launch_sglang.py
    # checks its command with --dry-run, test_sglang_real.py runs it
    assert main(["--backend", "sglang", "--model-path", str(ckpts[0]), "--dry-run"]) == 0
    assert "sglang.launch_server" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model-path", str(ckpts[0]), "--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    port, ready, stop, box = free_port(), threading.Event(), threading.Event(), {}
    argv = [
        "--model-path",
        str(ckpts[0]),
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--quantization",
        "nvfp4",
        "--kv-cache-dtype",
        "nvfp4",
        "--guided-layers",
        "2",
        "--max-body-mb",
        "1",
    ]
    t = threading.Thread(target=lambda: box.update(rc=main(argv, ready=ready, stop=stop)))
    t.start()
    try:
        assert ready.wait(30)
        url = f"http://127.0.0.1:{port}"
        info = jhttp(url, "/model_info")[1]
        assert info["guided_layers"] == [2, 3] and info["max_body_bytes"] == 1 << 20
        assert jhttp(url, "/generate", {"input_ids": [1], "sampling_params": GREEDY})[0] == 200
    finally:
        stop.set()
        t.join(30)
    assert box["rc"] == 0
