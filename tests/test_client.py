"""RolloutClient against two real embedded servers over loopback HTTP."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_trace.models.tiny import make_tiny_checkpoint  # noqa: E402
from sglang_backend.api import GenerateRequest, SamplingParams, WeightBucket  # noqa: E402
from sglang_backend.client import RolloutClient, RolloutError  # noqa: E402
from sglang_backend.local import Engine  # noqa: E402
from sglang_backend.local.server import serve  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

KEY = "client-key"


def greedy(n=1, max_new_tokens=6):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, n=n)


def dead_url() -> str:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_checkpoint(root / "a", "qwen2", seed=0), make_tiny_checkpoint(root / "b", "qwen2", seed=1)


@pytest.fixture(scope="module")
def ref(ckpts):
    engines = Engine(str(ckpts[0])), Engine(str(ckpts[1]))
    yield engines
    for e in engines:
        e.shutdown()


@pytest.fixture(scope="module")
def servers(ckpts):
    engines = [Engine(str(ckpts[0])) for _ in range(2)]
    srvs = [serve(e, api_key=KEY) for e in engines]
    yield srvs
    for s, e in zip(srvs, engines):
        s.shutdown()
        e.shutdown()


@pytest.fixture
def client(servers):
    return RolloutClient([s.url for s in servers], api_key=KEY, backoff=0.05)


def test_generate_order_and_n(client, ref):
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    reqs = [GenerateRequest(p, greedy(n=2 if i == 1 else 1), rid=f"q{i}") for i, p in enumerate(prompts)]
    out = client.generate(reqs)
    assert [r.rid for r in out] == ["q0", "q1-0", "q1-1", "q2", "q3"]
    want = ref[0].generate(input_ids=prompts, sampling_params=greedy().to_dict())
    assert [r.output_ids for r in out] == [
        want[0]["output_ids"],
        want[1]["output_ids"],
        want[1]["output_ids"],
        want[2]["output_ids"],
        want[3]["output_ids"],
    ]
    assert all(
        len(r.output_logprobs) == len(r.output_ids) > 0 and r.weight_version == "0" and r.prompt_tokens for r in out
    )


def test_least_outstanding_spreads_load(client):
    reqs = [GenerateRequest([i + 1, 2], greedy(max_new_tokens=24)) for i in range(16)]
    out = client.generate(reqs)
    assert len(out) == 16
    counts = list(client.served.values())
    assert sum(counts) == 16 and min(counts) >= 4, counts


def test_least_outstanding_prefers_idle_server(client, servers):
    """A server with a request in flight gets the next one only after the idle one."""
    slow, fast = (s.url for s in servers)
    with client._lock:
        client._outstanding[slow] += 5  # as if 5 long requests were running there
    try:
        client.generate([GenerateRequest([3], greedy(max_new_tokens=2)) for _ in range(3)])
    finally:
        with client._lock:
            client._outstanding[slow] -= 5
    assert client.served == {slow: 0, fast: 3}


def test_dead_server_is_retried_on_live_one(servers, ref):
    dead = dead_url()
    c = RolloutClient([dead, servers[0].url], api_key=KEY, backoff=0.01)
    out = c.generate([GenerateRequest([1, 2, 3], greedy()) for _ in range(4)])
    want = ref[0].generate(input_ids=[1, 2, 3], sampling_params=greedy().to_dict())["output_ids"]
    assert [r.output_ids for r in out] == [want] * 4
    assert c.served == {dead: 0, servers[0].url: 4}
    assert c.health() is False and RolloutClient([servers[0].url]).health() is True
    with pytest.raises(RolloutError, match="attempts"):
        RolloutClient([dead], retries=1, backoff=0.01).generate([GenerateRequest([1], greedy())])


def test_4xx_raises_without_retry(client, monkeypatch):
    calls = []
    real = client._http
    monkeypatch.setattr(client, "_http", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    with pytest.raises(RolloutError, match="vocabulary") as e:
        client.generate([GenerateRequest([1, 10**6], greedy())])
    assert e.value.status == 400 and calls == ["/generate"]
    with pytest.raises(RolloutError, match="Unauthorized"):
        RolloutClient([client.urls[0]], api_key="nope").model_info()


def test_control_endpoints(client, servers):
    assert client.health() is True
    info = client.model_info()
    assert info["architectures"] == ["qwen2"] and info["weight_version"] == "0"
    client.flush_cache()
    client.pause()
    box = {}
    t = threading.Thread(target=lambda: box.update(r=client.generate([GenerateRequest([5], greedy(max_new_tokens=2))])))
    t.start()
    # held, not merely slow: the request reached a server and waits there while paused
    wait_until(lambda: any(s.engine.scheduler.waiting for s in servers), "the paused server to queue the request")
    assert t.is_alive() and "r" not in box
    client.resume()
    t.join(30)
    assert len(box["r"][0].output_ids) == 2


def test_guidance_via_client(ckpts):
    engine = Engine(str(ckpts[0]), quantization="nvfp4")
    srv = serve(engine)
    try:
        c = RolloutClient([dead_url(), srv.url], backoff=0.01)
        (res,) = c.generate([GenerateRequest([1, 2, 3], greedy(max_new_tokens=3), return_guidance=True)])
        assert res.guidance_handle
        assert c.fetch_guidance(res.guidance_handle).nbytes() > 0
        with pytest.raises(RolloutError):
            c.fetch_guidance(res.guidance_handle)  # records are fetched once
    finally:
        srv.shutdown()
        engine.shutdown()


def test_guidance_is_fetched_while_the_batch_runs(ckpts, monkeypatch):
    """generate's worker fetches each finished sample's record at once (the fetches overlap the
    batch's other generations): after the server is gone the records are still there; a fetch that
    failed then raises its own error when the record is asked for."""
    engine = Engine(str(ckpts[0]), quantization="nvfp4")
    srv = serve(engine)
    try:
        c = RolloutClient([srv.url], backoff=0.01)
        reqs = [GenerateRequest([1, 2, k], greedy(max_new_tokens=3), return_guidance=True) for k in (3, 4)]
        results = c.generate(reqs)
    finally:
        srv.shutdown()
        engine.shutdown()
    records = [c.fetch_guidance(r.guidance_handle) for r in results]
    assert all(rec.nbytes() > 0 for rec in records) and set(records[0].sites) == set(records[1].sites)
    engine = Engine(str(ckpts[0]), quantization="nvfp4")
    srv = serve(engine)
    try:
        c = RolloutClient([srv.url], backoff=0.01)

        def refuse(url, path, body=None, **kw):
            raise RolloutError("record store offline", 503, url + path)

        monkeypatch.setattr(c, "_call", refuse)
        (res,) = c.generate([GenerateRequest([1, 2, 3], greedy(max_new_tokens=3), return_guidance=True)])
    finally:
        srv.shutdown()
        engine.shutdown()
    with pytest.raises(RolloutError, match="record store offline"):
        c.fetch_guidance(res.guidance_handle)


# weight updates last: they change the module's servers
def test_update_weights_all_servers(client, ref, ckpts):
    bucket = WeightBucket(load_file(str(ckpts[1] / "model.safetensors")), 4)
    client.update_weights(bucket)
    assert client.weight_versions() == {u: "4" for u in client.urls}
    out = client.generate([GenerateRequest([1, 2, 3], greedy()) for _ in range(4)])
    want = ref[1].generate(input_ids=[1, 2, 3], sampling_params=greedy().to_dict())["output_ids"]
    assert all(r.output_ids == want and r.weight_version == "4" for r in out)
    bad = WeightBucket({"model.norm.weight": bucket.tensors["model.norm.weight"] * float("nan")}, 5)
    with pytest.raises(RolloutError, match="NaN"):
        client.update_weights(bad)
    assert client.weight_versions() == {u: "4" for u in client.urls}
    client.update_weights_from_disk(str(ckpts[0]), 6)
    assert client.weight_versions() == {u: "6" for u in client.urls}


def test_update_weights_version_check(client, ckpts, monkeypatch):
    bucket = WeightBucket(load_file(str(ckpts[0] / "model.safetensors")), 8)
    monkeypatch.setattr(client, "weight_versions", lambda: {u: "7" for u in client.urls})  # a server that lied
    with pytest.raises(RolloutError, match="mismatch"):
        client.update_weights(bucket)


def test_both_backends_implement_the_whole_rollout_contract():
    """train.py calls only what api.RolloutBackend declares; the embedded backend and the HTTP client
    both have every one of those methods, with the Protocol's parameters."""
    import inspect

    from sglang_backend.api import RolloutBackend
    from sglang_backend.local.inprocess import InProcessBackend

    declared = {n for n, v in vars(RolloutBackend).items() if callable(v) and not n.startswith("_")}
    assert {"generate", "update_weights", "fetch_guidance", "note_version", "close"} <= declared
    for impl in (InProcessBackend, RolloutClient):
        for name in declared:
            want = list(inspect.signature(getattr(RolloutBackend, name)).parameters)
            got = list(inspect.signature(getattr(impl, name)).parameters)
            assert got[: len(want)] == want, (impl.__name__, name, got, want)
