"""One KV-cache side's codec: format -> quantize / rebuild from storage / dequantize.

The embedded engine's pages (`sglang_backend/local/kv_cache.py`), the SGLang plugin's per-side pool
(`sglang_backend/plugin/kv_sides.py`) and the trainer's QAT (`trainer/qat.py`) all call this, so the
bits a rollout caches and the bits the trainer rounds to come from one place; each caller keeps only
its storage layout. Per side, rows x [T, heads, head_dim]:

    nvfp4  16-blocks along head_dim, E4M3 block scales, one per-layer fp32 S_enc (`nvfp4_scale`)
    mxfp4  16-blocks along head_dim, E8M0 block scales (fp4.mxfp4.KV_RULE)
    fp8    E4M3 elements, one fp32 scale per token over its heads; `all_max` MAX-reduces the token's
           amax over the ranks that split the heads (TP), so every rank quantizes with the same scale
    bf16   not quantized (callers store the values as they are)
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_trace.fp4 import dequantize_any, fp8, mxfp4, nvfp4

from .dispatch import nvfp4_quantize_dequantize

# The one list of KV-cache formats (the policy's quant.kv / kv_k / kv_v, the plugin's per-side pool,
# the launcher's flags and the quality tools read it from here), widest first.
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
QUANTIZED = FORMATS[1:]
KVTensor = nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor | fp8.FP8Tensor


def quantize(
    fmt: str,
    x: torch.Tensor,
    *,
    nvfp4_scale: torch.Tensor | float | None = None,
    all_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> KVTensor:
    """x [T, heads, head_dim] in `fmt` (C on CPU and Triton on CUDA for NVFP4, kernels.dispatch)."""
    if fmt == "nvfp4":
        if nvfp4_scale is None:
            raise ValueError("an NVFP4 KV side needs its per-layer S_enc (nvfp4_scale)")
        return nvfp4_quantize_dequantize(x, global_scale=torch.as_tensor(nvfp4_scale, dtype=torch.float32))[0]
    if fmt == "mxfp4":
        return mxfp4.quantize(x, rule=mxfp4.KV_RULE, block=mxfp4.KV_BLOCK)
    if fmt == "fp8":
        if all_max is None:
            return fp8.quantize(x, dims=2)
        amax = nvfp4.nan_free_amax(x.float().reshape(x.shape[0], -1), dim=-1)  # fp8.quantize's row amax
        return fp8.quantize(x, dims=2, amax=all_max(amax))
    raise ValueError(f"KV side format must be one of {', '.join(QUANTIZED)} to quantize; got {fmt!r}")


def stored(fmt: str, data: torch.Tensor, scale: torch.Tensor, nvfp4_scale: torch.Tensor | None = None) -> KVTensor:
    """The tensor of rows as stored: codes `data`, block scales (bytes) or FP8's fp32 per-token
    scale `scale`, and NVFP4's per-layer S_enc."""
    if fmt == "nvfp4":
        return nvfp4.NVFP4Tensor(data, scale, nvfp4_scale)
    if fmt == "mxfp4":
        return mxfp4.MXFP4Tensor(data, scale, mxfp4.KV_BLOCK)
    if fmt == "fp8":
        return fp8.FP8Tensor(data, scale)
    raise ValueError(f"KV side format must be one of {', '.join(QUANTIZED)} to dequantize; got {fmt!r}")


dequantize = dequantize_any  # KVTensor, dtype -> values
