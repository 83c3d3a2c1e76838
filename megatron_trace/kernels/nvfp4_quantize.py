"""Triton NVFP4 quantization, bit-identical with `megatron_trace.fp4.nvfp4.quantize`, and the
same pass fused with TRACE guidance capture (one kernel, `MANTISSA` a compile-time option).

One program owns BLOCK_M rows x BLOCK_K columns (BLOCK_K/16 scale blocks). Each scale block is
loaded as its 8 even and 8 odd elements ([BLOCK_M, NB, 8] twice), so the two nibbles of every
output byte sit at the same index and no split/join or reshape is needed.

Guidance (`quantize_with_guidance_triton`): mode "full" is the packed codes themselves (no extra
store); mode "mantissa" also writes the codes' mantissa bits packed 8 per byte, element 8i+j at
bit j of byte i, exactly `megatron_trace.fp4.mantissa_bits(unpack_fp4(q.data))`. Pair p of a
block carries elements 2p and 2p+1, so mantissa byte 2*blk collects pairs 0-3 and byte 2*blk+1
pairs 4-7: two masked sums along the pair axis.

Guided rounding (`guided_quantize_triton`, TRACE's trainer side): the same kernel loads the
rollout's block-scale bytes instead of computing them, scales x with them exactly as the
quantizer does, and picks each code from the rollout's codes (full) or mantissa bits, bit for
bit `megatron_trace.fp4.guided_quantize`. Exactness rules: megatron_trace/kernels/triton_fp4_codecs.py.

Importing this module imports triton; callers go through `megatron_trace.kernels.dispatch`, which imports it
lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.guided import GUIDANCE_MODES, check_guidance

from .triton_fp4_codecs import (
    FLT_MAX,
    ONE_SIXTH,
    SENC_NUM,
    _clean_abs,
    _e2m1_rn_satfinite,
    _e4m3_decode,
    _e4m3_rn_satfinite,
    _guided_e2m1,
)
from .triton_fp4_codecs import (
    INTERPRETED as INTERPRETED,  # the dispatcher's runnability check reads it from this module
)

# Host-side scale modes: one S_enc for the tensor, one per row given by the caller, or one per
# row computed from the row's own amax inside the kernel.
_SCALAR, _PER_ROW, _FUSED_ROW = 0, 1, 2
# How codes are chosen: round to nearest with the kernel's own block scales, or pinned to the
# rollout's codes / mantissa bits with the rollout's block scales (TRACE guided rounding).
_RTN, _GUIDED_FULL, _GUIDED_MANTISSA = 0, 1, 2


@triton.jit
def _row_encode_scales(
    x_row,
    senc_ptr,
    sdec_ptr,
    senc_out_ptr,
    rows64,
    row_ok,
    blk,
    pair,
    k_first,
    K,
    k_tiles_per_prog,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """S_enc and S_dec of each row: fused from the row's amax (MODE 2), given per row (1) or per
    tensor (0)."""
    if MODE == 2:
        # Fused per-row S_enc: a first pass over the row for its amax (NaN ignored); the second
        # pass below re-reads the row, mostly from L2.
        row_amax = tl.zeros([BLOCK_M, 1, 1], dtype=tl.float32)
        for t in range(0, k_tiles_per_prog):
            col = k_first + t * BLOCK_K + blk * 16 + 2 * pair
            ok = row_ok & (col < K)
            xe = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
            xo = tl.load(x_row + col + 1, mask=ok, other=0.0).to(tl.float32)
            a = tl.maximum(_clean_abs(xe), _clean_abs(xo))  # NaN-free, so max is safe
            a = tl.max(tl.max(a, axis=2, keep_dims=True), axis=1, keep_dims=True)
            row_amax = tl.maximum(row_amax, a)
        s = tl.math.div_rn(tl.full([BLOCK_M, 1, 1], SENC_NUM, tl.float32), row_amax)
        s = tl.where(s > FLT_MAX, FLT_MAX, s)
        s_enc = tl.where((row_amax == 0.0) | (s == 0.0) | (s != s), 1.0, s)
        s_dec = (1.0 / s_enc.to(tl.float64)).to(tl.float32)  # fp64 `/` is IEEE in Triton
        tl.store(senc_out_ptr + rows64, s_enc, mask=row_ok)
    elif MODE == 1:
        s_enc = tl.load(senc_ptr + rows64, mask=row_ok, other=1.0)
        s_dec = tl.load(sdec_ptr + rows64, mask=row_ok, other=1.0)
    else:
        s_enc = tl.load(senc_ptr)
        s_dec = tl.load(sdec_ptr)
    return s_enc, s_dec


@triton.jit
def _nvfp4_quantize_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    mant_ptr,
    ref_ptr,
    senc_ptr,
    sdec_ptr,
    senc_out_ptr,
    M,
    K,
    stride_xm,
    k_tiles_per_prog,
    MODE: tl.constexpr,
    GUIDE: tl.constexpr,
    MANTISSA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GUIDE _RTN: codes and block scales from x (scale_ptr written); _GUIDED_FULL/_MANTISSA:
    scale_ptr holds the rollout's block scales (read) and ref_ptr its packed codes / mant_ptr its
    packed mantissa bits (read). MANTISSA (RTN only): also write the codes' mantissa bits."""
    NB: tl.constexpr = BLOCK_K // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None, None]  # [BM, 1, 1]
    row_ok = rows < M
    rows64 = rows.to(tl.int64)  # M*K may exceed 2^31
    blk = tl.arange(0, NB)[None, :, None]  # [1, NB, 1]
    pair = tl.arange(0, 8)[None, None, :]  # [1, 1, 8]
    x_row = x_ptr + rows64 * stride_xm
    k_first = pid_k * k_tiles_per_prog * BLOCK_K

    s_enc, s_dec = _row_encode_scales(
        x_row,
        senc_ptr,
        sdec_ptr,
        senc_out_ptr,
        rows64,
        row_ok,
        blk,
        pair,
        k_first,
        K,
        k_tiles_per_prog,
        MODE,
        BLOCK_M,
        BLOCK_K,
    )
    s6 = s_enc * ONE_SIXTH

    half_k = K // 2
    n_blocks = K // 16
    # Bit position of each pair's even element inside its mantissa byte (odd: +1).
    shift = (2 * pair) % 8
    first_half = pair < 4
    for t in range(0, k_tiles_per_prog):
        k0 = k_first + t * BLOCK_K
        col = k0 + blk * 16 + 2 * pair  # [1, NB, 8]
        ok = row_ok & (col < K)  # K % 16 == 0: a block is wholly in or out
        xe = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        xo = tl.load(x_row + col + 1, mask=ok, other=0.0).to(tl.float32)
        blk_idx = k0 // 16 + blk
        blk_ok = row_ok & (blk_idx < n_blocks)
        byte_at = rows64 * half_k + (k0 // 2 + blk * 8 + pair)
        mrow = mant_ptr + rows64 * (K // 8) + 2 * blk_idx
        if GUIDE == 0:
            amax_b = tl.maximum(
                tl.max(_clean_abs(xe), axis=2, keep_dims=True),
                tl.max(_clean_abs(xo), axis=2, keep_dims=True),
            )  # [BM, NB, 1]
            sf = _e4m3_rn_satfinite(amax_b * s6)
        else:
            sf = tl.load(scale_ptr + rows64 * n_blocks + blk_idx, mask=blk_ok, other=0).to(tl.int32)
        d = _e4m3_decode(sf) * s_dec
        enc = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)  # keeps NaN and -Inf, as clamp_max does
        if GUIDE == 0:
            qe = _e2m1_rn_satfinite(xe * enc)
            qo = _e2m1_rn_satfinite(xo * enc)
            tl.store(scale_ptr + rows64 * n_blocks + blk_idx, sf.to(tl.uint8), mask=blk_ok)
        elif GUIDE == 1:
            ref = tl.load(ref_ptr + byte_at, mask=ok, other=0).to(tl.int32)
            qe = _guided_e2m1(xe * enc, ref & 15, 0, True)
            qo = _guided_e2m1(xo * enc, ref >> 4, 0, True)
        else:
            mbyte = tl.load(mrow + (pair >= 4).to(tl.int32), mask=ok, other=0).to(tl.int32)
            qe = _guided_e2m1(xe * enc, 0, (mbyte >> shift) & 1, False)
            qo = _guided_e2m1(xo * enc, 0, (mbyte >> (shift + 1)) & 1, False)
        tl.store(data_ptr + byte_at, (qe | (qo << 4)).to(tl.uint8), mask=ok)
        if MANTISSA:
            bits = ((qe & 1) << shift) | ((qo & 1) << (shift + 1))  # [BM, NB, 8], disjoint bits
            lo = tl.sum(tl.where(first_half, bits, 0), axis=2, keep_dims=True)
            hi = tl.sum(tl.where(first_half, 0, bits), axis=2, keep_dims=True)
            tl.store(mrow, lo.to(tl.uint8), mask=blk_ok)
            tl.store(mrow + 1, hi.to(tl.uint8), mask=blk_ok)


def _tensor_amax(x2: torch.Tensor) -> torch.Tensor:
    """The reference's NaN-ignoring amax, taken in x's own dtype (bf16/fp16 -> fp32 is exact,
    so no fp32 copy of x is needed)."""
    return nvfp4.nan_free_amax(x2).to(torch.float32)


def _launch_shape(m: int, k: int, fused: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, k_programs, k_tiles_per_prog)."""
    block_k = min(256, triton.next_power_of_2(k))
    k_tiles = triton.cdiv(k, block_k)
    if fused:
        # The row amax needs the whole row in one program; small BLOCK_M keeps enough
        # programs for decode-sized batches.
        return (1 if m < 1024 else 4), block_k, 1, k_tiles
    return 16, block_k, k_tiles, 1


def quantize_triton(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    global_scale: torch.Tensor | float | None = None,
) -> nvfp4.NVFP4Tensor:
    """NVFP4-quantize x along its last dim with the Triton kernel.

    Same contract and bits as `megatron_trace.fp4.nvfp4.quantize` (without four_over_six).
    x must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before triton was imported.
    """
    return _quantize(x, global_amax, per_row_global, global_scale, mantissa=False)[0]


def quantize_with_guidance_triton(
    x: torch.Tensor,
    *,
    mode: str = "full",
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    global_scale: torch.Tensor | float | None = None,
) -> tuple[nvfp4.NVFP4Tensor, torch.Tensor]:
    """(NVFP4Tensor, guidance) for x; see `megatron_trace.kernels.dispatch.nvfp4_quantize_with_guidance`."""
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"guidance mode must be one of {GUIDANCE_MODES}; got {mode!r}")
    q, mant = _quantize(x, global_amax, per_row_global, global_scale, mantissa=mode == "mantissa")
    return q, (q.data if mant is None else mant)


def _quantize(x, global_amax, per_row_global: bool, global_scale, *, mantissa: bool):
    """(NVFP4Tensor, packed mantissa bits [..., K/8] or None) from one kernel launch."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        nvfp4.as_float32(x)  # raises the reference's TypeError
    nvfp4.check_blocks(x, nvfp4.BLOCK, "NVFP4")
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if x.numel() == 0:
        q = nvfp4.quantize(x, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)
        return q, (torch.empty(*lead, k // 8, dtype=torch.uint8, device=x.device) if mantissa else None)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # float64 etc.: the reference rounds to fp32 first, too
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    dev = x.device

    if global_scale is not None:
        s_enc = nvfp4._resolve_global_scale(x, global_amax, per_row_global, global_scale=global_scale)
        per_row_global = s_enc.dim() > 0
        s_enc = s_enc.reshape(-1) if per_row_global else s_enc
        s_enc = s_enc.to(torch.float32).contiguous()
        s_dec = nvfp4.decode_scale(s_enc).contiguous()
        mode = _PER_ROW if per_row_global else _SCALAR
    elif per_row_global and global_amax is None:
        mode = _FUSED_ROW
        s_enc = torch.empty(m, dtype=torch.float32, device=dev)
        s_dec = s_enc  # unused by the kernel in this mode
    else:
        if global_amax is not None:
            s_enc = nvfp4._resolve_global_scale(x, global_amax, per_row_global)
        else:
            s_enc = nvfp4.encode_scale_from_amax(_tensor_amax(x2))
        s_enc = s_enc.to(torch.float32).contiguous()
        s_dec = nvfp4.decode_scale(s_enc).contiguous()
        mode = _PER_ROW if per_row_global else _SCALAR

    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((m, k // 16), dtype=torch.uint8, device=dev)
    mant = torch.empty((m, k // 8), dtype=torch.uint8, device=dev) if mantissa else data  # data: never written
    block_m, block_k, k_progs, k_tiles = _launch_shape(m, k, mode == _FUSED_ROW)
    grid = (triton.cdiv(m, block_m), k_progs)
    _nvfp4_quantize_kernel[grid](
        x2,
        data,
        scale,
        mant,
        data,
        s_enc,
        s_dec,
        s_enc,
        m,
        k,
        x2.stride(0),
        k_tiles,
        MODE=mode,
        GUIDE=_RTN,
        MANTISSA=mantissa,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=4,
        enable_fp_fusion=False,
    )
    g = s_enc.reshape(lead) if per_row_global else s_enc.reshape(())
    q = nvfp4.NVFP4Tensor(data.reshape(*lead, k // 2), scale.reshape(*lead, k // 16), g)
    return q, (mant.reshape(*lead, k // 8) if mantissa else None)


def guided_quantize_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    codes: torch.Tensor | None = None,
    mantissa: torch.Tensor | None = None,
) -> nvfp4.NVFP4Tensor:
    """`megatron_trace.fp4.guided_quantize` (same arguments, checks and bits) in the kernel."""
    x = (
        x
        if isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        else nvfp4.as_float32(x)
    )
    nvfp4.check_blocks(x, nvfp4.BLOCK, "NVFP4")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    check_guidance(x, scale, gs, codes, mantissa)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if x.numel() == 0:
        from megatron_trace.fp4.guided import guided_quantize

        return guided_quantize(x, scale, gs, codes=codes, mantissa=mantissa)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    m = x2.shape[0]
    s_enc = (gs.reshape(-1) if gs.dim() else gs).contiguous()
    s_dec = nvfp4.decode_scale(s_enc).contiguous()
    full = codes is not None
    ref = (codes if full else mantissa).reshape(m, -1).contiguous()
    data = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    block_m, block_k, k_progs, k_tiles = _launch_shape(m, k, False)
    _nvfp4_quantize_kernel[(triton.cdiv(m, block_m), k_progs)](
        x2,
        data,
        scale.reshape(m, -1).contiguous(),
        ref,
        ref,
        s_enc,
        s_dec,
        s_enc,
        m,
        k,
        x2.stride(0),
        k_tiles,
        MODE=_PER_ROW if gs.dim() else _SCALAR,
        GUIDE=_GUIDED_FULL if full else _GUIDED_MANTISSA,
        MANTISSA=False,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return nvfp4.NVFP4Tensor(data.reshape(*lead, k // 2), scale, gs)
