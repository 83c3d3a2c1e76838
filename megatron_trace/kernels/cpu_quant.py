"""The C implementation of NVFP4 quantize / dequantize / mantissa packing for the engine on CPU
(`cpu_quant.c`), bit-identical to megatron_trace.fp4's references.

Callers go through `megatron_trace.kernels.dispatch` (nvfp4_quantize_dequantize, nvfp4_quantize_to_slots,
nvfp4_dequantize_rows, mantissa_bits_packed, nvfp4_guided_dequantize_into), which picks these on CPU
when the kernels are built.
Each function here returns None (or False) for what it does not take, e.g. a NaN input, whose
bytes the reference decides; the dispatcher then runs the reference.
"""

from __future__ import annotations

import torch

from megatron_trace.fp4 import nvfp4

from . import cpu_build


def quantize_dequantize(
    x: torch.Tensor,
    *,
    per_row_global: bool = False,
    global_scale: torch.Tensor | None = None,
    dequant_dtype: torch.dtype | None = None,
    lib=None,
):
    """(nvfp4.quantize(x, per_row_global=..., global_scale=...), its nvfp4.dequantize(., dequant_dtype)
    or None when dequant_dtype is None), bit for bit, in one pass; None when this cannot take x."""
    lib = lib or cpu_build.library()
    gs_t = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32)
    ok = (
        lib is not None
        and x.device.type == "cpu"
        and x.is_floating_point()
        and x.dim() > 0
        and x.shape[-1] % nvfp4.BLOCK == 0
        and per_row_global != (gs_t is not None)
        and (gs_t is None or (gs_t.dim() == 0 and gs_t.device.type == "cpu"))
    )
    if ok and gs_t is not None:
        g = float(gs_t)
        ok = g > 0 and g != float("inf")
    if not ok:
        return None
    # a decode step calls this dozens of times: skip every no-op torch call; fp32 and bf16 are read
    # and the dequantized values written in their own dtype (no conversion passes around the kernel)
    native = x.dtype in (torch.float32, torch.bfloat16)
    xf = x.contiguous() if native else x.to(torch.float32).contiguous()
    lead, k = xf.shape[:-1], xf.shape[-1]
    data = torch.empty((*lead, k // 2), dtype=torch.uint8)
    scale = torch.empty((*lead, k // nvfp4.BLOCK), dtype=torch.uint8)
    gs_out = torch.empty(lead, dtype=torch.float32) if gs_t is None else gs_t
    xhat = None
    if dequant_dtype is not None:
        direct = dequant_dtype in (torch.float32, torch.bfloat16)
        xhat = torch.empty(xf.shape, dtype=dequant_dtype if direct else torch.float32)
    if lib.nvfp4_qdq(xf, gs_t, data, scale, gs_out if gs_t is None else None, xhat):
        return None  # a NaN: the reference decides its bytes
    if xhat is not None and xhat.dtype is not dequant_dtype:
        xhat = xhat.to(dequant_dtype)
    return nvfp4.NVFP4Tensor(data, scale, gs_out), xhat


def quantize_to_slots(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    lib=None,
) -> bool:
    """codes[slots], scales[slots] = nvfp4.quantize(x, global_scale=global_scale) (data, scale), bit
    for bit, without temporaries: x [T, ..., K], codes [S, ..., K/2] and scales [S, ..., K/16]
    contiguous, a finite positive 0-d fp32 global scale, int64 slots. False (nothing written) when
    this cannot take it (other devices or layouts, NaN input, an unusable S_enc)."""
    lib = lib or cpu_build.library()
    if (
        lib is None
        or x.device.type != "cpu"
        or not codes.is_contiguous()
        or not scales.is_contiguous()
        or global_scale.dim() != 0
        or global_scale.dtype is not torch.float32
        or slots.dtype is not torch.int64
        or x.shape[1:-1] != codes.shape[1:-1]
        or x.shape[-1] != 2 * codes.shape[-1]
        or x.shape[-1] % nvfp4.BLOCK
        or slots.numel() != x.shape[0]
        or not slots.is_contiguous()
    ):
        return False
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    n = xf[0].numel() if xf.shape[0] else 0
    rc = lib.nvfp4_quantize_to_slots(xf, n, global_scale, slots, codes, scales)
    if rc == 2:
        raise IndexError(f"KV slot out of range for {codes.shape[0]} slots")
    return rc == 0  # NaN (1) or an unusable S_enc (3): the reference decides what to write


def fp8_quantize_to_slots(
    x: torch.Tensor, codes: torch.Tensor, sdec: torch.Tensor, slots: torch.Tensor, lib=None
) -> bool:
    """codes[slots], sdec[slots] = fp8.quantize(x, dims=2) (data, scale), bit for bit, without
    temporaries: x [T, heads, D], codes uint8 [S, heads, D] and sdec fp32 [S] contiguous, int64 slots.
    False (nothing written) when this cannot take it (other devices or layouts)."""
    lib = lib or cpu_build.library()
    if (
        lib is None
        or x.device.type != "cpu"
        or x.dim() != 3
        or not codes.is_contiguous()
        or not sdec.is_contiguous()
        or codes.dtype is not torch.uint8
        or sdec.dtype is not torch.float32
        or slots.dtype is not torch.int64
        or not slots.is_contiguous()
        or x.shape[1:] != codes.shape[1:]
        or sdec.shape != codes.shape[:1]
        or slots.numel() != x.shape[0]
    ):
        return False
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    if lib.fp8_quantize_to_slots(xf, x[0].numel() if x.shape[0] else 0, slots, codes, sdec) == 2:
        raise IndexError(f"KV slot out of range for {codes.shape[0]} slots")
    return True


def dequantize_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    idx: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype,
    lib=None,
) -> torch.Tensor | None:
    """nvfp4.dequantize(NVFP4Tensor(codes[idx], scales[idx], global_scale), dtype) for a 0-d global
    scale and contiguous codes [S, ..., K/2] / scales [S, ..., K/16]: the gather and dequantize fused.
    None when this cannot take them."""
    lib = lib or cpu_build.library()
    if (
        lib is None
        or codes.device.type != "cpu"
        or not codes.is_contiguous()
        or not scales.is_contiguous()
        or global_scale.dim() != 0
    ):
        return None
    idx = idx.to(torch.int64).contiguous()
    row = codes[0].numel() * 2
    out = torch.empty(*idx.shape, *codes.shape[1:-1], codes.shape[-1] * 2, dtype=torch.float32)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= codes.shape[0]):
        raise IndexError(f"slot index out of range for {codes.shape[0]} slots")
    lib.nvfp4_gather_dequant(codes, scales.view(torch.uint8), idx, row, float(nvfp4.decode_scale(global_scale)), out)
    return out.to(dtype)


def mantissa_bits_packed(packed: torch.Tensor, lib=None) -> torch.Tensor | None:
    """fp4.guided.mantissa_bits_packed of a CPU uint8 [..., K/2] tensor (K % 8 == 0) in one C pass;
    None when this cannot take it."""
    lib = lib or cpu_build.library()
    if (
        lib is None
        or packed.device.type != "cpu"
        or packed.dtype != torch.uint8
        or packed.dim() == 0
        or packed.shape[-1] % 4
    ):
        return None
    src = packed.contiguous()
    out = torch.empty((*src.shape[:-1], src.shape[-1] // 4), dtype=torch.uint8)
    lib.nvfp4_mantissa_bits(src, out)
    return out


def guided_dequantize_into(
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
    lib=None,
) -> tuple[int, int, int] | None:
    """The rows of out [..., K] that mask ([lead0] or out's leading shape) selects, set to
    nvfp4.dequantize(fp4.guided.guided_quantize(x, scale, global_scale, codes=, mantissa=)) bit for
    bit, in one pass that reads x and writes out in their own dtype (fp32 or bf16); the others left.
    Returns (codes differing from rtn_codes', codes equal to agree_codes' with both zeros one code,
    elements guided) over those rows (0 for a tensor not given), or None (nothing written) when this
    cannot take them."""
    lib = lib or cpu_build.library()
    k = x.shape[-1] if x.dim() else 0
    lead = tuple(x.shape[:-1])
    packed = (codes, k // 2) if codes is not None else (mantissa, k // 8)
    counted = [t for t in (rtn_codes, agree_codes) if t is not None]
    tensors = [x, out, scale, mask, packed[0], *counted]
    if (
        lib is None
        or (codes is None) == (mantissa is None)
        or any(t.device.type != "cpu" for t in tensors)
        or x.dtype not in (torch.float32, torch.bfloat16)
        or out.dtype not in (torch.float32, torch.bfloat16)
        or not k
        or k % nvfp4.BLOCK
        or out.shape != x.shape
        or not out.is_contiguous()
        or tuple(scale.shape) != (*lead, k // nvfp4.BLOCK)
        or tuple(packed[0].shape) != (*lead, packed[1])
        or any(tuple(t.shape) != (*lead, k // 2) for t in counted)
        or any(t.dtype != torch.uint8 for t in (scale, packed[0], *counted))
    ):
        return None
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if gs.dim() and tuple(gs.shape) != lead:
        return None
    gs = gs.reshape(1) if not gs.dim() else gs.contiguous()
    m = mask.reshape(mask.shape + (1,) * (len(lead) - mask.dim())).expand(lead)
    counts = torch.zeros(3, dtype=torch.int64)
    lib.nvfp4_guided_dq(
        x.contiguous(),
        scale.contiguous(),
        gs,
        None if codes is None else codes.contiguous(),
        None if mantissa is None else mantissa.contiguous(),
        m.to(torch.uint8).contiguous(),
        None if rtn_codes is None else rtn_codes.contiguous(),
        None if agree_codes is None else agree_codes.contiguous(),
        out,
        counts,
    )
    changed, agree, guided = counts.tolist()
    return changed, agree, guided
