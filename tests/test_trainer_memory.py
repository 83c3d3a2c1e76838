"""Trainer memory grows linearly in the sample's length and stays small at reasoning lengths: one
logprob recompute + one train step on one sample of a tiny 2-layer Qwen2 with Qwen's 151,936-token
vocabulary (so the logits, not the layers, would dominate), plain and guided QAT.

Each measurement is its own process (tests/mp_scripts/trainer_memory.py): the kernel's peak-RSS
mark is reset after a warm-up step and read after the long step. Before packing and chunked
vocab-parallel logprobs this step grew 1.9 GB per 1,000 tokens (7.7 GB at 4,096).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_trace.models import QuantPolicy, make_tiny_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "mp_scripts" / "trainer_memory.py"
POLICY = QuantPolicy(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4")  # W4A4 MLPs + FP4 KV


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sglang_backend.local import Engine

    root = tmp_path_factory.mktemp("mem")
    ckpt = make_tiny_checkpoint(
        root / "ckpt", "qwen2", seed=0, vocab_size=151936, num_hidden_layers=2, max_position_embeddings=8192
    )
    eng = Engine(str(ckpt), dtype="bfloat16", quant_policy=POLICY, guidance_mode="full", guided_layers="all")
    try:
        out = eng.generate(
            input_ids=list(range(100, 116)),
            sampling_params={"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True},
            return_guidance=True,
        )
        (root / "record.bin").write_bytes(eng.fetch_guidance(out["meta_info"]["guidance_handle"]))
    finally:
        eng.shutdown()
    return ckpt, root / "record.bin"


def test_long_sample_step_memory_is_small_and_linear(setup):
    ckpt, record = setup
    cmd = [sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--record", str(record)]
    cmd += ["--policy", json.dumps(POLICY.to_dict()), "--runs", "rtn:1536,rtn:6144,guided:6144"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    short, long, guided = (json.loads(line) for line in proc.stdout.strip().splitlines()[-3:])
    print(json.dumps([short, long, guided]))
    assert long["growth_gb"] <= 2.0, long
    assert guided["growth_gb"] <= 2.0, guided
    assert long["growth_gb"] <= 5 * max(short["growth_gb"], 0.05), (short, long)
