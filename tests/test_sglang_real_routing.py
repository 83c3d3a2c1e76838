"""Routed experts from a real SGLang 0.5.23 server (CPU engine, through our launcher with
--enable-return-routed-experts; the plugin unpins the host buffer SGLang would cudaHostRegister)
against the embedded engine and HF transformers' router, through our client, and two RL steps with
that server as the rollout. One server start (~30-70 s on 2 cores): the only place the real
capture path (RoutedExpertsCapturer -> detokenizer base64 -> meta_info.routed_experts) runs."""

from __future__ import annotations

import pytest
import sglang  # noqa: F401 - the test command installs it: no import, no pass
import torch

from megatron_trace.guidance import decode_routed_experts
from megatron_trace.models import ModelArch, make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine, InProcessBackend
from tests.helpers import hf_topk
from tests.sglang_server import start_sglang

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 3, 99]]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3))


@pytest.fixture(scope="module")
def sglang_url(moe_ckpt, tmp_path_factory):
    yield from start_sglang(moe_ckpt, tmp_path_factory, "--enable-return-routed-experts")


def test_real_sglang_routed_experts_equal_the_engine_and_hf(moe_ckpt, sglang_url):
    arch = ModelArch.from_hf_config(moe_ckpt)
    reqs = [
        GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), return_routed_experts=True)
        for p in PROMPTS
    ]
    real = RolloutClient([sglang_url]).generate(reqs)
    eng = Engine(moe_ckpt)
    try:
        ours = InProcessBackend(eng).generate(reqs)
    finally:
        eng.shutdown()
    for p, r, o in zip(PROMPTS, real, ours):
        assert r.output_ids == o.output_ids  # the same greedy tokens on both stacks
        tokens = p + r.output_ids
        ids = decode_routed_experts(
            r.routed_experts, len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok, arch.num_experts
        )
        mine = decode_routed_experts(o.routed_experts, len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok)
        ref = hf_topk(moe_ckpt, tokens[:-1], arch.num_experts_per_tok).to(torch.int32)
        assert torch.equal(ids, ref) and torch.equal(mine, ref)  # same experts, same top-k order
    plain = RolloutClient([sglang_url]).generate([GenerateRequest(PROMPTS[0], reqs[0].sampling_params)])[0]
    assert plain.routed_experts is None  # only when asked


def test_rl_steps_through_real_sglang_replay_its_routing(moe_ckpt, sglang_url, tmp_path):
    """Two RL steps of the tiny MoE config with the real server as the rollout (BF16, QAT off: this
    module's server quantizes nothing; FP4 experts: test_sglang_real_moe_fp4.py) and routing replay
    on: every sample carries the server's routed experts, the trainer used them, the weights reach
    the server (disk)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_trace.train",
        "--config",
        "configs/tiny_moe_cpu.yaml",
        f"model.path={moe_ckpt}",
        "rollout.backend=http",
        f"rollout.urls=[{sglang_url}]",
        "rollout.dtype=float32",
        "quant.format=bf16",
        "quant.weights=bf16",
        "quant.activations=bf16",
        "quant.kv=bf16",
        "trainer.qat_mode=off",
        "trainer.routing_replay=on",
        "transfer.transport=disk",
        "rollout.prompts_per_step=2",
        "rollout.n_samples=2",
        "rollout.eval_prompts=0",
        "trainer.micro_batch_size=4",
        "trainer.steps=2",
        "trainer.save_every=0",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    assert sorted(steps) == [0, 1] and steps[1]["rollout/weight_version"] == 1
    for r in steps.values():
        assert r["mismatch/routing_replayed"] == 1.0
        assert r["mismatch/routing_agreement"] > 0.99  # fp32 on both sides: the same routing
        assert r["mismatch/mean_abs_dlogp"] < 1e-4
