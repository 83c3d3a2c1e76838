"""Triton FP4-weight GEMM for decode: W4A16 (`fp4_linear_triton`) and W4A4 (`fp4_linear_w4a4_triton`).

y[M, N] = x[M, K] @ dequantize(w)[N, K]^T (+ bias), w an `NVFP4Tensor` (packed E2M1 [N, K/2],
E4M3 block scales [N, K/16], S_enc 0-d or one per output row).

Design (decode is bandwidth-bound: at M <= 8 the 0.5625 B/element of FP4 weights are nearly all
the traffic, so the 16/4.5 = 3.56x byte ratio against BF16 is the ceiling):
* Dequantization happens in registers: one program loads a [BLOCK_N, BLOCK_K/2] tile of code
  bytes (each row's BLOCK_K/2 bytes contiguous: full 128-byte lines, coalesced) and the matching
  scale bytes (eight neighbouring lanes share one byte: broadcast loads, 1/8 of the traffic),
  decodes E2M1 and E4M3 with integer bit arithmetic, and interleaves the low/high nibbles with
  `tl.join` + `tl.reshape` into a [BLOCK_N, BLOCK_K] tile.
* Exactness trick: e2m1 * e4m3 has at most 6 significant bits and lies in [2^-10, 2688], so the
  block-scaled weight `code * SF` is EXACT in bf16. The tile therefore goes to the bf16 tensor
  cores unchanged, and the per-row global S_dec (fp32(1/fp64(S_enc)), computed in the kernel) is
  applied once to the fp32 accumulator. bf16 activations are exact bf16; fp16 activations are
  split into 2 bf16 pieces and fp32 activations into 3 (x = x1 + x2 + x3, each product exact in
  fp32), so every input dtype is computed with fp32-level accuracy on bf16 MMAs (Hopper has no
  FP4 MMA; the extra MMAs are free in a memory-bound kernel). The only difference from the
  reference `F.linear(x.float(), nvfp4.dequantize(w))` is fp32 summation order and where S_dec
  is multiplied in: relative error ~1e-6 of sum|x*w| (tests use rtol=atol=1e-5 on
  unit-scale data).
* Small M: tl.dot needs >= 16 rows, so M is padded to BLOCK_M = 16 (masked loads; padding
  costs MMA work only). To fill 132 SMs at M = 1, a GEMV launches N/BLOCK_N programs times a
  split-K factor chosen so that >= 4 programs per SM exist (8192x8192: 128 N-tiles x 4 splits);
  split-K writes fp32 partials [S, M, N] that one torch `sum` reduces (deterministic, no
  atomics; the partials are S*M*N*4 bytes, ~1% of the weight bytes at M = 1).
* W4A4: activations are quantized per token (or with a static S_enc) by the bit-exact quantize
  kernel and fed to the same GEMM in FP4 form (A_FP4): `codes * SF` of the activations is also
  exact in bf16, and both S_dec are applied to the accumulator. Native FP4 MMA (tcgen05 block-
  scaled MMA) exists only on Blackwell (sm_100); it is not implemented here.
* M >= 64 becomes compute-bound on Hopper: cuBLAS BF16 should win at M = 128 (dequantization
  is redone for every M-tile and the fp32/fp16 piece splitting multiplies the MMAs); the goal
  (>= 2.5x cuBLAS) is stated for M <= 8 only.
Under TRITON_INTERPRET=1 the interpreter's bf16 tl.dot multiplies raw uint16 bits, so there the
bf16 operands are widened to fp32 (exactly) for an IEEE fp32 dot: the same products and fp32
accumulation the tensor cores perform.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_trace.fp4 import nvfp4

from .triton_fp4_codecs import INTERPRETED, _e4m3_decode

NUM_SMS = 132  # H100/H200; only sizes the split-K heuristic


@triton.jit
def _e2m1_value(c):
    """4-bit E2M1 code (int32) -> fp32 via its bits: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    mag = c & 7
    e = mag >> 1
    bits = ((e + 126) << 23) | ((mag & 1) << 22)  # 1.m * 2^(e-1) for e >= 1
    bits = tl.where(mag == 0, 0, tl.where(mag == 1, 0x3F000000, bits))  # 0, 0.5
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_tile(b, sf, R: tl.constexpr, C: tl.constexpr):
    """bytes b [R, C/2] (int32) and per-byte scales sf (fp32) -> bf16 [R, C] of code * sf, exact."""
    lo = _e2m1_value(b & 15) * sf
    hi = _e2m1_value((b >> 4) & 15) * sf
    return tl.reshape(tl.join(lo, hi), [R, C]).to(tl.bfloat16)


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # interpreter: bf16 values are exact in fp32
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _split_mma(a, b, acc, PIECES: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc += a @ b with b bf16-exact and a in PIECES bf16 parts (a = a1 + a2 + ..., exact
    remainders), so a keeps fp32 (3 pieces) or fp16 (2 pieces) accuracy on bf16 MMAs."""
    rem = a.to(tl.float32)
    for i in tl.static_range(PIECES):
        part = rem.to(tl.bfloat16)
        acc = _mma(part, b, acc, DOT_FP32)
        if i + 1 < PIECES:
            rem = rem - part.to(tl.float32)
    return acc


@triton.jit
def _fp4_gemm_kernel(
    a_ptr,
    as_ptr,
    asenc_ptr,
    w_ptr,
    ws_ptr,
    wsenc_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    stride_os,
    asenc_stride,
    wsenc_stride,
    k_per_split,
    A_FP4: tl.constexpr,
    A_PIECES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HK: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    jb = tl.arange(0, HK)
    jk = tl.arange(0, BLOCK_K)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_row = w_ptr + rn64[:, None] * stride_wn
    ws_row = ws_ptr + rn64[:, None] * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kb = k0 // 2 + jb  # byte column; K % 16 == 0 so bytes and scale blocks are whole
        kb_ok = kb[None, :] < k_hi // 2
        wm = n_ok[:, None] & kb_ok
        wb = tl.load(w_row + kb[None, :], mask=wm, other=0).to(tl.int32)
        wsf = _e4m3_decode(tl.load(ws_row + kb[None, :] // 8, mask=wm, other=0).to(tl.int32))
        w = _nibble_tile(wb, wsf, BLOCK_N, BLOCK_K)  # [BN, BK] bf16, exact
        if A_FP4:
            am = m_ok[:, None] & kb_ok
            ab = tl.load(a_ptr + rm64[:, None] * stride_am + kb[None, :], mask=am, other=0).to(tl.int32)
            asf = _e4m3_decode(
                tl.load(as_ptr + rm64[:, None] * stride_asm + kb[None, :] // 8, mask=am, other=0).to(tl.int32)
            )
            a = _nibble_tile(ab, asf, BLOCK_M, BLOCK_K)
        else:
            kk = k0 + jk
            a = tl.load(
                a_ptr + rm64[:, None] * stride_am + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < k_hi), other=0.0
            )
        acc = _split_mma(a, tl.trans(w), acc, A_PIECES, DOT_FP32)

    w_senc = tl.load(wsenc_ptr + rn64 * wsenc_stride, mask=n_ok, other=1.0)
    acc = acc * (1.0 / w_senc.to(tl.float64)).to(tl.float32)[None, :]  # S_dec as the reference
    if A_FP4:
        a_senc = tl.load(asenc_ptr + rm64 * asenc_stride, mask=m_ok, other=1.0)
        acc = acc * (1.0 / a_senc.to(tl.float64)).to(tl.float32)[:, None]
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + rm64[:, None] * stride_om + rn64[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn64, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm64[:, None] * stride_om + rn64[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_weight(w: nvfp4.NVFP4Tensor, k: int) -> int:
    if not isinstance(w, nvfp4.NVFP4Tensor):
        raise TypeError(f"the FP4 GEMM takes an NVFP4Tensor weight; got {type(w).__name__}")
    if w.data.dim() != 2 or w.data.shape[1] * 2 != k:
        raise ValueError(f"weight codes must be [N, K/2] = [N, {k // 2}]; got {tuple(w.data.shape)}")
    n = w.data.shape[0]
    if tuple(w.scale.shape) != (n, k // 16):
        raise ValueError(f"weight scales must be [N, K/16] = {(n, k // 16)}; got {tuple(w.scale.shape)}")
    gs = w.global_scale
    if gs.dim() and tuple(gs.shape) != (n,):
        raise ValueError(f"weight global scale must be 0-d or [N] = [{n}]; got {tuple(gs.shape)}")
    return n


def launch_config(m: int, n: int, k: int) -> dict:
    """Tile sizes and split-K for an [m, k] x [k, n] product (see the module docstring)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = 64
    block_k = max(16, min(256, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1 if INTERPRETED else max(1, min(triton.cdiv(4 * NUM_SMS, tiles), k // 1024))
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, num_warps=4 if block_m <= 32 else 8)


def _gemm(a2, a_scale, a_senc, w, bias, out_dtype, a_pieces, cfg) -> torch.Tensor:
    m, n, k = a2.shape[0], w.data.shape[0], w.data.shape[1] * 2
    cfg = {**launch_config(m, n, k), **{key: v for key, v in (cfg or {}).items() if v is not None}}
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["split_k"]), bk) * bk
    split = triton.cdiv(k, k_per_split)
    dev = a2.device
    w_data, w_scale = w.data.contiguous(), w.scale.contiguous()
    w_senc = w.global_scale.to(device=dev, dtype=torch.float32).reshape(-1).contiguous()
    a_fp4 = a_scale is not None
    if a_fp4:
        a_senc = a_senc.to(device=dev, dtype=torch.float32).reshape(-1).contiguous()
    else:
        a_scale, a_senc = w_scale, w_senc  # unused placeholders
    partial = split > 1
    out = torch.empty((split, m, n) if partial else (m, n), dtype=torch.float32 if partial else out_dtype, device=dev)
    bias_t = bias.contiguous() if bias is not None else w_senc
    grid = (triton.cdiv(n, bn), split, triton.cdiv(m, bm))
    _fp4_gemm_kernel[grid](
        a2,
        a_scale,
        a_senc,
        w_data,
        w_scale,
        w_senc,
        bias_t,
        out,
        m,
        n,
        k,
        a2.stride(0),
        a_scale.stride(0),
        w_data.stride(0),
        w_scale.stride(0),
        out.stride(-2),
        out.stride(0) if partial else 0,
        int(a_senc.numel() > 1),
        int(w_senc.numel() > 1),
        k_per_split,
        A_FP4=a_fp4,
        A_PIECES=a_pieces,
        HAS_BIAS=bias is not None,
        PARTIAL=partial,
        DOT_FP32=INTERPRETED,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=cfg["num_warps"],
        num_stages=3,
        enable_fp_fusion=False,
    )
    if partial:
        out = out.sum(0)
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(out_dtype)
    return out


_PIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def fp4_linear_triton(
    x: torch.Tensor,
    w: nvfp4.NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    **cfg,
) -> torch.Tensor:
    """W4A16: x [..., K] (bf16/fp16/fp32) @ dequantize(w)^T + bias -> [..., N] in out_dtype
    (default x.dtype). cfg may override block_m/block_n/block_k/split_k/num_warps."""
    k = x.shape[-1]
    n = _check_weight(w, k)
    if x.dtype not in _PIECES:
        x = x.to(torch.float32)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _gemm(x2, None, None, w, bias, out_dtype or x.dtype, _PIECES[x.dtype], cfg)
    return out.reshape(*x.shape[:-1], n)


def fp4_linear_w4a4_triton(
    x: torch.Tensor,
    w: nvfp4.NVFP4Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_global_scale: torch.Tensor | float | None = None,
    out_dtype: torch.dtype | None = None,
    **cfg,
) -> torch.Tensor:
    """W4A4: x is NVFP4-quantized per token (or with the static S_enc `input_global_scale`) by the
    bit-exact quantize kernel, then multiplied in FP4 form. Same result as
    F.linear(dequantize(quantize(x)), dequantize(w)) up to fp32 summation order. x may also be
    the NVFP4Tensor already (the engine quantized it to record guidance): out_dtype then
    defaults to float32."""
    from .nvfp4_quantize import quantize_triton

    if isinstance(x, nvfp4.NVFP4Tensor):
        if input_global_scale is not None:
            raise ValueError("input_global_scale applies to an unquantized x; this x is an NVFP4Tensor already")
        lead, k = tuple(x.data.shape[:-1]), x.data.shape[-1] * 2
        gs = x.global_scale.reshape(-1) if x.global_scale.dim() else x.global_scale
        q = nvfp4.NVFP4Tensor(x.data.reshape(-1, k // 2).contiguous(), x.scale.reshape(-1, k // 16).contiguous(), gs)
        out_dtype = out_dtype or torch.float32
    else:
        lead, k = tuple(x.shape[:-1]), x.shape[-1]
        x2 = x.reshape(-1, k)
        if input_global_scale is None:
            q = quantize_triton(x2, per_row_global=True)
        else:
            q = quantize_triton(x2, global_scale=input_global_scale)
        out_dtype = out_dtype or x.dtype
    n = _check_weight(w, k)
    out = _gemm(q.data, q.scale, q.global_scale, w, bias, out_dtype, 1, cfg)
    return out.reshape(*lead, n)
