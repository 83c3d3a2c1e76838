"""ModelOpt NVFP4 checkpoint tensors, the layout stock SGLang/vLLM load.

    weight          uint8 [N, K/2]              packed codes, low nibble first
    weight_scale    float8_e4m3fn [N, K/16]     block scales, linear layout
    weight_scale_2  fp32 scalar                 decode-direction global scale (S_dec)
    input_scale     fp32 scalar                 decode-direction activation scale (static W4A4)

We write S_dec exactly as the quantizer's dequantization uses it (fp32(1/fp64(S_enc))), so a
loader computing code * weight_scale * weight_scale_2 gets the trainer's values bit for bit.
Loaders take max() of weight_scale_2 / input_scale across fused shards (q/k/v, gate/up), so
fused shards are quantized with one shared global amax.
"""

from __future__ import annotations

import torch

from .codecs import check_floating
from .nvfp4 import NVFP4Tensor, decode_scale, encode_scale_from_amax, nan_free_amax, quantize

_F32 = torch.float32


def input_scale_from_amax(input_amax: torch.Tensor | float) -> torch.Tensor:
    """Static activation scale in the checkpoint's decode direction."""
    return decode_scale(encode_scale_from_amax(torch.as_tensor(input_amax, dtype=_F32)))


def to_modelopt(
    weight: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    input_amax: torch.Tensor | float | None = None,
    quantizer=quantize,
) -> dict[str, torch.Tensor]:
    """Quantize one [N, K] weight into its ModelOpt tensors (input_scale only with input_amax).
    quantizer: `nvfp4.quantize` or a kernel of the same bits (kernels.dispatch.nvfp4_weight_quantize:
    the weight sync's), called as quantizer(weight, global_amax=...)."""
    check_floating(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"to_modelopt takes a 2-D [N, K] weight; got shape {tuple(weight.shape)}")
    q = quantizer(weight, global_amax=global_amax)
    out = {
        "weight": q.data,
        "weight_scale": q.scale.view(torch.float8_e4m3fn),
        "weight_scale_2": decode_scale(q.global_scale),
    }
    if input_amax is not None:
        out["input_scale"] = input_scale_from_amax(input_amax)
    return out


def to_modelopt_fused(
    weights: list[torch.Tensor], *, input_amax: torch.Tensor | float | None = None, quantizer=quantize
) -> list[dict[str, torch.Tensor]]:
    """Quantize fused shards (q/k/v or gate/up) with one shared global scale."""
    if not weights:
        raise ValueError("to_modelopt_fused needs at least one shard")
    shared = torch.stack([nan_free_amax(check_floating(w, "weight")) for w in weights]).amax()
    return [to_modelopt(w, global_amax=shared, input_amax=input_amax, quantizer=quantizer) for w in weights]


def encode_scale_from_decode(s_dec: torch.Tensor) -> torch.Tensor:
    """An S_enc whose fp32(1/fp64(S_enc)) equals s_dec exactly, when one exists.

    Our own exports always have one (they were computed from it); for an S_dec written by
    another tool the nearest candidate is returned.
    """
    s_dec = torch.as_tensor(s_dec, dtype=_F32)
    cand = (1.0 / s_dec.to(torch.float64)).to(_F32)
    best = cand
    for direction in (float("inf"), 0.0):
        probe = cand
        for _ in range(2):
            probe = torch.nextafter(probe, torch.full_like(probe, direction))
            hit = decode_scale(probe) == s_dec
            best = torch.where((decode_scale(best) != s_dec) & hit, probe, best)
    return best


def from_modelopt(tensors: dict[str, torch.Tensor]) -> NVFP4Tensor:
    """ModelOpt tensors of one linear -> NVFP4Tensor (weight_scale_2 back to S_enc)."""
    for key in ("weight", "weight_scale", "weight_scale_2"):
        if key not in tensors:
            raise KeyError(f"ModelOpt NVFP4 tensors need {key!r}; got {sorted(tensors)}")
    data, scale = tensors["weight"], tensors["weight_scale"]
    if data.dtype != torch.uint8:
        raise TypeError(f"ModelOpt 'weight' must be uint8 packed FP4; got {data.dtype}")
    if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"ModelOpt 'weight_scale' must be float8_e4m3fn; got {scale.dtype}")
    if data.shape[-1] * 2 != scale.shape[-1] * 16 or data.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"weight {tuple(data.shape)} and weight_scale {tuple(scale.shape)} disagree: "
            "expected weight [N, K/2] with weight_scale [N, K/16]"
        )
    s_enc = encode_scale_from_decode(tensors["weight_scale_2"].to(_F32).reshape(()))
    return NVFP4Tensor(data, scale.view(torch.uint8), s_enc)
