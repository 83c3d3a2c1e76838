"""SGLang-style quantization flags (`--quantization`, `--kv-cache-dtype`) -> the project's QuantPolicy.

The embedded engine takes SGLang's flag names; this is the one place that reads them (and an exported
checkpoint's hf_quant_config.json) into a policy. The launcher asks it too, to hand SGLang's plugin
the same policy the engine would use.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_trace.models import QuantPolicy

QUANTIZATIONS = (None, "nvfp4", "w4a16_nvfp4", "mxfp4", "w4a16_mxfp4", "modelopt_fp4")


def policy_for(quantization: str | None, kv_cache_dtype: str, model_path: Path) -> QuantPolicy:
    """SGLang-style flags -> our QuantPolicy (an explicit quant_policy overrides this)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {quantization!r}")
    kv = {"auto": "bf16", "bf16": "bf16", "nvfp4": "nvfp4", "mxfp4": "mxfp4", "fp8": "fp8", "fp8_e4m3": "fp8"}.get(
        kv_cache_dtype
    )
    if kv is None:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, bf16, nvfp4, mxfp4, fp8, fp8_e4m3; got {kv_cache_dtype!r}"
        )
    if quantization is None and (model_path / "hf_quant_config.json").exists():
        quantization = "modelopt_fp4"
    if quantization is None:
        return QuantPolicy(format="bf16", weights="bf16", activations="bf16", kv=kv)
    fmt = "mxfp4" if "mxfp4" in quantization else "nvfp4"
    acts = "bf16" if quantization.startswith("w4a16") else "fp4"
    return QuantPolicy(format=fmt, weights="fp4", activations=acts, kv=kv, targets=_checkpoint_targets(model_path))


def _checkpoint_targets(model_path: Path):
    """An exported NVFP4 checkpoint names what it quantized; otherwise the policy's defaults."""
    f = model_path / "hf_quant_config.json"
    if f.exists():
        targets = json.loads(f.read_text()).get("quantization", {}).get("trace_targets")
        if targets:
            return tuple(targets)
    return QuantPolicy().targets


def check_kv_bands(p: QuantPolicy) -> None:
    """The trainer keeps a BF16 layer band's K/V in BF16 (QuantPolicy.kv_format); this cache holds one
    format for every layer, so serving the band quantized would be a silent train/rollout mismatch."""
    if (p.bf16_layers_start or p.bf16_layers_end) and (p.k_format, p.v_format) != ("bf16", "bf16"):
        raise ValueError(
            f"quant.bf16_layers_start={p.bf16_layers_start} / bf16_layers_end={p.bf16_layers_end} keep those "
            f"layers' K/V in BF16, but the embedded engine's paged KV cache holds one format for every layer "
            f"(K {p.k_format}, V {p.v_format}): set quant.kv=bf16 with the bands, or drop the bands"
        )
