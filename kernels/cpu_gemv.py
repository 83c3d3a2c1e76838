"""Weight-streaming linears for decode on CPU: NVFP4 (ModelOpt layout, read as stored) and BF16.

The C sources are `cpu_gemv.c` (kernels, AVX-512 or portable scalar, chosen by the compiler's
-march=native target) and `cpu_gemv_parallel.cpp` (at::parallel_for over output rows, so
torch.get_num_threads() applies). They are built once by torch.utils.cpp_extension (ninja) into a
cache directory and called through ctypes. Without a compiler or ninja, `available()` is False,
`unavailable_reason()` says why, and the engine logs it and reports it in model_info (it then
multiplies dequantized weights with torch: same numbers to fp32 rounding, slower decode).

Numerics: y = x . dequantize(W)^T with fp32 accumulation, reassociated per NVFP4 block (see
cpu_gemv.c), so results equal fp4's dequantize + an fp32 matmul to fp32 rounding.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
_SOURCES = ("cpu_gemv.c", "cpu_gemv_w4a4.c", "cpu_gemv_parallel.cpp")
CACHE_DIR = Path.home() / ".cache" / "megatron_trace" / "cpu_gemv"
ENABLED = True  # set False (before first use) to force the torch matmul, e.g. when bisecting
_state: dict = {}
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _build(portable: bool = False) -> ctypes.CDLL:
    """The library for this machine (-march=native: AVX-512 where the compiler targets it), or with
    portable=True for the compiler's baseline target (the scalar C paths; what tests check too)."""
    from torch.utils import cpp_extension

    # One build directory per source version, torch version and target: edits or a torch upgrade rebuild.
    stamp = "-".join(str(int((_HERE / s).stat().st_mtime)) for s in _SOURCES + ("cpu_gemv.h",))
    target = "portable" if portable else "native"
    build = CACHE_DIR / f"torch{torch.__version__.replace('+', '_')}-{target}-{stamp}"
    build.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno"] + ([] if portable else ["-march=native"])
    path = cpp_extension.load(f"megatron_trace_cpu_gemv_{target}", [str(_HERE / s) for s in _SOURCES],
                              extra_cflags=flags, extra_include_paths=[str(_HERE)], build_directory=str(build),
                              is_python_module=False, verbose=False)
    lib = ctypes.CDLL(path if isinstance(path, str) else str(build / f"megatron_trace_cpu_gemv_{target}.so"))
    lib.gemv_nvfp4.argtypes = [_P, _C, _I, _I, _P, _P, _P, _P, _P, _C, _I]
    lib.gemv_bf16.argtypes = [_P, _C, _I, _I, _P, _P, _P, _C, _I]
    lib.gemv_w4a4.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _C, _I]
    lib.gemv_nvfp4.restype = lib.gemv_bf16.restype = lib.gemv_w4a4.restype = ctypes.c_int
    lib.gemv_isa.restype = lib.gemv_w4a4_isa.restype = ctypes.c_char_p
    return lib


def _lib():
    if "lib" not in _state:
        lib, why = None, None
        if not ENABLED:
            why = "disabled (kernels.cpu_gemv.ENABLED = False)"
        else:
            try:
                lib = _build()
            except Exception as e:  # no compiler / ninja: say so, the torch path serves (slower)
                why = f"build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e})"
                logging.getLogger(__name__).warning(
                    "weight-streaming CPU linears unavailable: %s; decode multiplies dequantized weights with "
                    "torch instead (same numbers, slower). Needs a C/C++ compiler and ninja (pip install ninja).",
                    why)
        _state["lib"], _state["why"] = lib, why
    return _state["lib"]


def available() -> bool:
    return _lib() is not None


def unavailable_reason() -> str | None:
    """None when the kernels are built, else why not (for model_info and benchmark columns)."""
    _lib()
    return _state["why"]


def portable_library() -> ctypes.CDLL:
    """The baseline-target build (scalar C), for tests: pass it as `lib=` to the functions below."""
    if "portable" not in _state:
        _state["portable"] = _build(portable=True)
    return _state["portable"]


def isa() -> str | None:
    """The code paths the build selected ("avx512+bf16,w4a4:avx512-vnni" down to "scalar,w4a4:scalar"),
    None when not built."""
    lib = _lib()
    return None if lib is None else f"{lib.gemv_isa().decode()},w4a4:{lib.gemv_w4a4_isa().decode()}"


