"""Rollout-server faults, injected for real: a server SIGKILLed mid-batch, restarted, re-admitted
only at the current weight version; an HTTP weight upload cut off mid-body.

Servers here are real subprocesses (`python -m sglang_backend.launch --backend local`), driven
through `RolloutClient` (the loop's http backend) with a batch of requests carrying unique rids.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_trace.models.tiny import make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams, WeightBucket
from sglang_backend.client import RolloutClient
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
KEY = "fault-key"


def _launch(ckpt: Path, port: int, kill_at: str | None = None) -> subprocess.Popen:
    """A real server process; `kill_at` arms a named fault point that SIGKILLs it there."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO),
    }
    runner = ["-m"] if kill_at is None else [str(REPO / "tests/mp_scripts/with_fault.py"), "--kill-at", kill_at, "-m"]
    return subprocess.Popen(
        [
            sys.executable,
            *runner,
            "sglang_backend.launch",
            "--backend",
            "local",
            "--model-path",
            str(ckpt),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--max-running-requests",
            "4",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


def _version(url: str) -> int:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(json.loads(r.read())["weight_version"])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return make_tiny_checkpoint(root / "v0", "qwen2", seed=0), make_tiny_checkpoint(root / "v1", "qwen2", seed=1)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_server_killed_mid_batch_then_readmitted_at_current_version(ckpts, procs):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # b dies at its 3rd decode step: by construction it holds requests in flight when it does.
    procs += [_launch(ckpts[0], ports[0]), _launch(ckpts[0], ports[1], kill_at="engine.decode_step:n=3")]
    for u, p in zip(urls, procs):
        _wait_healthy(u, p)
    a, b = urls
    client = RolloutClient(urls, api_key=KEY, backoff=0.05, retries=4, probe_interval=0.2, timeout=60)
    try:
        # 1. A batch with unique rids; server b is SIGKILLed (by its fault point) mid-batch.
        n = 24
        reqs = [
            GenerateRequest(
                [1 + i % 50, 2, 3], SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=i), rid=f"req-{i}"
            )
            for i in range(n)
        ]
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=client.generate(reqs)))
        t.start()
        assert procs[1].wait(120) == -signal.SIGKILL
        assert "SIGKILL at engine.decode_step" in procs[1].stderr.read()
        t.join(120)
        assert not t.is_alive()
        out = box["out"]
        rids = [r.rid for r in out]
        assert sorted(rids) == sorted(r.rid for r in reqs), "a sample was lost or counted twice"
        assert rids == [r.rid for r in reqs]  # in request order, each exactly once
        assert all(len(r.output_ids) > 0 for r in out)
        assert client.failures[b] >= 1, "no request was in flight on the killed server"
        assert client.dead() == [b]
        served_b = client.served[b]

        # 2. Version 1 while b is down: pushed to a only; b is skipped, not an error.
        client.update_weights(WeightBucket(load_file(str(ckpts[1] / "model.safetensors")), 1))
        assert client.weight_versions() == {a: "1"}

        # 3. b comes back on the same port from the base checkpoint (version 0). The client must
        #    bring it to version 1 before it gets any traffic: every result says version 1.
        procs[1] = _launch(ckpts[0], ports[1])
        _wait_healthy(b, procs[1])
        seen_b, deadline = 0, time.time() + 60
        while seen_b == 0:
            assert time.time() < deadline, f"b never re-admitted: {client.events[-3:]}"
            res = client.generate(
                [GenerateRequest([5, 6], SamplingParams(max_new_tokens=2, temperature=0)) for _ in range(4)]
            )
            assert [r.weight_version for r in res] == ["1"] * 4, "a server served a stale weight version"
            seen_b = client.served[b] - served_b
        assert client.dead() == [] and _version(b) == 1
        kinds = [e for _, u, e in client.events if u == b]
        assert kinds[0].startswith("dead") and kinds[-1] == "readmitted at version 1", kinds
    finally:
        client.close()


def test_weight_upload_cut_off_mid_body_keeps_serving_previous_version(ckpts):
    """The trainer dies mid-upload (half the body sent, then the socket closes): the server keeps
    version 0, reports it, still generates, and accepts the next complete transfer. (In-process
    server: the fault is the sender's. NaN refusal and a killed distributed sender:
    tests/test_client.py, tests/test_transfer.py.)"""
    from sglang_backend.local import Engine
    from sglang_backend.local.server import serve

    engine = Engine(str(ckpts[0]))
    srv = serve(engine, api_key=KEY)
    try:
        _cut_off_upload(ckpts, srv.url, srv.port)
    finally:
        srv.shutdown()
        engine.shutdown()


def _cut_off_upload(ckpts, url: str, port: int) -> None:
    client = RolloutClient(url, api_key=KEY, backoff=0.05)
    greedy = [GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=6, temperature=0))]
    before = client.generate(greedy)[0].output_ids
    raw = WeightBucket(load_file(str(ckpts[1] / "model.safetensors")), 1).to_bytes()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            (
                f"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(raw)}\r\n\r\n"
            ).encode()
        )
        s.sendall(raw[: len(raw) // 2])
        s.shutdown(socket.SHUT_WR)  # the sender is gone; the server sees EOF mid-body
        s.settimeout(30)
        chunks = []
        while chunk := s.recv(4096):  # the server answers, then closes the connection
            chunks.append(chunk)
        answer = b"".join(chunks).decode(errors="replace")
    assert " 400 " in answer.splitlines()[0] and "truncated" in answer, answer[:300]
    assert client.weight_versions() == {url: "0"}
    assert client.generate(greedy)[0].output_ids == before  # still the previous weights
    client.update_weights(WeightBucket.from_bytes(raw))
    assert client.weight_versions() == {url: "1"}
    assert client.generate(greedy)[0].output_ids != before
    client.close()


def test_stale_server_stays_out_without_weights_to_replay(ckpts):
    """Weights pushed past the client (e.g. DistributedTransport; train.py calls note_version):
    a server that reports an older version is not re-admitted until a hook brings it up to date."""
    from sglang_backend.local import Engine
    from sglang_backend.local.server import serve

    engine = Engine(str(ckpts[0]))
    srv = serve(engine, api_key=KEY)
    client = RolloutClient(srv.url, api_key=KEY, backoff=0.01, retries=1, probe_interval=0.05)
    try:
        client.note_version(3)
        client._mark_dead(srv.url, "test")  # as after a connection failure
        deadline = time.monotonic() + 60  # the prober's verdict is appended once and stays: cannot be missed
        while not any("no weights to replay" in e for _, _, e in client.events):
            assert time.monotonic() < deadline, client.events[-3:]
            time.sleep(0.05)
        assert client.dead() == [srv.url]
        with pytest.raises(Exception, match="no live server"):
            client.generate([GenerateRequest([1], SamplingParams(max_new_tokens=1))])
        client.readmit_hook = lambda url, v: urllib.request.urlopen(
            urllib.request.Request(
                url + "/update_weight_version",
                data=json.dumps({"new_version": v}).encode(),
                method="POST",
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            ),
            timeout=10,
        ).read()
        deadline = time.time() + 10
        while client.dead() and time.time() < deadline:
            time.sleep(0.05)
        assert client.dead() == [] and engine.weight_version == "3"
        assert client.generate([GenerateRequest([1], SamplingParams(max_new_tokens=1))])[0].weight_version == "3"
    finally:
        client.close()
        srv.shutdown()
        engine.shutdown()
