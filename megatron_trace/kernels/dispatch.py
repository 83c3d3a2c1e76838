"""Backend selection for the quantizers and FP4 GEMMs: the Triton kernels (CUDA), the CPU engine's C
kernels (megatron_trace/kernels/cpu_quant.py, built by megatron_trace/kernels/cpu_build.py) and the
torch references of megatron_trace.fp4, picked per call by device. (How the embedded engine runs a
whole layer on CPU, one C call or kernel by kernel, is sglang_backend/local/run_plan.py's choice.)

triton is imported lazily (first `triton_available()` or kernel call), never at import time.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.fp4.codecs import unpack_fp4
from megatron_trace.fp4.guided import GUIDANCE_MODES, guided_quantize, mantissa_bits
from megatron_trace.fp4.guided import mantissa_bits_packed as mantissa_bits_packed_reference

from . import (
    cpu_quant,  # builds nothing at import: the C kernels build on first use (megatron_trace/kernels/cpu_build.py)
)

BACKENDS = ("auto", "triton", "reference")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports here (it may still lack a GPU; see `nvfp4_quantize`)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # a broken install can raise more than ImportError
        return False
    return True


@functools.lru_cache(maxsize=None)
def _warn_cuda_without_triton(what: str) -> None:
    """Once per operation: a CUDA tensor took the torch reference because triton is missing."""
    logging.getLogger(__name__).warning(
        "%s on CUDA runs the torch reference: triton is not importable here (the Triton kernel would be "
        "bit-identical, and faster)",
        what,
    )


def _cuda_kernel_wanted(x, what: str, kernel_ok: bool = True) -> bool:
    """backend 'auto': the Triton kernel for CUDA tensors when triton imports; says so loudly when not."""
    if not (kernel_ok and isinstance(x, torch.Tensor) and x.is_cuda):
        return False
    if not triton_available():
        _warn_cuda_without_triton(what)
        return False
    return True


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")


def _triton_module():
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; it is not importable here")
    return importlib.import_module("megatron_trace.kernels.nvfp4_quantize")


def _require_runnable(x: torch.Tensor, mod) -> None:
    if x.is_cuda or mod.INTERPRETED:
        return
    raise RuntimeError(
        f"backend='triton' runs on CUDA tensors, or on CPU tensors only under the Triton "
        f"interpreter (TRITON_INTERPRET=1 set before triton is imported); got a tensor on "
        f"{x.device}. Use backend='reference' or 'auto' for CPU tensors."
    )


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    four_over_six: bool = False,
    global_scale: torch.Tensor | float | None = None,
    backend: str = "auto",
) -> nvfp4.NVFP4Tensor:
    """NVFP4-quantize x along its last dim; same arguments and bits as `nvfp4.quantize`.

    backend: "auto" uses the Triton kernel for CUDA tensors when triton imports and the torch
    reference otherwise; "triton" forces the kernel (CPU tensors only under TRITON_INTERPRET=1);
    "reference" forces `megatron_trace.fp4.nvfp4.quantize`. The kernel does not implement
    four_over_six: "auto" then uses the reference and "triton" raises.
    """
    _check_backend(backend)
    if backend == "auto":
        backend = "triton" if _cuda_kernel_wanted(x, "NVFP4 quantize", not four_over_six) else "reference"
    if backend == "reference":
        return nvfp4.quantize(
            x,
            global_amax=global_amax,
            per_row_global=per_row_global,
            four_over_six=four_over_six,
            global_scale=global_scale,
        )
    if four_over_six:
        raise ValueError("four_over_six is not implemented by the Triton kernel; use backend='reference'")
    mod = _triton_module()
    if isinstance(x, torch.Tensor):
        _require_runnable(x, mod)
    return mod.quantize_triton(x, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)


# -- NVFP4 on the engine's paths: C on CPU, Triton on CUDA, the reference elsewhere -------------
# On CPU these run cpu_quant.py (this package) when cpu_build.py could build the C kernels (a failed
# build is logged there once and shown in the engine's model_info["cpu_linear"]). The C functions
# decline what they do not take (NaN inputs, whose bytes the reference decides; other layouts),
# which then runs the reference, bit for bit the same as the C result would be.


def nvfp4_quantize_dequantize(
    x: torch.Tensor,
    *,
    per_row_global: bool = False,
    global_scale: torch.Tensor | None = None,
    global_amax: torch.Tensor | None = None,
    dequant_dtype: torch.dtype | None = None,
):
    """(nvfp4.quantize(x, per_row_global=..., global_scale=..., global_amax=...), nvfp4.dequantize(q,
    dequant_dtype), or None for it when dequant_dtype is None), bit for bit, in one pass on CPU (the
    engine's quantizers and the trainer's fake-quant on CPU)."""
    if global_amax is not None and global_scale is not None:
        raise ValueError("pass global_amax or global_scale, not both")
    if x.device.type == "cpu":
        # a 0-d global_amax is S_enc = encode_scale_from_amax(amax), as nvfp4.quantize derives it
        gs = global_scale
        if global_amax is not None and global_scale is None and torch.as_tensor(global_amax).dim() == 0:
            gs = nvfp4.encode_scale_from_amax(torch.as_tensor(global_amax, dtype=torch.float32))
        if global_amax is None or gs is not None:
            out = cpu_quant.quantize_dequantize(
                x, per_row_global=per_row_global, global_scale=gs, dequant_dtype=dequant_dtype
            )
            if out is not None:
                return out
    q = nvfp4_quantize(x, per_row_global=per_row_global, global_scale=global_scale, global_amax=global_amax)
    return q, (None if dequant_dtype is None else nvfp4.dequantize(q, dequant_dtype))


def nvfp4_weight_quantize(w: torch.Tensor, *, global_amax: torch.Tensor | float | None = None) -> nvfp4.NVFP4Tensor:
    """nvfp4.quantize(w, global_amax=...) bit for bit: the C pass on CPU (fp32 or bf16 read as they
    are), the Triton kernel on CUDA, the reference where neither takes it (the weight sync's
    quantizer: fp4.modelopt's `quantizer`)."""
    if w.device.type == "cpu" and global_amax is not None:
        return nvfp4_quantize_dequantize(w, global_amax=torch.as_tensor(global_amax, dtype=torch.float32))[0]
    return nvfp4_quantize(w, global_amax=global_amax)


def nvfp4_dequantize(q: nvfp4.NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nvfp4.dequantize(q, dtype) bit for bit; on CPU one C pass per run of rows that share a global
    scale (a 0-d one, or the engine's per-row [N] of fused shards, constant within each shard)."""
    gs = q.global_scale
    if q.data.device.type == "cpu" and q.data.dim() == 2 and gs.dim() <= 1 and bool(torch.isfinite(gs).all()):
        n = q.data.shape[0]
        if gs.dim() == 0:
            runs = [(0, n)]
        elif gs.shape[0] == n:
            cuts = (torch.nonzero(gs[1:] != gs[:-1]).flatten() + 1).tolist()
            runs = list(zip([0, *cuts], [*cuts, n]))
        else:
            runs = []
        out = torch.empty(n, q.data.shape[1] * 2, dtype=dtype) if runs else None
        for a, b in runs:
            g = gs if gs.dim() == 0 else gs[a]
            rows = cpu_quant.dequantize_rows(q.data[a:b], q.scale[a:b], torch.arange(b - a), g, dtype)
            if rows is None:
                out = None
                break
            out[a:b] = rows
        if out is not None:
            return out
    return nvfp4.dequantize(q, dtype)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t (True for integer tensors). One read: a finite sum proves every element
    finite (NaN and Inf propagate); only a non-finite sum (a NaN or Inf, or an overflow) pays for the
    exact check. The sum stays in t's dtype: asking torch for an fp32 sum of bf16 converts the whole
    tensor first (30x slower on CPU). FP8 (scales: small) is checked exactly."""
    if not t.is_floating_point() or t.device.type == "meta":
        return True
    if t.dtype.itemsize == 1:
        return bool(torch.isfinite(t.float()).all())
    return bool(torch.isfinite(torch.sum(t))) or bool(torch.isfinite(t).all())


def nvfp4_quantize_to_slots(
    x: torch.Tensor, global_scale: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> bool:
    """codes[slots], scales[slots] = nvfp4.quantize(x, global_scale=global_scale) (data, scale)
    without temporaries (megatron_trace/kernels/cpu_quant.py); False, nothing written, where no kernel takes it:
    the caller then writes the reference's result."""
    if x.device.type != "cpu":
        return False
    return cpu_quant.quantize_to_slots(x, global_scale, codes, scales, slots)


def fp8_quantize_to_slots(x: torch.Tensor, codes: torch.Tensor, sdec: torch.Tensor, slots: torch.Tensor) -> bool:
    """codes[slots], sdec[slots] = fp8.quantize(x, dims=2) (data, scale) in one pass (cpu_quant.py);
    False, nothing written, where no kernel takes it: the caller then writes the reference's result."""
    if x.device.type != "cpu":
        return False
    return cpu_quant.fp8_quantize_to_slots(x, codes, sdec, slots)


def nvfp4_dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """nvfp4.dequantize(NVFP4Tensor(codes[idx], scales[idx], global_scale), dtype): the gather and
    dequantize fused on CPU."""
    if codes.device.type == "cpu":
        out = cpu_quant.dequantize_rows(codes, scales, idx, global_scale, dtype)
        if out is not None:
            return out
    return nvfp4.dequantize(nvfp4.NVFP4Tensor(codes[idx], scales[idx], global_scale), dtype)


def mantissa_bits_packed(packed: torch.Tensor) -> torch.Tensor:
    """megatron_trace.fp4.mantissa_bits_packed (same checks and bits), in one C pass on CPU."""
    if packed.device.type == "cpu":
        out = cpu_quant.mantissa_bits_packed(packed)
        if out is not None:
            return out
    return mantissa_bits_packed_reference(packed)


# -- FP4 GEMM, paged FP4 attention, quantize + guidance ---------------------------------------
# Torch references live here (importable without triton); the kernels in megatron_trace/kernels/fp4_gemm.py,
# megatron_trace/kernels/fp4_attention.py and megatron_trace/kernels/nvfp4_quantize.py (guidance option) reproduce them.


def _kernel_module(name: str):
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; it is not importable here")
    return importlib.import_module(f"megatron_trace.kernels.{name}")


def _pick(backend: str, x, name: str, kernel_ok: bool = True):
    """The kernel module for backend ('triton' or CUDA under 'auto'), or None for the reference."""
    _check_backend(backend)
    if backend == "reference" or (backend == "auto" and not _cuda_kernel_wanted(x, name, kernel_ok)):
        return None
    mod = _kernel_module(name)
    _require_runnable(x, mod)
    return mod


def fp4_linear_reference(x, w, bias=None, *, out_dtype=None):
    """F.linear(x, dequantize(w), bias) computed in fp32, cast to out_dtype (default x.dtype)."""
    deq = nvfp4.dequantize(w) if isinstance(w, nvfp4.NVFP4Tensor) else mxfp4.dequantize(w)
    y = torch.nn.functional.linear(
        x.to(torch.float32), deq.to(x.device), None if bias is None else bias.to(torch.float32)
    )
    return y.to(out_dtype or x.dtype)


def fp4_linear(x, w, bias=None, *, out_dtype=None, backend: str = "auto", **cfg):
    """W4A16 linear with an FP4 weight: x [..., K] @ dequantize(w)^T + bias -> [..., N].

    backend as `nvfp4_quantize`; the kernel takes NVFP4 weights only (MXFP4 weights use the
    reference under "auto"). Kernel and reference agree to fp32 summation order (~1e-6 rel).
    """
    mod = _pick(backend, x, "fp4_gemm", isinstance(w, nvfp4.NVFP4Tensor))
    if mod is None:
        return fp4_linear_reference(x, w, bias, out_dtype=out_dtype)
    return mod.fp4_linear_triton(x, w, bias, out_dtype=out_dtype, **cfg)


def fp4_linear_w4a4_reference(x, w, bias=None, *, input_global_scale=None, out_dtype=None):
    if isinstance(x, nvfp4.NVFP4Tensor):  # quantized by the caller
        if input_global_scale is not None:
            raise ValueError("input_global_scale applies to an unquantized x; this x is an NVFP4Tensor already")
        return fp4_linear_reference(nvfp4.dequantize(x), w, bias, out_dtype=out_dtype or torch.float32)
    if input_global_scale is None:
        q = nvfp4.quantize(x, per_row_global=True)
    else:
        q = nvfp4.quantize(x, global_scale=input_global_scale)
    return fp4_linear_reference(nvfp4.dequantize(q), w, bias, out_dtype=out_dtype or x.dtype)


def fp4_linear_w4a4(x, w, bias=None, *, input_global_scale=None, out_dtype=None, backend: str = "auto", **cfg):
    """W4A4 linear: x quantized to NVFP4 per token (or with the static S_enc input_global_scale)
    with the reference rules, then multiplied with the NVFP4 weight; x may be that NVFP4Tensor
    already (the engine quantizes first to record guidance; out_dtype then defaults to float32).
    FP4 MMA is Blackwell-only; the kernel runs bf16 MMAs on exactly dequantized tiles (see
    megatron_trace/kernels/fp4_gemm.py)."""
    device_probe = x.data if isinstance(x, nvfp4.NVFP4Tensor) else x
    mod = _pick(backend, device_probe, "fp4_gemm", isinstance(w, nvfp4.NVFP4Tensor))
    if mod is None:
        return fp4_linear_w4a4_reference(x, w, bias, input_global_scale=input_global_scale, out_dtype=out_dtype)
    return mod.fp4_linear_w4a4_triton(x, w, bias, input_global_scale=input_global_scale, out_dtype=out_dtype, **cfg)


ATTN_FORMATS = ("nvfp4", "mxfp4", "bf16")


def _dequant_pages(codes, scales, gs, fmt):
    if fmt == "nvfp4":
        g = torch.as_tensor(gs if gs is not None else 1.0, dtype=torch.float32, device=codes.device)
        return nvfp4.dequantize(nvfp4.NVFP4Tensor(codes, scales, g.reshape(())))
    if fmt == "mxfp4":
        return mxfp4.dequantize(mxfp4.MXFP4Tensor(codes, scales, 16))
    return codes.to(torch.float32)  # "bf16": codes holds the values [slots, kv_heads, D]


def paged_decode_attention_reference(
    q, k_codes, k_scales, v_codes, v_scales, k_gs, v_gs, slot_table, lens, fmt="nvfp4", sm_scale=None
):
    """Gather each sequence's slots, dequantize with the fp4 reference, fp32 softmax attention.
    q [B, H, D]; pages [slots, kv_heads, D/2] codes + [slots, kv_heads, D/16] scales (fmt "bf16":
    k_codes/v_codes are [slots, kv_heads, D] values, scales unused); H % kv_heads == 0, head h
    reads kv head h // (H / kv_heads). Returns [B, H, D] in q.dtype."""
    if fmt not in ATTN_FORMATS:
        raise ValueError(f"fmt must be one of {ATTN_FORMATS}; got {fmt!r}")
    b_, h_, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.zeros(b_, h_, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        n = int(lens[b])
        if n == 0:
            continue
        sl = slot_table[b, :n].long()
        k = _dequant_pages(k_codes[sl], None if fmt == "bf16" else k_scales[sl], k_gs, fmt)
        v = _dequant_pages(v_codes[sl], None if fmt == "bf16" else v_scales[sl], v_gs, fmt)
        g = h_ // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[b].to(torch.float32), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out.to(q.dtype)


def paged_decode_attention(
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
    backend: str = "auto",
    **cfg,
):
    """Decode attention over paged FP4 K/V, dequantized inside the kernel (arguments as
    `paged_decode_attention_reference`; k_gs/v_gs are the per-layer NVFP4 S_enc, ignored for
    MXFP4). Sequences with lens 0 give zeros."""
    mod = _pick(backend, q, "fp4_attention")
    if mod is None:
        return paged_decode_attention_reference(
            q, k_codes, k_scales, v_codes, v_scales, k_gs, v_gs, slot_table, lens, fmt, sm_scale
        )
    return mod.paged_decode_attention_triton(
        q, k_codes, k_scales, v_codes, v_scales, k_gs, v_gs, slot_table, lens, fmt, sm_scale, **cfg
    )


def nvfp4_quantize_with_guidance_reference(
    x, *, mode="full", global_amax=None, per_row_global=False, global_scale=None
):
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"guidance mode must be one of {GUIDANCE_MODES}; got {mode!r}")
    q = nvfp4.quantize(x, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)
    return q, (q.data if mode == "full" else mantissa_bits(unpack_fp4(q.data)))


def nvfp4_quantize_with_guidance(
    x, *, mode="full", global_amax=None, per_row_global=False, global_scale=None, backend: str = "auto"
):
    """NVFP4-quantize x and capture TRACE guidance in the same pass: returns (NVFP4Tensor,
    guidance), guidance = the packed codes [..., K/2] (mode "full", the same tensor as q.data) or
    the packed mantissa bits [..., K/8] (mode "mantissa", `megatron_trace.fp4.mantissa_bits`
    layout). Bit-identical to nvfp4.quantize + mantissa_bits(unpack_fp4(q.data))."""
    mod = _pick(backend, x, "nvfp4_quantize")
    kw = dict(mode=mode, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)
    if mod is None:
        return nvfp4_quantize_with_guidance_reference(x, **kw)
    return mod.quantize_with_guidance_triton(x, **kw)


def nvfp4_guided_quantize(x, scale, global_scale, *, codes=None, mantissa=None, backend: str = "auto"):
    """TRACE guided rounding, `megatron_trace.fp4.guided_quantize` (same arguments and bits): x
    quantized with the rollout's block scales and S_enc, each code pinned to the rollout's packed
    codes (full) or packed mantissa bits. backend as `nvfp4_quantize` (the trainer's QAT calls
    this, so on CUDA its guided sites run in the Triton kernel)."""
    mod = _pick(backend, x, "nvfp4_quantize")
    if mod is None:
        return guided_quantize(x, scale, global_scale, codes=codes, mantissa=mantissa)
    return mod.guided_quantize_triton(x, scale, global_scale, codes=codes, mantissa=mantissa)


def nvfp4_guided_dequantize_into(
    out: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    mask: torch.Tensor,
    *,
    codes: torch.Tensor | None = None,
    mantissa: torch.Tensor | None = None,
    rtn_codes: torch.Tensor | None = None,
    agree_codes: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[int, int, int]:
    """The trainer's guided QAT site in one call: the rows of out [..., K] that mask (over x's
    leading rows) selects become the dequantized TRACE rounding of x (`nvfp4_guided_quantize`, then
    nvfp4.dequantize), the others keep out's values (round-to-nearest). Returns, over the selected
    rows, (codes differing from rtn_codes, codes equal to agree_codes with -0 and +0 one code,
    elements guided); a count whose codes are not given is 0. On CPU one C pass (cpu_quant.py), no
    fp32 temporaries; elsewhere the guided quantizer (Triton on CUDA) and torch ops, the same bits."""
    _check_backend(backend)
    if x.device.type == "cpu" and backend == "auto":
        kw = dict(codes=codes, mantissa=mantissa, rtn_codes=rtn_codes, agree_codes=agree_codes)
        got = cpu_quant.guided_dequantize_into(out, x, scale, global_scale, mask, **kw)
        if got is not None:
            return got
    g = nvfp4_guided_quantize(x, scale, global_scale, codes=codes, mantissa=mantissa, backend=backend)
    m = mask.reshape(mask.shape + (1,) * (x.dim() - mask.dim()))
    out.copy_(torch.where(m, nvfp4.dequantize(g), out))
    sel = mask.reshape(-1) if mask.dim() == 1 else mask
    got = unpack_fp4(g.data)[sel]
    changed = int((got != unpack_fp4(rtn_codes)[sel]).sum()) if rtn_codes is not None else 0
    agree = 0
    if agree_codes is not None:
        ref = unpack_fp4(agree_codes)[sel]
        agree = int((torch.where(got == 8, 0, got) == torch.where(ref == 8, 0, ref)).sum())
    return changed, agree, got.numel()
