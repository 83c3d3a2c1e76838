"""C kernels for the embedded engine's forward on CPU (`cpu_fused.c`; paged attention:
cpu_attention.py; a whole dense layer in one call: cpu_layer.py):

    x ─► add_rmsnorm (residual add + RMSNorm, one pass) ─► qkv GEMM
      ─► qkv_rope (q/k RMSNorm for Qwen3, RoPE, K/V stored straight into their cache slots)
      ─► paged_attention ─► o GEMM ─► add_rmsnorm ─► gate_up GEMM ─► silu_mul ─► down GEMM
Dense layers chain these inside one C call (cpu_layer.py, with its own GEMM); MoE layers and
MXFP4 call them one by one around the GEMVs. On a small model the torch version of a layer is
~40 tiny ops at ~10 us of dispatch each. Each kernel computes in fp32 and rounds where HF's module
rounds (bfloat16 runs keep HF's rounding points); fp32 results match the torch reference to a
few ulp (other summation orders, a polynomial exp), never bit for bit.

Built with the other CPU kernels by megatron_trace/kernels/cpu_build.py; `available()` is False when that build
failed (logged there, reported in the engine's model_info) or for dtypes other than
float32/bfloat16, and the engine then runs its torch reference path.
"""

from __future__ import annotations

import torch

from . import cpu_build

DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype in DTYPES and cpu_build.library() is not None


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] contiguous, updated in place to x + residual; returns RMSNorm(x) * weight."""
    out = torch.empty_like(x)
    cpu_build.library().add_rmsnorm(x, residual, weight, out, eps)
    return out


def qkv_rope(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """qkv [T, (H+2Hkv)D] contiguous; cos/sin fp32 tables [P, D] read at row positions[t] (int64
    [T], each < P; row t when None); K/V rows into k_dst/v_dst [*, Hkv, D] at `slots` (int64 [T],
    or row t when None). Returns q [T, H, D] after (q-norm and) RoPE."""
    q = torch.empty(qkv.shape[0], heads, head_dim, dtype=qkv.dtype)
    slots = None if slots is None else slots.to(torch.int64).contiguous()
    cpu_build.library().qkv_rope(
        qkv, heads, kv_heads, head_dim, cos, sin, positions, q_norm, k_norm, eps, q, k_dst, v_dst, slots
    )
    return q


def greedy_logprob(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """(argmax, log_softmax at the argmax) of each row of contiguous fp32 logits [B, V], as lists."""
    b, v = logits.shape
    tok, lp = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.float32)
    if cpu_build.library().greedy_logprob(logits, tok, lp):
        raise MemoryError(f"greedy_logprob: no memory for a row of {v} logits")
    return tok.tolist(), lp.tolist()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] contiguous -> silu(gate) * up [T, F]."""
    t, f2 = gate_up.shape
    out = torch.empty(t, f2 // 2, dtype=gate_up.dtype)
    cpu_build.library().silu_mul(gate_up, out)
    return out
