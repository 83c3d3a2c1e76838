"""Paged attention of the engine's CPU kernels (`cpu_attention_typed.h`), prefill and decode alike.

Three uses of one C kernel: pages in the model dtype, NVFP4 K and V, and K and V each in its own
format (model dtype, NVFP4, MXFP4 with E8M0 per 16, or FP8 E4M3 with one scale per token:
`paged_attention_kv`).
Row t of q attends to the first row_len[t] positions of its sequence, whose KV slots a table
row lists; FP4 pages are decoded in registers by the C kernels' one E2M1/E4M3 decoder
(`cpu_fp4.h`), never gathered into a dequantized copy. Built by megatron_trace/kernels/cpu_build.py; callers
check `cpu_fused.available()` first.
"""

from __future__ import annotations

import torch

from . import cpu_build


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    row_seq: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]; k/v_cache [slots, Hkv, D] contiguous, q's dtype; table int64 [S, >= max row_len]
    with contiguous rows; row_seq, row_len int64 [T]. Returns softmax(q k^T * scale) v over each
    row's slots. The engine builds every index itself; nothing here is bounds-checked."""
    out = torch.empty_like(q)
    if cpu_build.library().paged_attention(q, k_cache, v_cache, table, row_seq, row_len, scale, out):
        raise MemoryError(f"paged_attention: no memory for the scores of {q.shape[0]} rows")
    return out


def paged_attention_nvfp4(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    sdec_k: float,
    sdec_v: float,
    table: torch.Tensor,
    row_seq: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention` over NVFP4 pages: codes uint8 [slots, Hkv, D/2], E4M3 scales uint8
    [slots, Hkv, D/16], S_dec of K and V (fp4.nvfp4.decode_scale). Elements decode exactly as
    fp4.nvfp4.dequantize(..., q.dtype) would."""
    out = torch.empty_like(q)
    if cpu_build.library().paged_attention_nvfp4(
        q, k_codes, k_scales, v_codes, v_scales, sdec_k, sdec_v, table, row_seq, row_len, scale, out
    ):
        raise MemoryError(f"paged_attention_nvfp4: no memory for the scores of {q.shape[0]} rows")
    return out


# Page formats the mixed-format kernel decodes itself (its `fmt` codes); others have no kernel.
KV_ROW_FORMATS = {"bf16": 0, "nvfp4": 1, "fp8": 2, "mxfp4": 3}


def paged_attention_kv(
    q: torch.Tensor,
    k_fmt: str,
    k_pages: tuple,
    sdec_k: float,
    v_fmt: str,
    v_pages: tuple,
    sdec_v: float,
    table: torch.Tensor,
    row_seq: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    k_add: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with K and V in their own page formats (KV_ROW_FORMATS): each of k_pages /
    v_pages is (data, scales) of one layer as PagedKVCache keeps them (scales None for the model
    dtype; for fp8, fp32 [slots]); sdec_* is NVFP4's per-layer S_dec (ignored otherwise).
    Elements decode exactly as the cache's torch read in q.dtype would. `k_add`: fp32 [>= max row_len,
    Hkv, D], row j added to the K read at column j of a table row, then rounded to q.dtype (a
    de-biased K cache's RoPE_pos(b): `(read.float() + k_add[j]).to(q.dtype)`)."""
    for name, fmt in (("K", k_fmt), ("V", v_fmt)):
        if fmt not in KV_ROW_FORMATS:
            raise ValueError(
                f"paged_attention_kv has no decoder for {name} pages in {fmt!r}; it decodes {', '.join(KV_ROW_FORMATS)}"
            )
    out = torch.empty_like(q)
    if cpu_build.library().paged_attention_kv(
        q,
        KV_ROW_FORMATS[k_fmt],
        k_pages[0],
        k_pages[1],
        sdec_k,
        None if k_add is None else _check_add(k_add, row_len, k_pages[0].shape[-2], q.shape[-1]),
        KV_ROW_FORMATS[v_fmt],
        v_pages[0],
        v_pages[1],
        sdec_v,
        table,
        row_seq,
        row_len,
        k_pages[0].shape[-2],
        scale,
        out,
    ):
        raise MemoryError(f"paged_attention_kv: no memory for the scores of {q.shape[0]} rows")
    return out


def _check_add(k_add: torch.Tensor, row_len: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The kernel reads k_add[j] for every column j < row_len unchecked: its shape is checked here."""
    need = int(row_len.max()) if row_len.numel() else 0
    ok = k_add.dtype == torch.float32 and k_add.is_contiguous() and k_add.dim() == 3
    if not ok or k_add.shape[0] < need or tuple(k_add.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(
            f"paged_attention_kv k_add must be contiguous fp32 [>= {need}, {kv_heads}, {head_dim}]; got "
            f"{k_add.dtype} {tuple(k_add.shape)}"
        )
    return k_add
