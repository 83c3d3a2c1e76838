"""The project's layer spec with the RMSNorm fused into linear_qkv / linear_fc1 (Transformer
Engine's layout) gives the unfused layout's QAT logprobs, in every mode, and QAT there quantizes the
normalized activation: guided rounding reproduces the rollout's codes at the fused sites."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint  # noqa: E402

# Attention projections too, so linear_qkv (fused with input_layernorm) is an FP4 site.
POLICY = QuantPolicy(kv="nvfp4", targets=("*.self_attn.*", "*.mlp.*"))
PROMPTS = [[5, 17, 40, 2, 99, 7], [11, 3, 250, 8]]


def _rollout(ckpt, policy):
    """Greedy rollout on the embedded engine (fp32, so the sides differ only by kernels) with full
    guidance (and, for MoE, the routed experts that name the expert slots); returns the [B, S] token
    rows, each sample's record and its routed experts (None for dense models)."""
    from megatron_trace.guidance import decode_routed_experts
    from sglang_backend.local import Engine

    eng = Engine(
        str(ckpt), dtype="bfloat16", quant_policy=policy, guidance_mode="full", guided_layers="all", random_seed=0
    )
    try:
        outs = eng.generate(
            input_ids=PROMPTS,
            sampling_params={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
            return_logprob=True,
            return_guidance=True,
            return_routed_experts=eng.arch.is_moe,
        )
        recs = [eng.fetch_guidance(o["meta_info"]["guidance_handle"]) for o in outs]
        seqs = [p + o["output_ids"] for p, o in zip(PROMPTS, outs)]
        a = eng.arch
        routed = [
            decode_routed_experts(o["meta_info"]["routed_experts"], len(t) - 1, a.num_layers, a.num_experts_per_tok)
            if a.is_moe
            else None
            for o, t in zip(outs, seqs)
        ]
    finally:
        eng.shutdown()
    s = max(len(t) for t in seqs) - 1
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    for j, t in enumerate(seqs):
        ids[j, : len(t) - 1] = torch.tensor(t[:-1])
        recs[j].validate(len(t) - 1)
    return ids, recs, routed


def _qat_logits(ckpt, arch, ids, recs, routed, fused: bool):
    from megatron_trace.trainer.batching import MicroBatchGuidance, columns
    from megatron_trace.trainer.gpt import build_model, forward_logits, load_hf_weights
    from megatron_trace.trainer.qat import install_qat
    from megatron_trace.trainer.routing_replay import RoutingReplay

    chunks = build_model(arch, dtype=torch.float32, fused_norm=fused)
    load_hf_weights(chunks, ckpt, arch)
    names = {n for n, _ in chunks[0].named_parameters()}
    state = install_qat(chunks, arch, POLICY, "off", [0])
    # MoE: the rollout's routing replayed, and its expert ids name the expert-site slots
    state.routing_replay = RoutingReplay(chunks[0], arch, 0, replay=arch.is_moe)
    out = {}
    for mode in ("off", "rtn", "guided"):
        state.set_mode(mode)
        state.guidance = MicroBatchGuidance.padded(recs, ids.shape[1])
        b, s = ids.shape
        state.routing_replay.begin(routed, [f"s{j}" for j in range(b)], columns(b, s), b * s)
        out[mode] = forward_logits(chunks, ids)
        state.routing_replay.end()
        out[mode + "_agreement"] = state.agreement()
    return out, names


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_fused_norm_layout_equals_unfused_in_every_qat_mode(family, tmp_path):
    from megatron_trace.trainer.parallel import destroy, init_distributed

    ckpt = make_tiny_checkpoint(tmp_path / family, family, seed=0)
    arch = ModelArch.from_hf_config(ckpt)
    ids, recs, routed = _rollout(ckpt, POLICY)
    init_distributed(tp=1, pp=1, seed=0)
    try:
        fused, fused_names = _qat_logits(ckpt, arch, ids, recs, routed, fused=True)
        plain, plain_names = _qat_logits(ckpt, arch, ids, recs, routed, fused=False)
    finally:
        destroy()
    # The fused layout holds the norms under TE's names, and the HF map loads them there.
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in fused_names
    assert "decoder.layers.0.input_layernorm.weight" not in fused_names
    assert "decoder.layers.0.input_layernorm.weight" in plain_names
    dense_fc1_norm = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert (dense_fc1_norm in fused_names) == (family != "qwen3_moe")  # MoE keeps pre_mlp_layernorm
    for mode in ("off", "rtn", "guided"):
        assert torch.equal(fused[mode], plain[mode]), mode
        assert fused[mode + "_agreement"] == plain[mode + "_agreement"]
    # The modes differ (QAT is on), and guided rounding meets the rollout's codes at the sites fed
    # by a fused norm: what the fused linear quantizes is the normalized activation.
    assert not torch.equal(fused["off"], fused["rtn"]) and not torch.equal(fused["rtn"], fused["guided"])
    agree = fused["guided_agreement"]
    qkv = [v for k, v in agree.items() if k.endswith("self_attn.qkv_proj")]
    assert len(qkv) == arch.num_layers and min(qkv) >= 0.999
    if family != "qwen3_moe":
        gate_up = [v for k, v in agree.items() if k.endswith("mlp.gate_up_proj")]
        assert len(gate_up) == arch.num_layers and min(gate_up) >= 0.999
    assert max(fused["rtn_agreement"].values()) < 0.999  # bf16 rollout vs fp32 trainer: rtn flips codes
