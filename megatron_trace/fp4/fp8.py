"""FP8 E4M3 with one fp32 scale per row: the KV-cache format for K when K has outlier channels.

A row is the last dimension; for the KV cache that is one (token, KV head) vector of head_dim
elements, so the scale is TP-local (tensor parallelism splits whole KV heads) and a token's
outlier channel only coarsens its own row. Every step in fp32, as NVFP4's tensor scale:

    amax  = max |x| over the row (NaN ignored)
    S_enc = min(448 / amax, FLT_MAX)              (1 when amax is 0 or Inf, or S_enc is 0)
    S_dec = fp32(1 / fp64(S_enc))                 stored fp32 (the decode direction, x = q * S_dec)
    q     = e4m3_rn_satfinite(x * S_enc)          stored byte (E4M3FN, signed; NaN -> 0x7F)
    x_hat = fp32(e4m3(q)) * S_dec

Stored size: 8 bits per element + 32 bits per row (8.25 bits per element at head_dim 128,
8.5 at head_dim 64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import E4M3_MAX, FLT_MAX, as_float32, e4m3_decode, e4m3_encode
from .nvfp4 import nan_free_amax


@dataclass
class FP8Tensor:
    data: torch.Tensor  # uint8 E4M3FN bytes [..., K]
    scale: torch.Tensor  # fp32 S_dec [...], one per row

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()


def encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-row S_enc = 448 / amax (fp32), 1 where that is not a finite positive number."""
    amax = as_float32(amax, "amax")
    s = torch.clamp(torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax, max=FLT_MAX)
    bad = (amax == 0) | torch.isinf(amax) | (s == 0) | torch.isnan(s)
    return torch.where(bad, torch.ones_like(s), s)


def decode_scale(s_enc: torch.Tensor) -> torch.Tensor:
    """fp32(1 / fp64(S_enc)): the stored decode-direction scale."""
    return (1.0 / s_enc.to(torch.float64)).to(torch.float32)


def quantize(x: torch.Tensor) -> FP8Tensor:
    """x [..., K] -> E4M3 codes [..., K] and S_dec [...] (one scale per row along the last dim)."""
    x = as_float32(x)
    if x.dim() == 0:
        raise ValueError("fp8 row quantization needs at least one dimension; got a 0-d tensor")
    s_enc = encode_scale(nan_free_amax(x, dim=-1))
    return FP8Tensor(e4m3_encode(x * s_enc.unsqueeze(-1)), decode_scale(s_enc))


def dequantize(q: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32(e4m3(q)) * S_dec, rounded once to dtype."""
    return (e4m3_decode(q.data) * q.scale.to(torch.float32).unsqueeze(-1)).to(dtype)


def quantize_dequantize(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype (or `dtype`)."""
    return dequantize(quantize(x), dtype or x.dtype)
