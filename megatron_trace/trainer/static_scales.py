"""Static activation scales for the trainer's QAT: {HF module: calibrated input amax} -> the S_enc
the rollout quantizes each FP4-activation site's input with (`QATState.set_static_activation_scales`)."""

from __future__ import annotations

import torch

from megatron_trace.fp4.modelopt import encode_scale_from_decode, input_scale_from_amax
from megatron_trace.models import ModelArch, QuantPolicy

# trainer site (HF names under model.layers.N.) -> the HF linears whose input it is
_SITE_MEMBERS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _site_members(arch: ModelArch) -> dict[str, tuple[str, ...]]:
    """The sites of one layer. A routed expert E has its own input_scale, so its scale sites are
    mlp.experts.E.gate_up_proj / down_proj (what `ExpertRows.expert_site` names; every layer of a
    Qwen3-MoE is an MoE layer)."""
    if not arch.is_moe:
        return _SITE_MEMBERS
    sites = {k: v for k, v in _SITE_MEMBERS.items() if k.startswith("self_attn.")}
    for e in range(arch.num_experts):
        p = f"mlp.experts.{e}."
        sites[p + "gate_up_proj"], sites[p + "down_proj"] = (p + "gate_proj", p + "up_proj"), (p + "down_proj",)
    return sites


def static_site_scales(input_amax: dict[str, float], arch: ModelArch, policy: QuantPolicy) -> dict[str, torch.Tensor]:
    """{HF module: calibrated input amax} (what the exporter and the transfer take) -> the static
    S_enc of each FP4-activation site: the max over a fused group's members, through the
    checkpoint's decode-direction input_scale, exactly as the engine reads it back
    (EngineLinear.finalize); per routed expert for MoE layers."""
    out = {}
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        for site, members in _site_members(arch).items():
            names = [prefix + m for m in members if policy.activation_is_fp4(prefix + m, arch.num_layers)]
            if not names:
                continue
            missing = [n for n in names if n not in input_amax]
            if missing:
                raise KeyError(
                    f"no calibrated input amax for {missing[:3]}: static activation scales need one "
                    f"per FP4-activation linear"
                )
            amax = max(float(input_amax[n]) for n in names)
            out[prefix + site] = encode_scale_from_decode(input_scale_from_amax(amax))
    return out
