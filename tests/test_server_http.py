"""The embedded server over real loopback HTTP: SGLang's endpoint shapes, errors, auth, pause, guidance
and the launcher (the weight paths: test_server_http_weights.py)."""

from __future__ import annotations

import json
import threading

import pytest

from megatron_trace.guidance import GuidanceRecord
from sglang_backend.local import Engine
from sglang_backend.local.server import serve
from tests.ports import free_port
from tests.server_http_support import GREEDY, KEY, http, jhttp
from tests.waiting import wait_until

pytest_plugins = ["tests.server_http_fixtures"]  # fixtures: ckpts, ref, srv


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
