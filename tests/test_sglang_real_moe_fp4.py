"""FP4 routed experts inside a real SGLang 0.5.23 server (CPU engine) against the embedded engine.

One server for the module, started the way a user starts it (`python -m sglang_backend.launch
--backend sglang --quantization nvfp4`): the plugin quantizes the tiny fp32 Qwen3-MoE checkpoint
online, its FusedMoE layers run plugin/moe_method.py (NVFP4 W4A4 experts) and every layer is guided
with full codes, routed experts returned. The embedded engine serves the same checkpoint with the same
flags in-process. Then weight updates (BF16 from disk; the trainer's packed NVFP4 push) and two guided
RL steps with this server as the rollout.
"""

from __future__ import annotations

import pytest
import sglang  # noqa: F401 - the test command installs it: no import, no pass

from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine, InProcessBackend
from tests.sglang_server import start_sglang

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 3, 99], [9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 14]]
EXPERT_SITES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
FLAGS = (
    "--quantization",
    "nvfp4",
    "--guidance-mode",
    "full",
    "--guided-layers",
    "all",
    "--enable-return-routed-experts",
)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe_fp4"), "qwen3_moe", seed=3))


@pytest.fixture(scope="module")
def sglang_url(moe_ckpt, tmp_path_factory):
    yield from start_sglang(moe_ckpt, tmp_path_factory, *FLAGS)


@pytest.fixture(scope="module")
def both(moe_ckpt, sglang_url):
    """(real SGLang results + records, embedded engine results + records) for PROMPTS, greedy."""
    reqs = [
        GenerateRequest(
            p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), rid=f"m{i}", return_guidance=True
        )
        for i, p in enumerate(PROMPTS)
    ]
    client = RolloutClient([sglang_url], retries=0)
    try:
        real = client.generate(reqs)
        real_recs = [client.fetch_guidance(r.guidance_handle) for r in real]
    finally:
        client.close()
    eng = Engine(moe_ckpt, quantization="nvfp4", guidance_mode="full", guided_layers="all")
    try:
        backend = InProcessBackend(eng)
        ours = backend.generate(reqs)
        our_recs = [backend.fetch_guidance(r.guidance_handle) for r in ours]
    finally:
        eng.shutdown()
    return (real, real_recs), (ours, our_recs)


def test_greedy_tokens_and_logprobs_equal_the_engine(both):
    (real, _), (ours, _) = both
    assert [r.output_ids for r in real] == [r.output_ids for r in ours]
    worst = max(abs(a - b) for r, o in zip(real, ours) for a, b in zip(r.output_logprobs, o.output_logprobs))
    print("moe fp4 worst |dlogprob|", worst)
    assert worst <= 1e-5, worst


def test_expert_guidance_equals_the_engine(both, moe_ckpt):
    """Every layer's expert sites, in the engine's layout (gate_up one row per token [T, H], down one per
    routed slot [T, top_k, I]), with the engine's codes, E4M3 scales and per-token S_enc. Not bit for
    bit: fp32 activations of SGLang's kernels (torch_native attention, its norms, GEMMs over batches
    SGLang composes its own way) and the engine's differ by an ulp here and there, so a token's amax
    may too, and a code at a rounding boundary may flip; as test_sglang_real.py's dense sites: >= 99.9%
    equal code and scale bytes, S_enc within 1e-5 relative."""
    from megatron_trace.models import ModelArch

    arch = ModelArch.from_hf_config(moe_ckpt)
    (_, real_recs), (_, our_recs) = both
    same = {"codes": [0, 0], "scales": [0, 0]}
    worst = 0.0
    for got, want in zip(real_recs, our_recs):
        assert got.num_positions == want.num_positions
        assert sorted(got.sites) == sorted(want.sites)  # the default policy's FP4 linears: the experts
        for i in range(arch.num_layers):
            for leaf in EXPERT_SITES:
                name = f"model.layers.{i}.{leaf}"
                g, w = got.sites[name], want.sites[name]
                per_slot = leaf.endswith("down_proj")
                k = arch.moe_intermediate_size if per_slot else arch.hidden_size
                lead = (want.num_positions, arch.num_experts_per_tok) if per_slot else (want.num_positions,)
                assert tuple(w.payload.shape) == (*lead, k // 2) and tuple(g.payload.shape) == tuple(w.payload.shape)
                assert g.scale.shape == w.scale.shape and g.global_scale.shape == w.global_scale.shape == lead, name
                for key, u, v in (("codes", g.payload, w.payload), ("scales", g.scale, w.scale)):
                    same[key] = [same[key][0] + int((u == v).sum()), same[key][1] + u.numel()]
                worst = max(worst, float(((g.global_scale - w.global_scale).abs() / w.global_scale).max()))
    stats = {key: equal / total for key, (equal, total) in same.items()} | {"s_enc_rel": worst}
    print("moe fp4 expert guidance agreement", stats, same)
    assert stats["codes"] >= 0.999 and stats["scales"] >= 0.999 and worst <= 1e-5, (stats, same)


def test_expert_weight_update_is_requantized(moe_ckpt, sglang_url, tmp_path):
    """/update_weights_from_disk with another checkpoint: FusedMoE's loader writes the BF16 experts in
    place and the plugin re-quantizes them before the next forward, so the server's greedy tokens and
    logprobs are the engine's on the new weights (stale FP4 experts would keep the old tokens)."""
    new = str(make_tiny_checkpoint(tmp_path / "new", "qwen3_moe", seed=4))
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)) for p in PROMPTS]
    client = RolloutClient([sglang_url], retries=0)
    try:
        before = client.generate(reqs)
        client.update_weights_from_disk(new, 1)
        real = client.generate(reqs)
    finally:
        client.close()
    eng = Engine(new, quantization="nvfp4")
    try:
        ours = InProcessBackend(eng).generate(reqs)
    finally:
        eng.shutdown()
    assert [r.output_ids for r in real] == [r.output_ids for r in ours] != [r.output_ids for r in before]
    worst = max(abs(a - b) for r, o in zip(real, ours) for a, b in zip(r.output_logprobs, o.output_logprobs))
    print("moe fp4 after update worst |dlogprob|", worst)
    assert worst <= 1e-5, worst


