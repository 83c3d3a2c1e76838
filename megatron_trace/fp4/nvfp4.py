"""NVFP4: 16-element blocks along the last dim, E4M3 block scale, fp32 tensor (or row) scale.

Transformer Engine's kernel sequence, every step in fp32 (this is the reference the rollout
engine, the trainer's QAT, the Triton kernel and the exporter all reproduce):

    S_enc = min(448*6 / amax, FLT_MAX)            (1 when amax is 0 or S_enc underflows)
    S_dec = fp32(1 / fp64(S_enc))
    SF    = e4m3(amax_block * (S_enc * fp32(1/6)))  stored byte
    enc   = min(1 / (SF * S_dec), FLT_MAX)
    q     = e2m1(x * enc)                         stored nibble
    x_hat = e2m1(q) * SF * S_dec

NaN elements encode as 0x7 (hardware rule) and are ignored by amax, as fmaxf ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import (
    E2M1_MAX,
    E4M3_MAX,
    FLT_MAX,
    as_float32,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    pack_fp4,
    unpack_fp4,
)

BLOCK = 16
_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), as TE writes it


@dataclass
class NVFP4Tensor:
    data: torch.Tensor  # uint8 [..., K/2], element 2i in the low nibble
    scale: torch.Tensor  # uint8 E4M3 bytes [..., K/16], linear layout
    global_scale: torch.Tensor  # fp32 S_enc: 0-d, or [...] (one per row) with per-row scaling

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    def codes(self) -> torch.Tensor:
        return unpack_fp4(self.data)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.global_scale))


def check_blocks(x: torch.Tensor, block: int, fmt: str) -> None:
    if x.dim() == 0:
        raise ValueError(f"{fmt} quantizes along the last dimension; got a 0-d tensor")
    k = x.shape[-1]
    if k % block:
        raise ValueError(
            f"{fmt} blocks are {block} elements along the last dimension: K={k} is not a multiple "
            f"of {block} (pad K, or keep this tensor in BF16)"
        )


def nan_free_amax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| ignoring NaN; 0 for empty reductions."""
    a = x.abs()
    if dim is None:
        if not a.numel():
            return torch.zeros((), dtype=torch.float32, device=x.device)
    elif a.shape[dim] == 0:
        shape = list(a.shape)
        del shape[dim]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    m = a.amax() if dim is None else a.amax(dim=dim)
    if torch.isnan(m).any():  # amax propagates NaN; rare, so clean tensors skip a NaN pass over x
        m = torch.where(torch.isnan(a), torch.zeros_like(a), a)
        m = m.amax() if dim is None else m.amax(dim=dim)
    return m


def encode_scale_from_amax(amax: torch.Tensor, fp4_max: float = E2M1_MAX) -> torch.Tensor:
    """S_enc = min(448*fp4_max / amax, FLT_MAX), 1 where amax is 0 or the result is 0 (or NaN)."""
    amax = as_float32(amax, "amax")
    s = torch.clamp_max(torch.tensor(E4M3_MAX * fp4_max, dtype=torch.float32) / amax, FLT_MAX)
    return torch.where((amax == 0) | (s == 0) | torch.isnan(s), torch.ones_like(s), s)


def per_token_global_scale(x: torch.Tensor, all_max=None) -> torch.Tensor:
    """The per-token (dynamic) activation S_enc, one per row of x [..., K]: encode_scale_from_amax
    of the row's amax over the FULL row. The one definition the trainer's QAT, the embedded engine
    and the SGLang plugin use. A row split over TP ranks (the input of a row-parallel o_proj /
    down_proj) passes `all_max`, a function returning the elementwise max of a tensor over the
    ranks holding the row (an all-reduce MAX over the layer's TP group), so every shard quantizes
    with the full-row value, exactly as at TP=1."""
    amax = nan_free_amax(x, dim=-1).to(torch.float32)
    if all_max is not None:
        amax = all_max(amax)
    return encode_scale_from_amax(amax)


def decode_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """S_dec = fp32(1 / fp64(S_enc))."""
    return (1.0 / global_scale.to(torch.float64)).to(torch.float32)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _row_scale(s: torch.Tensor, ndim: int) -> torch.Tensor:
    """Broadcast a 0-d or per-row scale against [..., nblocks, 16] blocks."""
    return s if s.dim() == 0 else s.reshape(*s.shape, 1, 1)


