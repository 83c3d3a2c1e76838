"""Backend selection between the Triton kernels and the torch references.

triton is imported lazily (first `triton_available()` or kernel call), never at import time.
"""
from __future__ import annotations

import functools
import importlib

import torch

from megatron_trace.fp4 import nvfp4

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


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")


def _triton_module():
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; it is not importable here")
    return importlib.import_module("kernels.nvfp4_quantize")


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
        use_triton = (
            isinstance(x, torch.Tensor) and x.is_cuda and not four_over_six and triton_available()
        )
        backend = "triton" if use_triton else "reference"
    if backend == "reference":
        return nvfp4.quantize(
            x, global_amax=global_amax, per_row_global=per_row_global, four_over_six=four_over_six,
            global_scale=global_scale,
        )
    if four_over_six:
        raise ValueError("four_over_six is not implemented by the Triton kernel; use backend='reference'")
    mod = _triton_module()
    if isinstance(x, torch.Tensor):
        _require_runnable(x, mod)
    return mod.quantize_triton(x, global_amax=global_amax, per_row_global=per_row_global, global_scale=global_scale)
