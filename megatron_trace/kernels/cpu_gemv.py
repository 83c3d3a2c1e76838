"""Weight-streaming linears for decode on CPU: NVFP4 (ModelOpt layout, read as stored) and BF16.

The C sources are `cpu_gemv.c` (kernels, AVX-512 or portable 8-lane vectors, chosen by the compiler's
target: MEGATRON_TRACE_CPU_ISA, cpu_build.py), `cpu_gemv_w4a4.c` and `cpu_gemv_parallel.cpp`
(at::parallel_for over output rows, so torch.get_num_threads() applies), built with the other CPU
kernels by megatron_trace/kernels/cpu_build.py.
Without a compiler or ninja, `available()` is False, `unavailable_reason()` says why, and the
engine logs it and reports it in model_info (it then multiplies dequantized weights with torch:
same numbers to fp32 rounding, slower decode).

Numerics: y = x . dequantize(W)^T with fp32 accumulation, reassociated per NVFP4 block (see
cpu_gemv.c), so results equal fp4's dequantize + an fp32 matmul to fp32 rounding.
"""

from __future__ import annotations

import torch

from . import cpu_build


def _lib():
    return cpu_build.library()


def available() -> bool:
    return _lib() is not None


def unavailable_reason() -> str | None:
    """None when the kernels are built, else why not (for model_info and benchmark columns)."""
    return cpu_build.ENGINE.reason()


def baseline_library():
    """The baseline-target build (portable vectors), for tests: pass it as `lib=` to the functions below."""
    return cpu_build.baseline()


def isa() -> str | None:
    """The code paths the build selected ("avx512+bf16,w4a4:avx512-vnni" down to "vec8,w4a4:vec8"),
    None when not built."""
    lib = _lib()
    return None if lib is None else f"{lib.gemv_isa()},w4a4:{lib.gemv_w4a4_isa()}"


def _bias(bias: torch.Tensor | None):
    return None if bias is None else bias.float().contiguous()


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(
            f"{what}: x must be a CPU float32/bfloat16 [M, {k}] tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    return x.contiguous()


def nvfp4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_decode: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    lib=None,
) -> torch.Tensor:
    """x [M, K] . W^T for W NVFP4 as stored: codes uint8 [N, K/2], E4M3 scales uint8 [N, K/16],
    global_decode fp32 [N] (or a scalar: one for all rows). Output dtype: x's unless given."""
    n, k2 = codes.shape
    k = 2 * k2
    if k % 16 or codes.dtype != torch.uint8 or tuple(scales.shape) != (n, k // 16):
        raise ValueError(
            f"nvfp4_linear: codes must be uint8 [N, K/2] with K a multiple of 16 and scales "
            f"[N, K/16]; got codes {codes.dtype} {tuple(codes.shape)}, scales {tuple(scales.shape)}"
        )
    x = _check_x(x, k, "nvfp4_linear")
    gdec = global_decode.float().reshape(-1).expand(n).contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype)
    b, codes, scales = _bias(bias), codes.contiguous(), scales.contiguous().view(torch.uint8)
    rc = (lib or _lib()).gemv_nvfp4(x, codes, scales, gdec, b, out)
    if rc:
        raise MemoryError(f"nvfp4_linear: no memory for the laid-out activations [{x.shape[0]}, {k}]")
    return out


def w4a4_linear(
    act_codes: torch.Tensor,
    act_scales: torch.Tensor,
    act_global_decode: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    global_decode: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    lib=None,
) -> torch.Tensor:
    """NVFP4 activations (codes uint8 [M, K/2], E4M3 scales [M, K/16], decode global scale [M] or a
    scalar) times an NVFP4 weight as in nvfp4_linear: dequantize(a) . dequantize(W)^T to fp32 rounding."""
    n, k2 = codes.shape
    m, k = act_codes.shape[0], 2 * k2
    shapes_ok = (
        act_codes.dim() == 2
        and act_codes.shape[1] == k2
        and tuple(act_scales.shape) == (m, k // 16)
        and tuple(scales.shape) == (n, k // 16)
        and k % 16 == 0
    )
    if not shapes_ok or act_codes.dtype != torch.uint8 or codes.dtype != torch.uint8:
        raise ValueError(
            f"w4a4_linear: needs uint8 codes [M, K/2] / [N, K/2] and scales [M, K/16] / [N, K/16] "
            f"with K a multiple of 16; got activation {tuple(act_codes.shape)} {tuple(act_scales.shape)}, "
            f"weight {tuple(codes.shape)} {tuple(scales.shape)}"
        )
    adec = act_global_decode.float().reshape(-1).expand(m).contiguous()
    gdec = global_decode.float().reshape(-1).expand(n).contiguous()
    out = torch.empty(m, n, dtype=out_dtype)
    b = _bias(bias)
    ac, as_ = act_codes.contiguous(), act_scales.contiguous().view(torch.uint8)
    codes, scales = codes.contiguous(), scales.contiguous().view(torch.uint8)
    rc = (lib or _lib()).gemv_w4a4(ac, as_, adec, codes, scales, gdec, b, out)
    if rc:
        raise MemoryError(f"w4a4_linear: no memory for the laid-out activations [{m}, {k}]")
    return out


def bf16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    lib=None,
) -> torch.Tensor:
    """x [M, K] . weight^T for a bf16 weight [N, K], fp32 accumulation."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError(
            f"bf16_linear: weight must be bfloat16 [N, K] with K even, got {weight.dtype} {tuple(weight.shape)}"
        )
    x, weight = _check_x(x, k, "bf16_linear"), weight.contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype)
    b = _bias(bias)
    rc = (lib or _lib()).gemv_bf16(x, weight, b, out)
    if rc:
        raise MemoryError(f"bf16_linear: no memory for the laid-out activations [{x.shape[0]}, {k}]")
    return out