def test_trainer_push_of_packed_nvfp4_experts(sglang_url, tmp_path):
    """The trainer's weight sync for an NVFP4 policy (ModelOpt tensors: expert codes, E4M3 scales,
    weight_scale_2) through the disk transport: the experts serve those bits (moe_packed.py), so the
    server's greedy tokens and logprobs are the engine's on the same checkpoint (the exporter's codes
    are the engine's own quantization of it)."""
    from megatron_trace.models import QuantPolicy
    from megatron_trace.transfer.export import load_hf_dir
    from megatron_trace.transfer.pipeline import push_hf_state_dict
    from megatron_trace.transfer.transports import DiskTransport

    new = make_tiny_checkpoint(tmp_path / "pushed", "qwen3_moe", seed=5)
    arch, sd, cfg = load_hf_dir(new)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)) for p in PROMPTS]
    client = RolloutClient([sglang_url], retries=0)
    try:
        before = client.generate(reqs)
        stats = push_hf_state_dict(
            sd, arch, QuantPolicy(kv="bf16", format="nvfp4"), DiskTransport(client, tmp_path / "w", cfg), 2
        )
        assert stats.tensors > len(sd)  # every FP4 expert linear went as codes + scales + weight_scale_2
        assert client.weight_versions() == {sglang_url: "2"}
        real = client.generate(reqs)
    finally:
        client.close()
    eng = Engine(str(new), quantization="nvfp4")
    try:
        ours = InProcessBackend(eng).generate(reqs)
    finally:
        eng.shutdown()
    assert [r.output_ids for r in real] == [r.output_ids for r in ours] != [r.output_ids for r in before]
    worst = max(abs(a - b) for r, o in zip(real, ours) for a, b in zip(r.output_logprobs, o.output_logprobs))
    print("moe fp4 after packed push worst |dlogprob|", worst)
    assert worst <= 1e-5, worst


def test_guided_rl_steps_through_real_sglang_fp4_experts(moe_ckpt, sglang_url, tmp_path):
    """Two RL steps of the tiny MoE config with this server as the rollout: NVFP4 experts, guided QAT
    fed by the server's expert guidance, routing replay, weights pushed packed (disk) between steps,
    and the server asked to release and resume its memory around each train phase (colocated)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    client = RolloutClient([sglang_url], retries=0)
    try:  # the tests above updated the server's weights: the run starts from the checkpoint, version 0
        client.update_weights_from_disk(moe_ckpt, 0)
    finally:
        client.close()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_trace.train", "--config", "configs/tiny_moe_cpu.yaml"]
    cmd += [f"model.path={moe_ckpt}", "rollout.backend=http", f"rollout.urls=[{sglang_url}]", "rollout.dtype=float32"]
    # the gate scores the server's FP4 experts (a random-init MoE loses more than its limits): run anyway
    cmd += [
        "quant.accept_quality_loss=true",
        "quant.kv=bf16",
        "trainer.qat_mode=guided",
        "trainer.routing_replay=on",
        "transfer.transport=disk",
        "rollout.colocated=on",
    ]
    cmd += ["rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.eval_prompts=0", "trainer.micro_batch_size=4"]
    cmd += ["trainer.steps=2", "trainer.save_every=0", "logging.progress=false", f"logging.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    for step, r in steps.items():
        print("moe fp4 rl step", step, {k: v for k, v in r.items() if k.startswith("mismatch/")})
    assert sorted(steps) == [0, 1] and steps[1]["rollout/weight_version"] == 1
    # released and resumed every step; what it freed shows in the server's process, not the trainer's
    assert all("perf/engine_resume_s" in r and "perf/engine_released_gib" not in r for r in steps.values())
    for r in steps.values():  # fp32 on both sides: the trainer's guided QAT reproduces the rollout
        assert r["mismatch/routing_replayed"] == 1.0 and r["mismatch/guidance_bytes_per_token"] > 0
        assert r["mismatch/mean_abs_dlogp"] < 1e-4 and r["mismatch/codeword_disagreement/mean"] < 1e-3
