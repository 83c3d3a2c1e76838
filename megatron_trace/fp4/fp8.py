"""FP8 E4M3 with one fp32 scale per row: the KV-cache format for K when K has outlier channels.

A row is the last `dims` dimensions. The KV cache uses dims=2: one scale per token over all its
KV heads ([heads, head_dim]) of a layer. Measured on Qwen2.5-Coder-0.5B (12 chat prompts, 522
tokens, docs/quality.md) that beats one scale per (token, head): FP8 K costs +0.0027 nats/token
instead of +0.0094. Under tensor parallelism (which splits KV heads) the row amax is a MAX over the
ranks' heads. Every step in fp32, as NVFP4's tensor scale:

    amax  = max |x| over the row (NaN ignored)
    S_enc = min(448 / amax, FLT_MAX)              (1 when amax is 0 or Inf, or S_enc is 0)
    S_dec = fp32(1 / fp64(S_enc))                 stored fp32 (the decode direction, x = q * S_dec)
    q     = e4m3_rn_satfinite(x * S_enc)          stored byte (E4M3FN, signed; NaN -> 0x7F)
    x_hat = fp32(e4m3(q)) * S_dec

Stored size: 8 bits per element + 32 bits per row (8.125 bits per element for 2 KV heads of
head_dim 128 per TP rank; 8.25 for one).

TRACE guidance of an FP8 site (`guided_quantize`) is NVFP4's, one format up: the rollout records
S_enc per row and, per element, its E4M3 byte (full) or the byte's lowest bit (mantissa). E4M3FN
magnitudes are ordered by their 7-bit code, so adjacent codewords alternate that bit (across zero
too: -min, 0, +min have bits 1, 0, 1) and one bit picks between the two codewords that bracket the
trainer's scaled value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import E4M3_MAX, FLT_MAX, as_float32, e4m3_decode, e4m3_encode
from .guided import unpack_mantissa_bits
from .nvfp4 import nan_free_amax

_MAX_INDEX = 0x7E  # 448, the largest finite E4M3FN magnitude code
_NAN = 0x7F


@dataclass
class FP8Tensor:
    data: torch.Tensor  # uint8 E4M3FN bytes [..., *row]
    scale: torch.Tensor  # fp32 S_dec [...], one per row
    encode: torch.Tensor | None = None  # fp32 S_enc [...] it was quantized with (what guidance records)

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


def quantize(x: torch.Tensor, dims: int = 1, amax: torch.Tensor | None = None) -> FP8Tensor:
    """x [..., *row] (row = the last `dims` dims) -> E4M3 codes shaped like x and S_dec [...].
    `amax` [...] overrides the row amax (a MAX over tensor-parallel ranks' slices of the row)."""
    x = as_float32(x)
    if dims < 1 or x.dim() < dims:
        raise ValueError(
            f"fp8 row quantization over the last {dims} dim(s) needs at least that many; got a {x.dim()}-d tensor"
        )
    if amax is None:
        amax = nan_free_amax(x.reshape(*x.shape[: x.dim() - dims], -1), dim=-1)
    s_enc = encode_scale(amax)
    return FP8Tensor(e4m3_encode(x * _per_row(s_enc, x.dim())), decode_scale(s_enc), s_enc)


def _per_row(s: torch.Tensor, ndim: int) -> torch.Tensor:
    return s.reshape(*s.shape, *([1] * (ndim - s.dim())))


def dequantize(q: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32(e4m3(q)) * S_dec, rounded once to dtype."""
    return (e4m3_decode(q.data) * _per_row(q.scale.to(torch.float32), q.data.dim())).to(dtype)


def quantize_dequantize(
    x: torch.Tensor, dtype: torch.dtype | None = None, dims: int = 1, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize(quantize(x, dims, amax)) in x's dtype (or `dtype`)."""
    return dequantize(quantize(x, dims, amax), dtype or x.dtype)


# How far (on the +-448 scale, i.e. after S_enc) full guidance may move an element to the rollout's
# codeword: half the E4M3 step at the top of the scale, the error round-to-nearest already allows the
# row's largest element. Near zero E4M3 resolves far finer than a bf16 rollout and an fp32 trainer
# agree: their K differs by ~0.3% of the token's amax (a few units here), several codewords apart
# for small elements, so a one-codeword bracket would leave ~5% of a real Qwen's FP8 K unguided.
GUIDE_REACH = 16.0


def guided_quantize(
    x: torch.Tensor,
    s_enc: torch.Tensor,
    *,
    codes: torch.Tensor | None = None,
    mantissa: torch.Tensor | None = None,
) -> FP8Tensor:
    """Quantize x [..., *row] with the rollout's per-row S_enc [...] (its row shape follows from
    s_enc's), rounding each element as the rollout did: z = x * S_enc, the quantizer's arithmetic,
    bracketed by the two adjacent E4M3 codewords lo <= z <= hi (clipped to +-448). Full guidance
    (`codes`, the rollout's bytes shaped like x) takes the rollout's byte when it is one of them (a z
    on a grid point brackets its two neighbours) or lies within GUIDE_REACH of z, else the bracket
    nearer it; mantissa guidance (`mantissa`, the bytes' lowest bits packed 8 per byte along the last dim)
    keeps the bracket whose lowest bit matches. NaN stays NaN (0x7F)."""
    x = as_float32(x)
    if (codes is None) == (mantissa is None):
        raise ValueError("guided FP8 rounding needs exactly one of codes= (full) or mantissa= (1 bit per element)")
    s_enc = torch.as_tensor(s_enc, dtype=torch.float32, device=x.device)
    if x.dim() < s_enc.dim() + 1 or tuple(x.shape[: s_enc.dim()]) != tuple(s_enc.shape):
        raise ValueError(f"S_enc {tuple(s_enc.shape)} must be one per row of x {tuple(x.shape)}")
    want = tuple(x.shape) if codes is not None else (*x.shape[:-1], x.shape[-1] // 8)
    got = codes if codes is not None else mantissa
    if got.dtype != torch.uint8 or tuple(got.shape) != want or (mantissa is not None and x.shape[-1] % 8):
        raise ValueError(
            f"FP8 guidance {'codes' if codes is not None else 'mantissa'} must be uint8 {want}; "
            f"got {got.dtype} {tuple(got.shape)}"
        )
    z = x * _per_row(s_enc, x.dim())
    zc = z.clamp(-E4M3_MAX, E4M3_MAX)
    rtn = e4m3_encode(zc)
    v = e4m3_decode(rtn)
    idx = _signed_index(rtn)
    lo = torch.where(v > zc, idx - 1, idx).clamp(-_MAX_INDEX, _MAX_INDEX)
    hi = torch.where(v < zc, idx + 1, idx).clamp(-_MAX_INDEX, _MAX_INDEX)
    negative = torch.signbit(z)
    if codes is not None:
        r = _signed_index(codes)
        on_grid = (v == zc) & (z.abs() <= E4M3_MAX)  # on a grid point: one codeword either side still counts
        lo = torch.where(on_grid, (lo - 1).clamp_min(-_MAX_INDEX), lo)
        hi = torch.where(on_grid, (hi + 1).clamp_max(_MAX_INDEX), hi)
        pick = torch.maximum(torch.minimum(r, hi), lo)
        near = (e4m3_decode(codes) - zc).abs() <= GUIDE_REACH
        out = torch.where((pick == r) | near, codes, _codes_from_index(pick, negative))
    else:
        bit = unpack_mantissa_bits(mantissa).to(torch.int16)
        pick = torch.where((hi.abs() & 1) == bit, hi, lo)
        out = _codes_from_index(pick, negative)
    out = torch.where(torch.isnan(z), torch.full_like(out, _NAN), out)
    return FP8Tensor(out, decode_scale(s_enc), s_enc)


def _signed_index(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes -> position on the signed grid, -126..126 (both zeros 0); neighbours differ by 1."""
    mag = (codes & 0x7F).to(torch.int16)
    return torch.where((codes & 0x80) != 0, -mag, mag)


def _codes_from_index(idx: torch.Tensor, negative_zero: torch.Tensor) -> torch.Tensor:
    neg = (idx < 0) | ((idx == 0) & negative_zero)
    return idx.abs().to(torch.uint8) | (neg.to(torch.uint8) << 7)
