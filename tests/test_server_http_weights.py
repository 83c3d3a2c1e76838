"""The embedded server's weight paths over real loopback HTTP: octet-stream and base64 safetensors
buckets, a checkpoint on disk, a torch.distributed weight-update group; a refused update keeps the
served weights and version."""

from __future__ import annotations

import base64
import threading

import torch
from safetensors.torch import load_file, save

from megatron_trace.models.tiny import make_tiny_checkpoint
from sglang_backend.local import Engine
from sglang_backend.weight_group import WeightGroup, WeightSender
from tests.ports import free_port
from tests.server_http_support import GREEDY, bucket_of, jhttp

pytest_plugins = ["tests.server_http_fixtures"]  # fixtures: ckpts, ref, fresh


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
