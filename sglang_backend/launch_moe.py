"""The launcher's MoE check: `--backend sglang` refuses, before SGLang starts, a checkpoint whose routed
experts are FP4 where the plugin cannot serve them so. SGLang would otherwise build its BF16 experts in
their place (the silent fallback); the plugin's configs refuse the same layers when SGLang builds them,
and this check asks those configs, so both say the same."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


def refuse_unserved_fp4_experts(model_path: str, *, export: bool, policy, tp_size: int, quantization) -> None:
    """ValueError naming the layer and the missing piece for: an exported checkpoint's ModelOpt NVFP4
    experts (`export`: trace_fp4 has no FusedMoE method), or online FP4 experts (`policy`: the online
    quantization's QuantPolicy, None when there is none) split over TP ranks."""
    from megatron_trace.models import ModelArch

    arch = ModelArch.from_hf_config(Path(model_path))
    prefixes = [f"model.layers.{i}.mlp.experts" for i in range(arch.num_layers) if arch.layer_is_moe(i)]
    if not prefixes or not (export or policy is not None):
        return
    from sglang_backend.plugin.moe_method import experts_are_fp4

    probe = SimpleNamespace(num_experts=arch.num_experts)  # what the configs read of a FusedMoE
    if export:
        from sglang_backend.plugin.quant_config import TraceFP4Config

        config = TraceFP4Config.from_config(_export_quant_config(Path(model_path)))
        for prefix in prefixes:
            try:
                config.experts_method(probe, prefix)
            except NotImplementedError as e:
                raise ValueError(str(e)) from None
        return
    fp4 = [
        p for p in prefixes if experts_are_fp4(p, arch.num_experts, lambda m: policy.linear_is_fp4(m, arch.num_layers))
    ]
    if fp4 and tp_size > 1:
        raise ValueError(
            f"--quantization {quantization} makes the routed experts of {fp4[0]} FP4, which the plugin's "
            f"FusedMoE method (plugin/moe_method.py) computes at TP 1 only; --tp-size {tp_size} would need the "
            "per-expert amax and the down input's per-token scale over the TP group"
        )


def _export_quant_config(root: Path) -> dict:
    """The ModelOpt quant config SGLang reads: config.json's quantization_config, else hf_quant_config.json."""
    cfg = json.loads((root / "config.json").read_text()).get("quantization_config")
    return cfg if cfg is not None else json.loads((root / "hf_quant_config.json").read_text())
