"""The exporter (megatron_trace.transfer.export) from the command line: an NVFP4 export with static input
scales that the embedded engine loads with the live transfer's FP4 bits, and a BF16 export of a
single-rank Megatron checkpoint (its padded vocab cut back) that equals the HF weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
from safetensors.torch import load_file  # noqa: E402

from megatron_trace.fp4.modelopt import encode_scale_from_decode, input_scale_from_amax  # noqa: E402
from megatron_trace.models import ModelArch, QuantPolicy, hf_to_megatron, make_tiny_checkpoint  # noqa: E402
from megatron_trace.transfer.export import load_hf_dir  # noqa: E402
from sglang_backend.local import Engine  # noqa: E402
from tests.transfer_support import REPO, assert_fp4_equals, fp4_linears, subprocess_env  # noqa: E402

IDS = [[5, 7, 9, 11, 3], [1, 2, 3], [100, 200, 300, 17]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export_ckpts")
    for fam in ("qwen3", "qwen2"):
        make_tiny_checkpoint(root / fam, fam, seed=0)
    return root


def greedy(engine: Engine) -> list[list[int]]:
    out = engine.generate(input_ids=IDS, sampling_params={"max_new_tokens": 8, "temperature": 0})
    return [o["output_ids"] for o in out]


def test_export_cli_loads_and_matches(ckpts, tmp_path):
    src = ckpts / "qwen3"
    (src / "tokenizer_config.json").write_text("{}")
    arch = ModelArch.from_hf_config(src)
    amax_file = tmp_path / "amax.json"
    amax_file.write_text(json.dumps(dict.fromkeys(QuantPolicy(kv="bf16").quantized_linears(arch), 3.0)))
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
        env=subprocess_env(),
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
        assert_fp4_equals(got, load_file(str(src / "model.safetensors")), got.arch)
        want = encode_scale_from_decode(input_scale_from_amax(3.0))
        assert all(torch.equal(lin.input_global_scale, want) for _, _, lin in fp4_linears(got))
        assert len(greedy(got)[0]) == 8
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
