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

Exactness notes (the reason for the unusual code below):
* Triton's fp32 `/` is approximate on GPUs, so every division uses `tl.math.div_rn`, or fp64
  where the reference itself divides in fp64 (S_dec).
* E4M3 and E2M1 rounding are written as integer bit arithmetic and float comparisons, which
  mean the same in the interpreter and on the GPU; `.to(tl.float8e4nv)` is not used.
* `tl.minimum`/`tl.maximum` differ on NaN between the interpreter and the GPU, so clamps that
  may see NaN are `tl.where` with explicit comparisons.
* Float contraction is disabled at launch so no multiply is fused into a later add.

Importing this module imports triton; callers go through `kernels.dispatch`, which imports it
lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.codecs import FLT_MAX as _FLT_MAX
from megatron_trace.fp4.guided import GUIDANCE_MODES

FLT_MAX: tl.constexpr = tl.constexpr(_FLT_MAX)
ONE_SIXTH: tl.constexpr = tl.constexpr(nvfp4._ONE_SIXTH)  # fp32(1/6), exactly as TE writes it
SENC_NUM: tl.constexpr = tl.constexpr(448.0 * 6.0)

# jit decides at decoration time whether kernels run in the interpreter, so this records the
# mode the kernel below actually has (CPU tensors work only when it is True).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

# Host-side scale modes: one S_enc for the tensor, one per row given by the caller, or one per
# row computed from the row's own amax inside the kernel.
_SCALAR, _PER_ROW, _FUSED_ROW = 0, 1, 2


@triton.jit
def _clean_abs(x):
    """|x| with NaN -> 0 (Inf kept): amax ignores NaN the way fmaxf does."""
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def _e4m3_rn_satfinite(v):
    """fp32 -> E4M3FN byte as int32: round half even, |v| >= 448 (and Inf) -> 448, NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: clamp at the bits of 448.0 (saturation, and keeps the adds below from
    # overflowing), then round the 23-bit mantissa to 3 bits, ties to even; a mantissa carry
    # moves into the exponent as it should. 960 = (127 - 7) << 3 rebiases the exponent.
    m = tl.minimum(mag, 0x43E00000)
    normal = ((m + 0x7FFFF + ((m >> 20) & 1)) >> 20) - 960
    # Below 2^-6 the E4M3 value is k * 2^-9: k = round_half_even(significand >> shift).
    e = mag >> 23
    sig = (mag & 0x7FFFFF) | 0x800000
    # >= 25 always rounds to 0 since sig < 2^24; the floor only keeps the shift defined in
    # lanes that take the normal branch (negative shifts are poison in LLVM).
    shift = tl.minimum(tl.maximum(141 - e, 21), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0x3C800000, q, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _e4m3_decode(b):
    """E4M3FN byte (int32) -> fp32, NaN for 0x7F/0xFF."""
    exp = (b >> 3) & 0xF
    man = b & 7
    neg = (b & 0x80) != 0
    normal = (((b & 0x80) << 24) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # man * 2^-9, exact
    sub = tl.where(neg, -sub, sub)
    val = tl.where(exp == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def _e2m1_rn_satfinite(z):
    """fp32 -> E2M1 code (int32): ties to the even code, saturate at 6, NaN -> 7, -0 -> 8."""
    a = tl.abs(z)
    # Count the rounding boundaries below |z|; ">=" at 0.75/1.75/3.5 sends those ties up to the
    # even code, ">" at 0.25/1.25/2.5/5 sends them down.
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    nan = z != z
    code = tl.where(nan, 7, code)
    neg = (z.to(tl.int32, bitcast=True) < 0) & (~nan)
    return code | (neg.to(tl.int32) << 3)


@triton.jit
def _row_encode_scales(x_row, senc_ptr, sdec_ptr, senc_out_ptr, rows64, row_ok, blk, pair, k_first, K,
                       k_tiles_per_prog, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
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
    x_ptr, data_ptr, scale_ptr, mant_ptr, senc_ptr, sdec_ptr, senc_out_ptr,
    M, K, stride_xm, k_tiles_per_prog,
    MODE: tl.constexpr, MANTISSA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
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
        col = k0 + blk * 16 + 2 * pair  # [1, NB, 8]
        ok = row_ok & (col < K)  # K % 16 == 0: a block is wholly in or out
        xe = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        xo = tl.load(x_row + col + 1, mask=ok, other=0.0).to(tl.float32)
        amax_b = tl.maximum(
            tl.max(_clean_abs(xe), axis=2, keep_dims=True),
            tl.max(_clean_abs(xo), axis=2, keep_dims=True),
        )  # [BM, NB, 1]
        sf = _e4m3_rn_satfinite(amax_b * s6)
        d = _e4m3_decode(sf) * s_dec
        enc = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)  # keeps NaN and -Inf, as clamp_max does
        qe = _e2m1_rn_satfinite(xe * enc)
        qo = _e2m1_rn_satfinite(xo * enc)
        byte = (qe | (qo << 4)).to(tl.uint8)
        tl.store(data_ptr + rows64 * half_k + (k0 // 2 + blk * 8 + pair), byte, mask=ok)
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
    """(NVFP4Tensor, guidance) for x; see `kernels.dispatch.nvfp4_quantize_with_guidance`."""
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
        x2, data, scale, mant, s_enc, s_dec, s_enc,
        m, k, x2.stride(0), k_tiles,
        MODE=mode, MANTISSA=mantissa, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=4, enable_fp_fusion=False,
    )
    g = s_enc.reshape(lead) if per_row_global else s_enc.reshape(())
    q = nvfp4.NVFP4Tensor(data.reshape(*lead, k // 2), scale.reshape(*lead, k // 16), g)
    return q, (mant.reshape(*lead, k // 8) if mantissa else None)
