"""What this CPU can do, decided once per process: the ISA the C kernels are built for, whether
oneDNN packs bf16 weights, and whether a bf16 GEMM runs in bf16 or in fp32 on its up-cast.

    MEGATRON_TRACE_CPU_ISA = native | avx2 | baseline        (read here, once, at import)
      ├─ avx2 / baseline cap torch's, oneDNN's and MKL's own dispatch (ATEN_CPU_CAPABILITY,
      │  ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), set before torch runs its first op
      │  (`megatron_trace` and `sglang_backend` import this module first), so an AVX-512 machine
      │  runs as an AVX2-only or a baseline one
      └─ routes() ─► CpuRoutes (resolved on first use, after torch is imported)
           march        cpu_build's -march: native, x86-64-v3 (AVX2+FMA+F16C), x86-64 (baseline)
           onednn_bf16  oneDNN's packed bf16 weights (onednn_linear.py), where oneDNN has a bf16
                        path on this CPU (AVX512BW/VL/DQ, AVX-NE-CONVERT or AMX)
           bf16_gemm    "bf16": torch's bf16 GEMMs; "fp32": without a bf16 path they run ~5x slower
                        than fp32 (the AVX2 VM: 10 GFLOP/s against fp32's 50 at 256 rows), so a
                        bf16 GEMM multiplies the fp32 up-casts of its bf16 operands and rounds its
                        output to bf16: what a bf16 GEMM computes, summed in another order
           describe()   one line, for the engine's model_info["cpu_routes"] and the run's plan line
Every route falls back to one with the same results (oneDNN's packed GEMM and F.linear give the
same bits; the C kernels' ISA branches give their references' bits or state their tolerance), and
is chosen here by capability, never by an op raising inside a batch.

This module is the one place that reads MEGATRON_TRACE_CPU_ISA (shared/DESIGN.md: Contracts).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass

ENV = "MEGATRON_TRACE_CPU_ISA"
SETTINGS = ("native", "avx2", "baseline")
# What avx2 / baseline cap the libraries' own dispatch to. baseline: the lowest each library takes
# (oneDNN SSE4.1, MKL SSE4.2; torch's DEFAULT kernels are the compiler's x86-64 baseline).
_CAPS = {
    "x86_64": {
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        "baseline": {
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        },
    },
    "aarch64": {"baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "ASIMD"}},
}
# torch.backends.cpu.get_cpu_capability() under each cap
_TORCH_CAPPED = {"avx2": "AVX2", "baseline": "DEFAULT"}
# the C kernels' target per setting (cpu_build.py): x86-64-v3 is AVX2 + FMA + F16C (+ BMI, MOVBE)
MARCH = {
    "x86_64": {"native": "-march=native", "avx2": "-march=x86-64-v3", "baseline": "-march=x86-64"},
    "aarch64": {"native": "-march=native", "baseline": "-march=armv8-a"},
}
# what the CPU must have for a setting (its /proc/cpuinfo flags)
_NEEDS = {"avx2": ("avx2", "fma", "f16c")}
_log = logging.getLogger(__name__)


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo `flags` on x86, `Features` on Arm); empty elsewhere."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _read_setting(environ=os.environ) -> str:
    value = environ.get(ENV, "native").strip().lower() or "native"
    if value not in SETTINGS:
        raise ValueError(f"{ENV}={environ.get(ENV)!r}: must be one of {', '.join(SETTINGS)}")
    m = machine()
    if value != "native" and value not in MARCH.get(m, {}):
        raise ValueError(f"{ENV}={value} is an x86-64 setting; this machine is {m} (allowed here: native, baseline)")
    missing = [f for f in _NEEDS.get(value, ()) if cpu_flags() and f not in cpu_flags()]
    if missing:
        raise ValueError(f"{ENV}={value}: this CPU lacks {', '.join(missing)}; use {ENV}=baseline")
    return value


def _apply_caps(setting: str, environ=os.environ) -> None:
    """Caps the libraries' dispatch for a non-native setting, in the environment (inherited by every
    process this one starts: torchrun workers, SGLang servers). A cap the environment already sets
    otherwise is refused: the two would disagree about what this CPU is."""
    for key, value in _CAPS.get(machine(), {}).get(setting, {}).items():
        have = environ.get(key)
        if have is not None and have.lower() != value.lower():
            raise ValueError(f"{ENV}={setting} caps {key} to {value}, but the environment sets {key}={have}")
        environ[key] = value


SETTING = _read_setting()
_apply_caps(SETTING)


@dataclass(frozen=True)
class CpuRoutes:
    setting: str  # MEGATRON_TRACE_CPU_ISA
    machine: str
    torch_isa: str  # torch.backends.cpu.get_cpu_capability()
    march: str  # the C kernels' target (cpu_build.py)
    onednn_bf16: str | None  # None: oneDNN packs bf16 weights; else why it cannot
    bf16_gemm: str  # "bf16" or "fp32" (on the up-cast, rounded to bf16)

    def describe(self) -> str:
        gemm = (
            "bf16 GEMMs in bf16"
            if self.bf16_gemm == "bf16"
            else "bf16 GEMMs in fp32 on the up-cast, rounded to bf16 (no bf16 GEMM on this CPU)"
        )
        packing = "oneDNN-packed bf16 weights" if self.onednn_bf16 is None else "no oneDNN packing"
        where = f"{ENV}={self.setting} ({self.machine}, torch {self.torch_isa})"
        return f"{where}; C kernels {self.march}; {gemm}; {packing}"


@functools.lru_cache(maxsize=None)
def routes() -> CpuRoutes:
    """This process's routes, resolved once (the first caller imports torch). A non-native setting
    whose caps torch did not take (an op ran before this module was imported) is an error."""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    want = _TORCH_CAPPED.get(SETTING)
    if want is not None and isa != want:
        raise RuntimeError(
            f"{ENV}={SETTING} caps torch to {want}, but torch dispatches {isa}: torch ran an op before the cap "
            f"was set. Set {ENV} in the environment before Python starts, and import megatron_trace before "
            "running torch ops"
        )
    bf16_hw = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    r = CpuRoutes(
        SETTING,
        machine(),
        isa,
        MARCH.get(machine(), {}).get(SETTING, ""),
        _onednn_packing_missing(torch, bf16_hw),
        # without oneDNN's bf16 path torch's own bf16 GEMM is several times slower than fp32
        "bf16" if bf16_hw else "fp32",
    )
    full = r.setting == "native" and r.bf16_gemm == "bf16" and r.onednn_bf16 is None
    level = logging.INFO if full else logging.WARNING
    _log.log(level, "CPU routes: %s", r.describe())
    return r


def _onednn_packing_missing(torch, bf16_hw: bool) -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch build lacks torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise"
    if not bf16_hw:
        return (
            f"oneDNN has no bf16 path on this CPU under {ENV}={SETTING} "
            "(it needs AVX512BW/VL/DQ, AVX-NE-CONVERT or AMX)"
        )
    return None


def upcasts(x, weight) -> bool:
    """Whether x . weight^T, a CPU bf16 GEMM, runs in fp32 on this CPU (routes().bf16_gemm)."""
    import torch

    return x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and routes().bf16_gemm == "fp32"


def gemm_dtype(x):
    """The dtype a GEMM over x (with a weight of x's dtype) multiplies in: fp32 for a CPU bf16 GEMM
    without bf16 hardware, else x's. For callers whose GEMM is someone else's (Megatron's linear)."""
    import torch

    return torch.float32 if upcasts(x, x) else x.dtype


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) by this CPU's route: a bf16 GEMM without bf16 hardware multiplies in
    fp32 and rounds the output to bf16 once. Under autograd (the trainer) on the operands' fp32
    up-casts, so the backward's GEMMs run in fp32 too; without it (the engine) through mm_fp32's tiles."""
    import torch
    import torch.nn.functional as F

    if not upcasts(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    y = mm_fp32(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias)
    return y.view(*x.shape[:-1], weight.shape[0])


TILE_ELEMENTS = 1 << 22  # fp32 elements of one operand tile and of one product tile: 16 MB each


def mm(a, b, out=None):
    """torch.mm(a, b, out=out) by this CPU's route: mm_fp32 where a bf16 GEMM runs in fp32
    (routes().bf16_gemm). Not differentiable (the chunked LM head calls it inside its own autograd
    function)."""
    import torch

    if not upcasts(a, b):
        return torch.mm(a, b, out=out)
    return mm_fp32(a, b, out)


def mm_fp32(a, b, out=None, bias=None, tile_elements: int | None = None):
    """a @ b (+ bias) for bf16 a [M, K], b [K, N]: summed in fp32, rounded once to bf16 into `out`.
    The larger operand is up-cast tile by tile into one reused buffer, always along its contiguous
    dimension (W[j:j+w] of a transposed weight, whole rows otherwise), never copied whole: b's columns
    (or for a row-major b its rows, the partial products summed in an fp32 accumulator) or a's rows.
    A call's pages are its few buffers (the chunked LM head calls it per chunk under the engine's heap
    policy, which keeps freed memory)."""
    import torch

    tile_elements = tile_elements or TILE_ELEMENTS
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    fb = None if bias is None else bias.float()
    if n >= m and b.stride(0) == 1 and n > 1:  # b, a transposed weight, is the larger: its column tiles
        step = max(1, min(n, tile_elements // max(k, m)))
        af, tile, prod = a.float(), torch.empty(k * step), torch.empty(m * step)
        for j in range(0, n, step):
            w = min(step, n - j)
            p = torch.mm(af, _up_cast_into(tile, b[:, j : j + w]), out=prod[: m * w].view(m, w))
            out[:, j : j + w].copy_(p if fb is None else p.add_(fb[j : j + w]))
    elif n >= m:  # b, row-major, is the larger: its row tiles, the partial products summed in fp32
        step = max(1, min(k, tile_elements // max(n, m)))
        acc, tile, a_tile = torch.zeros(m, n), torch.empty(step * n), torch.empty(m * step)
        for i in range(0, k, step):
            w = min(step, k - i)
            at = a_tile[: m * w].view(m, w).copy_(a[:, i : i + w])
            acc.addmm_(at, _up_cast_into(tile, b[i : i + w]))
        out.copy_(acc if fb is None else acc.add_(fb))
    else:  # a is: its row tiles against all of b
        step = max(1, min(m, tile_elements // max(k, n)))
        bf, tile, prod = b.float(), torch.empty(k * step), torch.empty(n * step)
        for i in range(0, m, step):
            w = min(step, m - i)
            p = torch.mm(_up_cast_into(tile, a[i : i + w]), bf, out=prod[: w * n].view(w, n))
            out[i : i + w].copy_(p if fb is None else p.add_(fb))
    return out


def _up_cast_into(buf, src):
    """src (2-D bf16) as fp32 in buf's first elements, laid out as src is (row- or column-major: a
    transposed weight's tile is copied as contiguous rows, not gathered)."""
    r, c = src.shape
    if src.stride(0) == 1 and c > 1:  # column-major (e.g. W[j:j+w].t())
        return buf[: r * c].view(c, r).t().copy_(src)
    return buf[: r * c].view(r, c).copy_(src)