def _bias(bias: torch.Tensor | None):
    return None if bias is None else bias.float().contiguous()


def _check_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"{what}: x must be a CPU float32/bfloat16 [M, {k}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return x.contiguous()


def nvfp4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, global_decode: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, lib=None) -> torch.Tensor:
    """x [M, K] . W^T for W NVFP4 as stored: codes uint8 [N, K/2], E4M3 scales uint8 [N, K/16],
    global_decode fp32 [N] (or a scalar: one for all rows). Output dtype: x's unless given."""
    n, k2 = codes.shape
    k = 2 * k2
    if k % 16 or codes.dtype != torch.uint8 or tuple(scales.shape) != (n, k // 16):
        raise ValueError(f"nvfp4_linear: codes must be uint8 [N, K/2] with K a multiple of 16 and scales "
                         f"[N, K/16]; got codes {codes.dtype} {tuple(codes.shape)}, scales {tuple(scales.shape)}")
    x = _check_x(x, k, "nvfp4_linear")
    gdec = global_decode.float().reshape(-1).expand(n).contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype)
    b, codes, scales = _bias(bias), codes.contiguous(), scales.contiguous().view(torch.uint8)
    rc = (lib or _lib()).gemv_nvfp4(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], k, codes.data_ptr(),
                           scales.data_ptr(), gdec.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
                           int(out.dtype == torch.bfloat16), n)
    if rc:
        raise MemoryError(f"nvfp4_linear: no memory for the laid-out activations [{x.shape[0]}, {k}]")
    return out


def w4a4_linear(act_codes: torch.Tensor, act_scales: torch.Tensor, act_global_decode: torch.Tensor,
                codes: torch.Tensor, scales: torch.Tensor, global_decode: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, lib=None) -> torch.Tensor:
    """NVFP4 activations (codes uint8 [M, K/2], E4M3 scales [M, K/16], decode global scale [M] or a
    scalar) times an NVFP4 weight as in nvfp4_linear: dequantize(a) . dequantize(W)^T to fp32 rounding."""
    n, k2 = codes.shape
    m, k = act_codes.shape[0], 2 * k2
    shapes_ok = (act_codes.dim() == 2 and act_codes.shape[1] == k2 and tuple(act_scales.shape) == (m, k // 16)
                 and tuple(scales.shape) == (n, k // 16) and k % 16 == 0)
    if not shapes_ok or act_codes.dtype != torch.uint8 or codes.dtype != torch.uint8:
        raise ValueError(f"w4a4_linear: needs uint8 codes [M, K/2] / [N, K/2] and scales [M, K/16] / [N, K/16] "
                         f"with K a multiple of 16; got activation {tuple(act_codes.shape)} {tuple(act_scales.shape)}, "
                         f"weight {tuple(codes.shape)} {tuple(scales.shape)}")
    adec = act_global_decode.float().reshape(-1).expand(m).contiguous()
    gdec = global_decode.float().reshape(-1).expand(n).contiguous()
    out = torch.empty(m, n, dtype=out_dtype)
    b = _bias(bias)
    ac, as_ = act_codes.contiguous(), act_scales.contiguous().view(torch.uint8)
    codes, scales = codes.contiguous(), scales.contiguous().view(torch.uint8)
    rc = (lib or _lib()).gemv_w4a4(ac.data_ptr(), as_.data_ptr(), adec.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(),
                          gdec.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(),
                          int(out.dtype == torch.bfloat16), n)
    if rc:
        raise MemoryError(f"w4a4_linear: no memory for the laid-out activations [{m}, {k}]")
    return out


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, lib=None) -> torch.Tensor:
    """x [M, K] . weight^T for a bf16 weight [N, K], fp32 accumulation."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError(f"bf16_linear: weight must be bfloat16 [N, K] with K even, got {weight.dtype} {tuple(weight.shape)}")
    x, weight = _check_x(x, k, "bf16_linear"), weight.contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype)
    b = _bias(bias)
    rc = (lib or _lib()).gemv_bf16(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], k, weight.data_ptr(),
                          None if b is None else b.data_ptr(), out.data_ptr(), int(out.dtype == torch.bfloat16), n)
    if rc:
        raise MemoryError(f"bf16_linear: no memory for the laid-out activations [{x.shape[0]}, {k}]")
    return out

