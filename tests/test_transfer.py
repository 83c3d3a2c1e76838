"""megatron_trace.transfer: gather (TP2xPP2, EP2) round trip, quantize, buckets, the four
transports against the embedded engine/server and atomic versions under failure (the exporter's
CLI: tests/test_transfer_export.py).

One 4-process torchrun launch (tests/mp_scripts/transfer_check.py) covers the Megatron side; the
rest runs in this process against an in-process engine + HTTP server (imports dominate on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
from safetensors.torch import load_file  # noqa: E402

from megatron_trace.fp4.modelopt import encode_scale_from_decode, input_scale_from_amax  # noqa: E402
from megatron_trace.models import FAMILIES, ModelArch, QuantPolicy, make_tiny_checkpoint  # noqa: E402
from megatron_trace.transfer.bucket import BucketStats, pack_buckets  # noqa: E402
from megatron_trace.transfer.export import export_checkpoint, load_hf_dir  # noqa: E402
from megatron_trace.transfer.pipeline import hf_state_dict_stream, push_hf_state_dict  # noqa: E402
from megatron_trace.transfer.quantize import NonFiniteWeightError, group_key, rollout_tensors  # noqa: E402
from megatron_trace.transfer.transports import (  # noqa: E402
    DiskTransport,
    DistributedTransport,
    HttpTransport,
    InProcessTransport,
)
from sglang_backend.client import RolloutClient  # noqa: E402
from sglang_backend.local import Engine, InProcessBackend  # noqa: E402
from sglang_backend.local.server import serve  # noqa: E402
from tests.ports import free_port
from tests.transfer_support import REPO, assert_fp4_equals, fp4_linears, subprocess_env

KEY = "secret"
ALL_LINEARS = ("*.self_attn.*_proj", "*.mlp.*_proj", "*.mlp.experts.*")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tr_ckpts")
    for fam in FAMILIES:
        make_tiny_checkpoint(root / fam, fam, seed=0)
    make_tiny_checkpoint(root / "qwen3_b", "qwen3", seed=1)  # different weights: updates must show
    return root


@pytest.fixture(scope="module")
def dist_run(ckpts, tmp_path_factory):
    """TP2xPP2 / EP2 round trips + a TP2xPP2 push of qwen3 (seed 0) into a server holding seed 1."""
    out = tmp_path_factory.mktemp("tr_mp")
    engine = Engine(str(ckpts / "qwen3_b"), quantization="nvfp4")
    server = serve(engine, api_key=KEY)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests/mp_scripts/transfer_check.py"),
        "--ckpts",
        str(ckpts),
        "--out",
        str(out),
        "--url",
        server.url,
        "--api-key",
        KEY,
        "--master-port",
        str(free_port()),
        "--send",
        str(ckpts / "qwen3"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    if proc.returncode != 0 or not (out / "done").exists():
        server.shutdown()
        engine.shutdown()
        pytest.fail(f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    yield out, engine, server
    server.shutdown()
    engine.shutdown()


@pytest.mark.parametrize("fam", FAMILIES)
def test_gather_round_trip_bit_exact(fam, ckpts, dist_run):
    out, _, _ = dist_run
    hf = load_file(str(ckpts / fam / "model.safetensors"))
    for cfg in ["2x2x1"] + (["1x1x2"] if fam == "qwen3_moe" else []):
        got = load_file(str(out / f"rt_{fam}_{cfg}.safetensors"))
        assert sorted(got) == sorted(hf), cfg
        for k, v in hf.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{cfg}: {k}"
        assert json.loads((out / f"order_{fam}_{cfg}.json").read_text())["ok"], "stream order != hf_order plan"


def test_distributed_transfer_from_tp2_pp2(ckpts, dist_run, tmp_path):
    out, engine, _ = dist_run
    stats = json.loads((out / "send_stats.json").read_text())
    assert stats["version"] == 7 and stats["buckets"] > 3 and stats["bytes"] > 0
    assert engine.weight_version == "7"
    hf = load_file(str(ckpts / "qwen3" / "model.safetensors"))
    arch = ModelArch.from_hf_config(ckpts / "qwen3")
    assert_fp4_equals(engine, hf, arch)
    amax = dict.fromkeys(QuantPolicy(kv="bf16").quantized_linears(arch), 4.0)  # a W4A4 export needs static scales
    exported = Engine(
        str(export_checkpoint(hf, arch, tmp_path / "exp", hf_config=arch.to_hf_config(), input_amax=amax))
    )
    try:  # the export holds the live transfer's FP4 bits
        assert_fp4_equals(exported, hf, arch)
    finally:
        exported.shutdown()


def test_interrupted_transfer_keeps_previous_version(ckpts, tmp_path):
    engine = Engine(str(ckpts / "qwen3"), quantization="nvfp4")
    server = serve(engine, api_key=KEY)
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        port = free_port()
        cmd = [
            sys.executable,
            str(REPO / "tests/mp_scripts/transfer_sender.py"),
            "--ckpt",
            str(ckpts / "qwen3_b"),
            "--url",
            server.url,
            "--api-key",
            KEY,
            "--port",
            str(port),
            "--version",
            "5",
        ]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            line = proc.stdout.readline()
            assert "SENT_ONE" in line, proc.stderr.read()[-3000:]
            os.kill(proc.pid, signal.SIGKILL)  # the sender dies mid-version
        finally:
            proc.wait(30)
        client = RolloutClient(server.url, api_key=KEY)
        deadline = time.time() + 30
        while client.model_info()["weight_update_groups"] and time.time() < deadline:
            time.sleep(0.1)  # the server's receive fails, it drops the group
        assert client.model_info()["weight_update_groups"] == []
        assert engine.weight_version == "0"
        after = engine.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a partial version leaked in"
        # NaN in the stream: refused before sending, naming the parameter; still version 0.
        arch, sd, _ = load_hf_dir(ckpts / "qwen3_b")
        t = DistributedTransport(server.url, KEY, "127.0.0.1", free_port())
        bad = dict(sd)
        bad["model.layers.3.mlp.down_proj.weight"] = sd["model.layers.3.mlp.down_proj.weight"].clone()
        bad["model.layers.3.mlp.down_proj.weight"][1, 2] = float("nan")
        with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.3\.mlp\.down_proj\.weight"):
            push_hf_state_dict(bad, arch, QuantPolicy(kv="bf16"), t, 6, bucket_mb=0.02)
        assert engine.weight_version == "0"
        # The next complete transfer is accepted (the transport re-creates the group).
        stats = push_hf_state_dict(sd, arch, QuantPolicy(kv="bf16"), t, 6, bucket_mb=0.02)
        assert stats.buckets > 3 and engine.weight_version == "6"
        assert_fp4_equals(engine, sd, arch)
        t.close()
    finally:
        server.shutdown()
        engine.shutdown()


def test_inprocess_http_disk_transports(ckpts, tmp_path):
    arch, sd_a, _ = load_hf_dir(ckpts / "qwen3_moe")
    engine = Engine(str(ckpts / "qwen3_moe"), quantization="nvfp4")
    server = serve(engine, api_key=KEY)
    try:
        sd_b = {k: v * 1.5 for k, v in sd_a.items()}
        client = RolloutClient(server.url, api_key=KEY)
        s1 = push_hf_state_dict(
            sd_b, arch, QuantPolicy(kv="bf16"), InProcessTransport(InProcessBackend(engine)), 1, bucket_mb=0.05
        )
        assert engine.weight_version == "1" and s1.buckets == 0 and s1.tensors > 0  # one process: tensors, no buckets
        assert_fp4_equals(engine, sd_b, arch)
        s2 = push_hf_state_dict(sd_a, arch, QuantPolicy(kv="bf16"), HttpTransport(client), 2, bucket_mb=0.05)
        assert engine.weight_version == "2" and s2.bytes > 0 and s2.buckets > 1  # the wire: buckets
        assert_fp4_equals(engine, sd_a, arch)
        disk = DiskTransport(client, tmp_path / "versions", arch.to_hf_config())
        push_hf_state_dict(sd_b, arch, QuantPolicy(kv="bf16"), disk, 3, bucket_mb=0.05)
        assert engine.weight_version == "3"
        assert_fp4_equals(engine, sd_b, arch)
        # NaN: nothing reaches the rollout, the error names the parameter.
        bad = dict(sd_a)
        bad["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.full_like(
            sd_a["model.layers.1.mlp.experts.2.up_proj.weight"], float("inf")
        )
        with pytest.raises(NonFiniteWeightError, match=r"experts\.2\.up_proj"):
            push_hf_state_dict(bad, arch, QuantPolicy(kv="bf16"), HttpTransport(client), 4)
        assert engine.weight_version == "3"
    finally:
        server.shutdown()
        engine.shutdown()


def test_static_input_scales_arrive_every_transfer(ckpts):
    arch, sd, _ = load_hf_dir(ckpts / "qwen3")
    policy = QuantPolicy(kv="bf16", targets=ALL_LINEARS, activation_scale="static")
    engine = Engine(str(ckpts / "qwen3"), quant_policy=policy)
    try:
        t = InProcessTransport(InProcessBackend(engine))
        mods = policy.quantized_linears(arch)
        for version, base in ((1, 3.0), (2, 7.5)):
            amax = {m: base + 0.25 * i for i, m in enumerate(mods)}
            with pytest.raises(KeyError, match="input amax"):
                push_hf_state_dict(sd, arch, policy, t, version, input_amax={})
            push_hf_state_dict(sd, arch, policy, t, version, input_amax=amax)
            assert engine.weight_version == str(version)
            seen = 0
            for i, attr, lin in fp4_linears(engine):
                members = [
                    m
                    for m in mods
                    if m.startswith(f"model.layers.{i}.")
                    and group_key(m + ".weight").endswith(
                        {"qkv": "qkv_proj", "gate_up": "gate_up_proj", "o_proj": "o_proj", "down": "down_proj"}[attr]
                    )
                ]
                want = max(amax[m] for m in members)
                s_dec = input_scale_from_amax(want)
                assert lin.input_global_scale is not None and float(s_dec) != 1.0
                assert torch.equal(lin.input_global_scale, encode_scale_from_decode(s_dec)), (i, attr)
                seen += 1
            assert seen == 4 * arch.num_layers  # qkv, o, gate_up, down per layer
    finally:
        engine.shutdown()


@pytest.mark.parametrize("budget", [3000, 20000, 10**9])
def test_buckets_respect_budget_and_keep_groups(ckpts, budget):
    arch, sd, _ = load_hf_dir(ckpts / "qwen3_moe")
    policy = QuantPolicy(kv="bf16", targets=ALL_LINEARS)
    units = list(rollout_tensors(hf_state_dict_stream(sd, arch), arch, policy))
    unit_of = {n: i for i, u in enumerate(units) for n, _ in u}
    stats = BucketStats()
    buckets = list(pack_buckets(iter(units), 9, budget_bytes=budget, stats=stats))
    assert all(b.version == 9 for b in buckets)
    sizes = {i: sum(t.numel() * t.element_size() for _, t in u) for i, u in enumerate(units)}
    seen_units: dict[int, int] = {}
    for bi, b in enumerate(buckets):
        in_bucket = {unit_of[n] for n in b.tensors}
        assert b.nbytes() <= budget or len(in_bucket) == 1, "over budget with more than one unit"
        for u in in_bucket:
            assert seen_units.setdefault(u, bi) == bi, "a unit was split across buckets"
            assert all(n in b.tensors for n, _ in units[u])
    # fused q/k/v and gate/up (incl. each expert's) share one bucket and one global scale
    for b in buckets:
        for n in b.tensors:
            if n.endswith(".q_proj.weight_scale_2") or n.endswith(".gate_proj.weight_scale_2"):
                sib = n.replace("q_proj", "k_proj").replace("gate_proj", "up_proj")
                assert sib in b.tensors and torch.equal(b.tensors[n], b.tensors[sib])
    assert stats.tensors == sum(len(u) for u in units) and stats.oversized_units == sum(
        1 for s in sizes.values() if s > budget
    )