def encode_with_scales(x: torch.Tensor, sf: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """z = x * enc for given block-scale bytes and S_enc; the value that is rounded to E2M1."""
    s_dec = _row_scale(decode_scale(global_scale), x.dim())
    enc = torch.clamp_max(1.0 / (e4m3_decode(sf).unsqueeze(-1) * s_dec), FLT_MAX)
    return _blocks(x) * enc


def _scales_for_blocks(xb: torch.Tensor, s_enc: torch.Tensor, fp4_max: float) -> torch.Tensor:
    amax_block = nan_free_amax(xb, dim=-1)
    s = s_enc if s_enc.dim() == 0 else s_enc.unsqueeze(-1)
    inv_max = _ONE_SIXTH if fp4_max == E2M1_MAX else 1.0 / fp4_max  # 1/4 is exact
    return e4m3_encode(amax_block * (s * inv_max))


def _resolve_global_scale(x, global_amax, per_row_global, fp4_max=E2M1_MAX, global_scale=None) -> torch.Tensor:
    if global_scale is not None:
        if global_amax is not None:
            raise ValueError("pass global_amax or global_scale, not both")
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if gs.dim() and tuple(gs.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"global_scale must be 0-d or one per row {tuple(x.shape[:-1])}; got {tuple(gs.shape)}")
        if not bool(torch.all(torch.isfinite(gs) & (gs > 0))):
            raise ValueError("global_scale (S_enc) must be finite and > 0")
        return gs
    if global_amax is not None:
        amax = torch.as_tensor(global_amax, dtype=torch.float32, device=x.device)
        expected = () if not per_row_global else tuple(x.shape[:-1])
        if tuple(amax.shape) != expected:
            raise ValueError(
                f"global_amax must have shape {expected} "
                f"({'one per row' if per_row_global else 'a scalar'}), got {tuple(amax.shape)}"
            )
    elif per_row_global and fp4_max == E2M1_MAX:
        return per_token_global_scale(x)
    else:
        amax = nan_free_amax(x, dim=-1) if per_row_global else nan_free_amax(x)
    return encode_scale_from_amax(amax, fp4_max)


def quantize(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    four_over_six: bool = False,
    global_scale: torch.Tensor | float | None = None,
) -> NVFP4Tensor:
    """Quantize along the last dim to NVFP4.

    global_amax: the amax that sets S_enc (fused shards and static activation scales pass a
    shared one); by default the tensor's own amax, or each row's with `per_row_global` (dynamic
    per-token activation scaling).
    global_scale: S_enc itself (a static activation scale, or one recorded by the rollout).
    four_over_six: per block, also try mapping the block amax to 4 instead of 6 and keep the
    lower squared error (S_enc then maps the tensor amax to 448*4 so both choices fit E4M3);
    the result is standard NVFP4 and dequantizes with the same formula.
    """
    x = as_float32(x)
    check_blocks(x, BLOCK, "NVFP4")
    if four_over_six:
        if global_scale is not None:
            raise ValueError("four_over_six derives its own global scale; pass global_amax instead")
        return _quantize_four_over_six(x, global_amax, per_row_global)
    s_enc = _resolve_global_scale(x, global_amax, per_row_global, global_scale=global_scale)
    sf = _scales_for_blocks(_blocks(x), s_enc, E2M1_MAX)
    codes = e2m1_encode(encode_with_scales(x, sf, s_enc)).reshape(x.shape)
    return NVFP4Tensor(pack_fp4(codes), sf, s_enc)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(q.data))
    vals = _blocks(vals) * e4m3_decode(q.scale).unsqueeze(-1)
    vals = vals * _row_scale(decode_scale(q.global_scale), vals.dim())
    return vals.reshape(q.shape).to(dtype)


def _quantize_four_over_six(x, global_amax, per_row_global) -> NVFP4Tensor:
    s_enc = _resolve_global_scale(x, global_amax, per_row_global, fp4_max=4.0)
    xb = _blocks(x)
    candidates = []
    for fp4_max in (E2M1_MAX, 4.0):
        sf = _scales_for_blocks(xb, s_enc, fp4_max)
        codes = e2m1_encode(encode_with_scales(x, sf, s_enc))
        q = NVFP4Tensor(pack_fp4(codes.reshape(x.shape)), sf, s_enc)
        err = (_blocks(dequantize(q)) - xb).pow(2).nan_to_num(nan=0.0).sum(-1)
        candidates.append((sf, codes, err))
    (sf6, c6, e6), (sf4, c4, e4) = candidates
    use4 = e4 < e6  # ties keep the standard amax->6 scale
    sf = torch.where(use4, sf4, sf6)
    codes = torch.where(use4.unsqueeze(-1), c4, c6).reshape(x.shape)
    return NVFP4Tensor(pack_fp4(codes), sf, s_enc)
