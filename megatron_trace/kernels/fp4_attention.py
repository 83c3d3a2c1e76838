"""Triton paged decode attention over NVFP4 / MXFP4 (or BF16) K/V pages, dequantized in the kernel.

Layout (sglang_backend/local/kv_cache.py, one layer and K or V): codes [slots, kv_heads, D/2]
uint8 (element 2i in the low nibble), scales [slots, kv_heads, D/16] uint8 (NVFP4: E4M3 with a
per-layer fp32 S_enc; MXFP4: E8M0, block 16), slot = page * page_size + offset, one row of
`slot_table` per sequence. fmt "bf16" reads [slots, kv_heads, D] bf16 values instead (the
baseline the benchmark compares with, same kernel).

Design (decode attention is bandwidth-bound: 2 * D * 0.5625 bytes per token and kv head for
FP4 against 4 * D for BF16, a 3.56x ceiling):
* Grid (batch * kv_heads, splits): one program owns every query head of a GQA group (G = H /
  kv_heads rows, padded to 16 for tl.dot), so each K/V byte is loaded once per group; a long
  context is cut into `splits` token ranges (flash-decoding) so that >= 2 programs per SM exist
  even at batch 1 with one kv head; a second small kernel merges the splits' (max, sum, acc)
  with the usual log-sum-exp rescaling. With a single split the first kernel writes the output.
* Each tile of BLOCK_T tokens gathers its slots from the slot table, loads the tokens' code rows
  (D/2 contiguous bytes each; a page's tokens are adjacent, so loads coalesce) and their scale
  bytes (shared by 8 lanes), and decodes E2M1 x E4M3 / E8M0 with integer bit arithmetic.
* As in megatron_trace/kernels/fp4_gemm.py, `code * block_scale` is exact in bf16 (for MXFP4 too, barring
  scales near 2^+-127), so QK^T and PV run on bf16 tensor cores: q (fp32: 3 bf16 pieces,
  fp16: 2, bf16: 1) and the fp32 probabilities P (3 pieces for fp32 q, 2 otherwise) are split
  into exact bf16 parts, keeping fp32-level accuracy. The global S_dec of K is folded into the
  softmax scale and that of V applied once at the end. Online softmax is fp32 throughout.
* Result: matches gather + dequantize + fp32 torch softmax attention to ~1e-6 relative (tests
  use 1e-5); the difference is summation order and where S_dec is multiplied in.
Under TRITON_INTERPRET=1 the bf16 dots are widened to IEEE fp32 dots (the interpreter's bf16
tl.dot is broken); the operands are the same bf16-exact values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp4_gemm import NUM_SMS, _nibble_tile, _split_mma
from .triton_fp4_codecs import INTERPRETED, _e4m3_decode

_FMT = {"nvfp4": 0, "mxfp4": 1, "bf16": 2}


@triton.jit
def _e8m0_decode(b):
    """E8M0 byte (int32) -> 2^(b-127) as fp32 (0x00 is the subnormal 2^-127), NaN for 0xFF."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return tl.where(b == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _kv_tile(c_ptr, s_ptr, row, srow, ok, D: tl.constexpr, BLOCK_T: tl.constexpr, FMT: tl.constexpr):
    """[BLOCK_T, D] bf16 tile of code * block scale (exact) for the token rows at offsets row."""
    if FMT == 2:
        d = tl.arange(0, D)
        tile = tl.load(c_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.bfloat16)
    else:
        jb = tl.arange(0, D // 2)
        b = tl.load(c_ptr + row[:, None] + jb[None, :], mask=ok[:, None], other=0).to(tl.int32)
        sb = tl.load(s_ptr + srow[:, None] + jb[None, :] // 8, mask=ok[:, None], other=0).to(tl.int32)
        if FMT == 0:
            sf = _e4m3_decode(sb)
        else:
            sf = _e8m0_decode(sb)
        tile = _nibble_tile(b, sf, BLOCK_T, D)
    return tile


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    kc_ptr,
    ks_ptr,
    vc_ptr,
    vs_ptr,
    kgs_ptr,
    vgs_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kcs,
    stride_kch,
    stride_kss,
    stride_ksh,
    stride_vcs,
    stride_vch,
    stride_vss,
    stride_vsh,
    KVH,
    tokens_per_split,
    n_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FMT: tl.constexpr,
    Q_PIECES: tl.constexpr,
    P_PIECES: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid // KVH
    h = pid % KVH
    n_tok = tl.load(lens_ptr + b).to(tl.int32)
    t_lo = pid_s * tokens_per_split
    t_hi = tl.minimum(n_tok, t_lo + tokens_per_split)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
    ).to(tl.float32)
    if FMT == 0:  # S_dec = fp32(1 / fp64(S_enc)), as nvfp4.decode_scale
        k_sdec = (1.0 / tl.load(kgs_ptr).to(tl.float64)).to(tl.float32)
        v_sdec = (1.0 / tl.load(vgs_ptr).to(tl.float64)).to(tl.float32)
    else:
        k_sdec = 1.0
        v_sdec = 1.0
    qk_scale = sm_scale * k_sdec
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < t_hi
        slot = tl.load(table_row + t, mask=t_ok, other=0).to(tl.int64)
        k = _kv_tile(
            kc_ptr,
            ks_ptr,
            slot * stride_kcs + h * stride_kch,
            slot * stride_kss + h * stride_ksh,
            t_ok,
            D,
            BLOCK_T,
            FMT,
        )
        s = _split_mma(q, tl.trans(k), tl.zeros([G_PAD, BLOCK_T], tl.float32), Q_PIECES, DOT_FP32)
        s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _kv_tile(
            vc_ptr,
            vs_ptr,
            slot * stride_vcs + h * stride_vch,
            slot * stride_vss + h * stride_vsh,
            t_ok,
            D,
            BLOCK_T,
            FMT,
        )
        acc = _split_mma(p, v, acc * alpha[:, None], P_PIECES, DOT_FP32)
        m_i = m_new
    if DIRECT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_sdec
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )
    else:
        row = (pid.to(tl.int64) * n_splits + pid_s) * G + g  # [B * KVH, splits, G] partials
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc * v_sdec, mask=g_ok[:, None])


