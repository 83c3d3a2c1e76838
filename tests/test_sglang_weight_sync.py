"""Weight sync into a REAL SGLang 0.5.23 server (CPU engine, our plugin serving an NVFP4 export):
the distributed transport builds its end of SGLang's weight-update group (init_custom_process_group's
store layout), streams ModelOpt tensors over gloo with the E4M3 scales as uint8, inside SGLang's
weight-update session (begin/end: the quant method's scales are rebuilt in place at the end), and
the disk transport goes through /update_weights_from_disk, and a colocated trainer speaks SGLang's
own /update_weights_from_tensor payload. After each sync the server reports the
new version (a string) and its greedy tokens and logprobs equal the embedded engine's loaded with
the same weights.

One server per module (start-up is most of this module's time).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.entrypoints.http_server")
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from megatron_trace.models import QuantPolicy, make_tiny_checkpoint  # noqa: E402
from megatron_trace.transfer.export import export_checkpoint, load_hf_dir  # noqa: E402
from megatron_trace.transfer.sglang_tensor import SGLangTensorTransport  # noqa: E402
from megatron_trace.transfer.transports import DiskTransport, DistributedTransport, TransferError  # noqa: E402
from sglang_backend.api import WeightBucket  # noqa: E402
from sglang_backend.client import RolloutClient, RolloutError  # noqa: E402
from sglang_backend.local import Engine  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.sglang_server import start_sglang  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "sync-key"
IDS = [[5, 7, 9, 11, 3], [1, 2, 3]]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _info(url: str) -> dict:
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two NVFP4 W4A4 exports (different weights, one static activation table)."""
    root = tmp_path_factory.mktemp("sync_ckpts")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        arch, sd, cfg = load_hf_dir(make_tiny_checkpoint(root / f"src_{name}", "qwen2", seed=seed))
        amax = dict.fromkeys(QuantPolicy(kv="bf16").quantized_linears(arch), 4.0)
        out[name] = export_checkpoint(sd, arch, root / f"exp_{name}", input_amax=amax, hf_config=cfg)
    return out


@pytest.fixture(scope="module")
def reference(exports):
    """Greedy tokens and logprobs of the embedded engine on each export."""
    ref = {}
    for name, path in exports.items():
        e = Engine(str(path))
        try:
            outs = e.generate(input_ids=IDS, sampling_params=GREEDY, return_logprob=True)
            ref[name] = [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]
        finally:
            e.shutdown()
    return ref


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    yield from start_sglang(
        str(exports["a"]),
        tmp_path_factory,
        "--api-key",
        KEY,
        "--dtype",
        "float32",
        "--weight-version",
        "0",
        defaults=(),
    )


