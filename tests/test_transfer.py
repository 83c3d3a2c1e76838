"""megatron_trace.transfer: gather (TP2xPP2, EP2) round trip, quantize, buckets, the four
transports against the embedded engine/server, atomic versions under failure, and the exporter.

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

from megatron_trace.fp4.modelopt import encode_scale_from_decode, input_scale_from_amax, to_modelopt_fused  # noqa: E402
from megatron_trace.models import FAMILIES, ModelArch, QuantPolicy, hf_to_megatron, make_tiny_checkpoint  # noqa: E402
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

REPO = Path(__file__).resolve().parents[1]
KEY = "secret"
ALL_LINEARS = ("*.self_attn.*_proj", "*.mlp.*_proj", "*.mlp.experts.*")
IDS = [[5, 7, 9, 11, 3], [1, 2, 3], [100, 200, 300, 17]]


def _env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO),
    }


def _greedy(engine: Engine) -> list[list[int]]:
    out = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 8, "temperature": 0})
    return [o["output_ids"] for o in out]


def _fp4_linears(engine: Engine):
    for i, layer in enumerate(engine.model.layers):
        for attr in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(layer, attr, None)
            if lin is not None and lin.qweight is not None:
                yield i, attr, lin
        for kind in ("gate_up", "down"):
            for e, lin in enumerate(getattr(layer, f"experts_{kind}", None) or []):
                if lin.qweight is not None:
                    yield i, f"expert{e}.{kind}", lin


def _assert_fp4_equals(engine: Engine, hf: dict, arch: ModelArch):
    """Every FP4 linear of the engine holds to_modelopt_fused(HF weights) bit for bit."""
    shards = {
        "qkv": ("self_attn", "qkv"),
        "gate_up": ("mlp", ("gate", "up")),
        "down": ("mlp", ("down",)),
        "o_proj": ("self_attn", ("o",)),
    }
    n = 0
    for i, attr, lin in _fp4_linears(engine):
        if attr.startswith("expert"):
            e, kind = attr[6:].split(".")
            leaves = ("gate", "up") if kind == "gate_up" else ("down",)
            names = [f"model.layers.{i}.mlp.experts.{e}.{x}_proj.weight" for x in leaves]
        else:
            parent, leaves = shards[attr]
            names = [f"model.layers.{i}.{parent}.{x}_proj.weight" for x in leaves]
        want = to_modelopt_fused([hf[x] for x in names])
        assert torch.equal(lin.qweight.data, torch.cat([w["weight"] for w in want])), (i, attr)
        assert torch.equal(lin.qweight.scale, torch.cat([w["weight_scale"].view(torch.uint8) for w in want]))
        gs = encode_scale_from_decode(want[0]["weight_scale_2"])
        assert torch.equal(lin.qweight.global_scale, gs.expand(lin.out_features)), (i, attr)
        n += 1
    assert n > 0


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
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
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
    _assert_fp4_equals(engine, hf, arch)
    amax = dict.fromkeys(QuantPolicy().quantized_linears(arch), 4.0)  # a W4A4 export needs static scales
    exported = Engine(
        str(export_checkpoint(hf, arch, tmp_path / "exp", hf_config=arch.to_hf_config(), input_amax=amax))
    )
    try:  # the export holds the live transfer's FP4 bits
        _assert_fp4_equals(exported, hf, arch)
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
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
            push_hf_state_dict(bad, arch, QuantPolicy(), t, 6, bucket_mb=0.02)
        assert engine.weight_version == "0"
        # The next complete transfer is accepted (the transport re-creates the group).
        stats = push_hf_state_dict(sd, arch, QuantPolicy(), t, 6, bucket_mb=0.02)
        assert stats.buckets > 3 and engine.weight_version == "6"
        _assert_fp4_equals(engine, sd, arch)
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
            sd_b, arch, QuantPolicy(), InProcessTransport(InProcessBackend(engine)), 1, bucket_mb=0.05
        )
        assert engine.weight_version == "1" and s1.buckets > 1
        _assert_fp4_equals(engine, sd_b, arch)
        s2 = push_hf_state_dict(sd_a, arch, QuantPolicy(), HttpTransport(client), 2, bucket_mb=0.05)
        assert engine.weight_version == "2" and s2.bytes > 0
        _assert_fp4_equals(engine, sd_a, arch)
        disk = DiskTransport(client, tmp_path / "versions", arch.to_hf_config())
        push_hf_state_dict(sd_b, arch, QuantPolicy(), disk, 3, bucket_mb=0.05)
        assert engine.weight_version == "3"
        _assert_fp4_equals(engine, sd_b, arch)
        # NaN: nothing reaches the rollout, the error names the parameter.
        bad = dict(sd_a)
        bad["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.full_like(
            sd_a["model.layers.1.mlp.experts.2.up_proj.weight"], float("inf")
        )
        with pytest.raises(NonFiniteWeightError, match=r"experts\.2\.up_proj"):
            push_hf_state_dict(bad, arch, QuantPolicy(), HttpTransport(client), 4)
        assert engine.weight_version == "3"
    finally:
        server.shutdown()
        engine.shutdown()


def test_static_input_scales_arrive_every_transfer(ckpts):
    arch, sd, _ = load_hf_dir(ckpts / "qwen3")
    policy = QuantPolicy(targets=ALL_LINEARS, activation_scale="static")
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
            for i, attr, lin in _fp4_linears(engine):
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
    policy = QuantPolicy(targets=ALL_LINEARS)
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


def test_export_cli_loads_and_matches(ckpts, tmp_path):
    src = ckpts / "qwen3"
    (src / "tokenizer_config.json").write_text("{}")
    arch = ModelArch.from_hf_config(src)
    amax_file = tmp_path / "amax.json"
    amax_file.write_text(json.dumps(dict.fromkeys(QuantPolicy().quantized_linears(arch), 3.0)))
    out = tmp_path / "nvfp4"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_trace.transfer.export",
            "--load",
            str(src),
            "--out",
            str(out),
            "--format",
            "nvfp4",
            "--max-shard-mb",
            "0.1",
            "--input-amax",
            str(amax_file),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]  # ModelOpt 0.47's form (tests/test_export_forms.py reads it with SGLang)
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert "lm_head" in qc["ignore"] and "model.layers.0.self_attn.q_proj" in qc["ignore"]
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["trace_targets"] == list(QuantPolicy().targets)
    assert hq["exclude_modules"] == qc["ignore"] and hq["activation_scale"] == "static"
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer_config.json").exists()
    ref, got = Engine(str(src), quantization="nvfp4"), Engine(str(out))
    try:
        assert got.policy.quantized_linears(got.arch) == ref.policy.quantized_linears(ref.arch)
        _assert_fp4_equals(got, load_file(str(src / "model.safetensors")), got.arch)
        want = encode_scale_from_decode(input_scale_from_amax(3.0))
        assert all(torch.equal(lin.input_global_scale, want) for _, _, lin in _fp4_linears(got))
        assert len(_greedy(got)[0]) == 8
    finally:
        ref.shutdown()
        got.shutdown()


def test_export_single_rank_megatron_checkpoint(ckpts, tmp_path):
    arch, sd, _ = load_hf_dir(ckpts / "qwen2")
    root = tmp_path / "actor"
    (root / "step_3").mkdir(parents=True)
    meg = hf_to_megatron(sd, arch, padded_vocab_size=384)  # Megatron pads the vocab
    torch.save({"model": meg}, root / "step_3" / "rank_00000.pt")
    (root / "step_3" / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (root / "latest").write_text("step_3")
    from megatron_trace.transfer.export import main

    assert (
        main(
            [
                "--load",
                str(root),
                "--out",
                str(tmp_path / "bf16"),
                "--format",
                "bf16",
                "--hf-config",
                str(ckpts / "qwen2"),
            ]
        )
        == 0
    )
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    (root / "step_3" / "meta.json").write_text(json.dumps({"step": 3, "world_size": 4}))
    assert main(["--load", str(root), "--out", str(tmp_path / "x"), "--hf-config", str(ckpts / "qwen2")]) == 2