@triton.jit
def _merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    H,
    n_splits,
    G: tl.constexpr,
    D: tl.constexpr,
    S_PAD: tl.constexpr,
):
    pid = tl.program_id(0)  # b * H + head
    b = pid // H
    hq = pid % H
    grp = b * (H // G) + hq // G
    s = tl.arange(0, S_PAD)
    s_ok = s < n_splits
    d = tl.arange(0, D)
    row = (grp.to(tl.int64) * n_splits + s) * G + hq % G
    m = tl.load(m_ptr + row, mask=s_ok, other=float("-inf"))
    l_sum = tl.load(l_ptr + row, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # empty splits weigh nothing
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_sum * w, axis=0)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d, o.to(out_ptr.dtype.element_ty))


_Q_PIECES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def paged_decode_attention_triton(
    q,
    k_codes,
    k_scales,
    v_codes,
    v_scales,
    k_gs,
    v_gs,
    slot_table,
    lens,
    fmt="nvfp4",
    sm_scale=None,
    *,
    block_t=None,
    splits=None,
    num_warps=4,
):
    """See `megatron_trace.kernels.dispatch.paged_decode_attention`; block_t / splits override the heuristics."""
    if fmt not in _FMT:
        raise ValueError(f"fmt must be one of {tuple(_FMT)}; got {fmt!r}")
    bsz, h, d = q.shape
    kvh = k_codes.shape[1]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    if d % 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16; got {d}")
    width = d if fmt == "bf16" else d // 2
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        if t.dim() != 3 or t.shape[1] != kvh or t.shape[2] != width or t.stride(2) != 1:
            raise ValueError(f"{name} must be [slots, {kvh}, {width}] with a contiguous last dim; got {tuple(t.shape)}")
    if fmt == "bf16":
        if k_codes.dtype != torch.bfloat16 or v_codes.dtype != torch.bfloat16:
            raise TypeError("fmt='bf16' reads bfloat16 K/V values")
        k_scales, v_scales = k_codes, v_codes  # unused
    if q.dtype not in _Q_PIECES:
        q = q.to(torch.float32)
    q = q if q.stride(2) == 1 else q.contiguous()
    dev = q.device
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    g = h // kvh
    g_pad = max(16, triton.next_power_of_2(g))
    max_len = slot_table.shape[1]
    block_t = block_t or (16 if INTERPRETED else 64)
    if splits is None:  # >= 2 programs per SM, >= 256 tokens per split
        splits = 1 if INTERPRETED else max(1, min(triton.cdiv(2 * NUM_SMS, bsz * kvh), max_len // 256))
    per_split = max(block_t, triton.cdiv(triton.cdiv(max(max_len, 1), splits), block_t) * block_t)
    splits = max(1, triton.cdiv(max_len, per_split))
    slot_table = slot_table if slot_table.stride(1) == 1 else slot_table.contiguous()
    lens = lens.to(device=dev).contiguous()
    gs = [torch.as_tensor(1.0 if s is None else s, dtype=torch.float32, device=dev).reshape(1) for s in (k_gs, v_gs)]
    out = torch.empty(bsz, h, d, dtype=q.dtype, device=dev)
    direct = splits == 1
    if direct:
        m_p = l_p = acc_p = out
    else:
        m_p = torch.empty(bsz * kvh * splits * g, dtype=torch.float32, device=dev)
        l_p = torch.empty_like(m_p)
        acc_p = torch.empty(bsz * kvh * splits * g, d, dtype=torch.float32, device=dev)
    p_pieces = 3 if q.dtype == torch.float32 else 2
    _decode_attn_kernel[(bsz * kvh, splits)](
        q,
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        gs[0],
        gs[1],
        slot_table,
        lens,
        out,
        m_p,
        l_p,
        acc_p,
        sm_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        slot_table.stride(0),
        k_codes.stride(0),
        k_codes.stride(1),
        k_scales.stride(0),
        k_scales.stride(1),
        v_codes.stride(0),
        v_codes.stride(1),
        v_scales.stride(0),
        v_scales.stride(1),
        kvh,
        per_split,
        splits,
        G=g,
        G_PAD=g_pad,
        D=d,
        BLOCK_T=block_t,
        FMT=_FMT[fmt],
        Q_PIECES=_Q_PIECES[q.dtype],
        P_PIECES=p_pieces,
        DIRECT=direct,
        DOT_FP32=INTERPRETED,
        num_warps=num_warps,
        num_stages=2,
        enable_fp_fusion=False,
    )
    if not direct:
        _merge_kernel[(bsz * h,)](
            m_p,
            l_p,
            acc_p,
            out,
            out.stride(0),
            out.stride(1),
            h,
            splits,
            G=g,
            D=d,
            S_PAD=triton.next_power_of_2(splits),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out