def _served(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in IDS:
        r = _post(url, "/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True})
        out.append((r["output_ids"], [lp[0] for lp in r["meta_info"]["output_token_logprobs"]]))
    return out


def _assert_same(got, want):
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want):
        assert g_ids == w_ids
        assert max(abs(a - b) for a, b in zip(g_lp, w_lp)) <= 1e-5, (g_lp, w_lp)


def test_served_export_matches_embedded_engine(server, reference):
    _assert_same(_served(server), reference["a"])


def test_distributed_sync_into_real_sglang(server, exports, reference):
    t = DistributedTransport([server], api_key=KEY, master_port=free_port(), timeout_s=120)
    try:
        for version, name in ((1, "b"), (2, "a")):  # scales rebuilt in place, session after session
            sd = load_file(str(exports[name] / "model.safetensors"))
            stats = t.send([WeightBucket(sd, version)], version)
            assert stats.tensors == len(sd)
            assert _info(server)["weight_version"] == str(version)
            _assert_same(_served(server), reference[name])
    finally:
        t.close()


def test_disk_sync_into_real_sglang(server, exports, reference, tmp_path):
    client = RolloutClient([server], api_key=KEY)
    cfg = json.loads((exports["a"] / "config.json").read_text())
    t = DiskTransport(client, tmp_path / "weights", cfg)
    for version, name in ((12, "b"),):
        t.send([WeightBucket(load_file(str(exports[name] / "model.safetensors")), version)], version)
        assert client.weight_versions() == {server: str(version)}
        _assert_same(_served(server), reference[name])


def test_colocated_tensor_sync_into_real_sglang(server, exports, reference):
    """SGLang's own update_weights_from_tensor payload (MultiprocessingSerializer, same node)."""
    t = SGLangTensorTransport([server], api_key=KEY)
    for version, name in ((21, "a"),):  # the disk test left "b" served
        t.send([WeightBucket(load_file(str(exports[name] / "model.safetensors")), version)], version)
        assert _info(server)["weight_version"] == str(version)
        _assert_same(_served(server), reference[name])


def test_sync_failure_keeps_served_version(server, exports):
    """A stream that diverges from what was announced is refused by the trainer before it is sent;
    the server's receive fails, it keeps serving the previous version and the group is re-made."""
    before, version = _info(server)["weight_version"], 99
    sd = load_file(str(exports["a"] / "model.safetensors"))
    t = DistributedTransport([server], api_key=KEY, master_port=free_port(), timeout_s=60)
    manifest = [(n, v.dtype, tuple(v.shape)) for n, v in sd.items()]
    bad = dict(sd)
    first = next(iter(bad))
    bad[first] = bad[first][:1]  # wrong shape
    try:
        with pytest.raises(TransferError, match="diverged"):
            t.send([WeightBucket(bad, version)], version, manifest=manifest)
        assert _info(server)["weight_version"] == before
    finally:
        t.close()


def test_bad_updates_are_refused_before_loading(server, exports, tmp_path):
    """An unknown name, a wrong shape, a wrong dtype: the plugin refuses each transport's update as a
    whole before any tensor is loaded, with SGLang's 400 {"success": false, "message"} naming the tensor;
    the server keeps its version and weights (every update also carries export b's valid tensors, so a
    partial load would show). Unpatched SGLang skips unknown names, and a wrong shape on the tensor
    path kills its scheduler."""
    before_version, before = _info(server)["weight_version"], _served(server)
    sd = load_file(str(exports["b"] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert sd[name].dtype == torch.uint8  # packed FP4 codes of the NVFP4 export
    unknown = {**sd, "model.layers.0.mlp.no_such_proj.weight": sd[name].clone()}
    bad_shape = {**sd, name: sd[name][:, :-1].contiguous()}
    bad_dtype = {**sd, name: sd[name].float()}
    client = RolloutClient([server], api_key=KEY, retries=0)
    dist = DistributedTransport([server], api_key=KEY, master_port=free_port(), timeout_s=120)
    disk = DiskTransport(client, tmp_path / "bad", json.loads((exports["b"] / "config.json").read_text()))
    cases = [
        (SGLangTensorTransport([server], api_key=KEY), unknown, "'model.layers.0.mlp.no_such_proj.weight': no such"),
        (SGLangTensorTransport([server], api_key=KEY), bad_shape, f"'{name}': shape [{sd[name].shape[0]}, "),
        (dist, bad_dtype, f"'{name}': dtype float32, the served model takes uint8"),
        (dist, bad_shape, f"'{name}': shape"),
        (disk, unknown, "no_such_proj.weight': no such tensor"),
    ]
    try:
        for version, (transport, tensors, says) in enumerate(cases, start=50):
            with pytest.raises((TransferError, RolloutError)) as e:
                transport.send([WeightBucket(tensors, version)], version)
            status = getattr(e.value, "status", None)  # RolloutError keeps it apart; the transports' text says it
            assert (status == 400 or "HTTP 400" in str(e.value)) and "refused before loading" in str(e.value), e.value
            assert says in str(e.value), (says, str(e.value))
            assert _info(server)["weight_version"] == before_version
        assert _served(server) == before  # the scheduler lives and serves the previous weights
    finally:
        dist.close()
        client.close()
