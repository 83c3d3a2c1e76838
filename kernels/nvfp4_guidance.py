"""Triton NVFP4 quantization fused with TRACE guidance capture.

One pass over x produces the NVFP4 codes and E4M3 scales (bit-identical with
`megatron_trace.fp4.nvfp4.quantize`, the same integer-arithmetic E4M3/E2M1 rounding as
kernels/nvfp4_quantize.py, whose helpers it reuses) and the guidance the trainer needs:
* mode "full": the packed 4-bit codes themselves (4 bits/element; no extra store);
* mode "mantissa": the codes' mantissa bits packed 8 per byte (1 bit/element),
  element 8i+j at bit j of byte i, exactly `mantissa_bits(unpack_fp4(q.data))`.
A 16-element block is held as its 8 even and 8 odd elements ([BM, NB, 8] twice), so pair p of a
block carries elements 2p and 2p+1: mantissa byte 2*blk collects pairs 0-3 (bits 2p, 2p+1) and
byte 2*blk+1 pairs 4-7 (bits 2p-8, 2p-7), two masked sums along the pair axis.

Bandwidth: reading bf16 x (2 B/element) and writing 0.5625 B (+0.125 for mantissa) is all the
traffic; one program per (16 rows x 256 columns) tile gives M*K/4096 programs (thousands for a
rollout's activations) and the loads are two stride-2 halves of the same lines, so the kernel
should run near copy bandwidth (goal: >= 60% of measured copy). The fused per-row scale mode
reads each row twice (amax, then quantize; the second read mostly hits L2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_trace.fp4 import nvfp4

from .nvfp4_quantize import (
    FLT_MAX,
    INTERPRETED,  # noqa: F401  (re-exported for the dispatcher's runnability check)
    ONE_SIXTH,
    _clean_abs,
    _e2m1_rn_satfinite,
    _e4m3_decode,
    _e4m3_rn_satfinite,
    _FUSED_ROW,
    _launch_shape,
    _row_encode_scales,
    _PER_ROW,
    _SCALAR,
    _tensor_amax,
)

MODES = ("full", "mantissa")


@triton.jit
def _quantize_guidance_kernel(
    x_ptr, data_ptr, scale_ptr, mant_ptr, senc_ptr, sdec_ptr, senc_out_ptr,
    M, K, stride_xm, k_tiles_per_prog,
    MODE: tl.constexpr, MANTISSA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None, None]  # [BM, 1, 1]
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    blk = tl.arange(0, NB)[None, :, None]  # [1, NB, 1]
    pair = tl.arange(0, 8)[None, None, :]  # [1, 1, 8]
    x_row = x_ptr + rows64 * stride_xm
    k_first = pid_k * k_tiles_per_prog * BLOCK_K

    s_enc, s_dec = _row_encode_scales(x_row, senc_ptr, sdec_ptr, senc_out_ptr, rows64, row_ok, blk, pair,
                                      k_first, K, k_tiles_per_prog, MODE, BLOCK_M, BLOCK_K)
    s6 = s_enc * ONE_SIXTH

    half_k = K // 2
    n_blocks = K // 16
    # Bit position of each pair's even element inside its mantissa byte (odd: +1).
    shift = (2 * pair) % 8
    first_half = pair < 4
    for t in range(0, k_tiles_per_prog):
        k0 = k_first + t * BLOCK_K
        col = k0 + blk * 16 + 2 * pair
        ok = row_ok & (col < K)
        xe = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        xo = tl.load(x_row + col + 1, mask=ok, other=0.0).to(tl.float32)
        amax_b = tl.maximum(
            tl.max(_clean_abs(xe), axis=2, keep_dims=True),
            tl.max(_clean_abs(xo), axis=2, keep_dims=True),
        )
        sf = _e4m3_rn_satfinite(amax_b * s6)
        d = _e4m3_decode(sf) * s_dec
        enc = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
        qe = _e2m1_rn_satfinite(xe * enc)
        qo = _e2m1_rn_satfinite(xo * enc)
        tl.store(data_ptr + rows64 * half_k + (k0 // 2 + blk * 8 + pair), (qe | (qo << 4)).to(tl.uint8), mask=ok)
        blk_idx = k0 // 16 + blk
        blk_ok = row_ok & (blk_idx < n_blocks)
        tl.store(scale_ptr + rows64 * n_blocks + blk_idx, sf.to(tl.uint8), mask=blk_ok)
        if MANTISSA:
            bits = ((qe & 1) << shift) | ((qo & 1) << (shift + 1))  # [BM, NB, 8], disjoint bits
            lo = tl.sum(tl.where(first_half, bits, 0), axis=2, keep_dims=True)
            hi = tl.sum(tl.where(first_half, 0, bits), axis=2, keep_dims=True)
            mrow = mant_ptr + rows64 * (K // 8) + 2 * blk_idx
            tl.store(mrow, lo.to(tl.uint8), mask=blk_ok)
            tl.store(mrow + 1, hi.to(tl.uint8), mask=blk_ok)


def quantize_with_guidance_triton(
    x: torch.Tensor,
    *,
    mode: str = "full",
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    global_scale: torch.Tensor | float | None = None,
) -> tuple[nvfp4.NVFP4Tensor, torch.Tensor]:
    """(NVFP4Tensor, guidance) for x; see `kernels.dispatch.nvfp4_quantize_with_guidance`."""
    if mode not in MODES:
        raise ValueError(f"guidance mode must be one of {MODES}; got {mode!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        nvfp4.as_float32(x)  # raises the reference's TypeError
    nvfp4.check_blocks(x, nvfp4.BLOCK, "NVFP4")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if x.numel() == 0:
        q = nvfp4.quantize(x, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)
        return q, (q.data if mode == "full" else torch.empty(*lead, k // 8, dtype=torch.uint8, device=x.device))
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, dev = x2.shape[0], x.device

    if global_scale is not None:
        s_enc = nvfp4._resolve_global_scale(x, global_amax, per_row_global, global_scale=global_scale)
        per_row_global = s_enc.dim() > 0
        s_enc = (s_enc.reshape(-1) if per_row_global else s_enc).to(torch.float32).contiguous()
        s_dec = nvfp4.decode_scale(s_enc).contiguous()
        kmode = _PER_ROW if per_row_global else _SCALAR
    elif per_row_global and global_amax is None:
        kmode = _FUSED_ROW
        s_enc = torch.empty(m, dtype=torch.float32, device=dev)
        s_dec = s_enc
    else:
        if global_amax is not None:
            s_enc = nvfp4._resolve_global_scale(x, global_amax, per_row_global)
        else:
            s_enc = nvfp4.encode_scale_from_amax(_tensor_amax(x2))
        s_enc = s_enc.to(torch.float32).contiguous()
        s_dec = nvfp4.decode_scale(s_enc).contiguous()
        kmode = _PER_ROW if per_row_global else _SCALAR

    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
    mantissa = mode == "mantissa"
    mant = torch.empty((m, k // 8), dtype=torch.uint8, device=dev) if mantissa else data
    block_m, block_k, k_progs, k_tiles = _launch_shape(m, k, kmode == _FUSED_ROW)
    _quantize_guidance_kernel[(triton.cdiv(m, block_m), k_progs)](
        x2, data, scale, mant, s_enc, s_dec, s_enc,
        m, k, x2.stride(0), k_tiles,
        MODE=kmode, MANTISSA=mantissa, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=4, enable_fp_fusion=False,
    )
    g = s_enc.reshape(lead) if per_row_global else s_enc.reshape(())
    q = nvfp4.NVFP4Tensor(data.reshape(*lead, k // 2), scale.reshape(*lead, k // 16), g)
    return q, (q.data if not mantissa else mant.reshape(*lead, k // 8))
