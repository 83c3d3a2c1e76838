"""Fused CPU fast paths of NVFP4, bit-identical to `nvfp4.quantize` / `nvfp4.dequantize`.

A rollout decode step quantizes a few dozen tiny activations; the torch reference spends ~50
small ops on each. These helpers do quantize (+ dequantize) of a whole tensor, and the
gather + dequantize of FP4 KV slots, in one C call each. The C source below is built once
with the system C compiler into ~/.cache/megatron_trace (`CACHE_DIR`) and loaded with ctypes; it repeats the reference's fp32 steps in
the same order (no FMA contraction, no fast-math), so every byte and float matches. Without
a compiler, on non-CPU tensors, on NaN inputs, or with `ENABLED = False`, the helpers fall back
to the reference itself.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from . import nvfp4
from .codecs import _boundaries, e2m1_grid

# E2M1 decoding for C: this library's dequantizers and the engine's fused kernels (kernels/cpu_fused.py)
# compile this one definition, so FP4 decoding lives here only.
E2M1_DECODE_C = r"""
#include <stdint.h>
#include <string.h>
/* GCC/Clang vector extensions: explicit 8-lane SIMD that stays portable (AVX on x86, NEON pairs on Arm). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* 16 E2M1 values of 8 packed bytes (low nibble first) as fp32, built from the code bits: sign bit 3,
   exponent bits 2-1 (0: subnormal, 0 or 0.5), mantissa bit 0; equal to e2m1_grid, -0.0 included. */
static inline v8u e2m1_bits(v8u n) {
    const v8u sign = (n >> 3) << 31, e = (n >> 1) & 3, m = n & 1;
    const v8u normal = sign | ((e + 126) << 23) | (m << 22), sub = sign | (m * 0x3F000000u);
    const v8u is_normal = (v8u)(e != 0);
    return (normal & is_normal) | (sub & ~is_normal);
}
static inline void e2m1x16(const uint8_t* c, v8f* lo, v8f* hi) {
    v8b b;
    memcpy(&b, c, sizeof b);
    const v8u u = __builtin_convertvector(b, v8u), n0 = e2m1_bits(u & 15), n1 = e2m1_bits(u >> 4);
    const v8u a = SHUF(n0, n1, 0, 8, 1, 9, 2, 10, 3, 11), z = SHUF(n0, n1, 4, 12, 5, 13, 6, 14, 7, 15);
    memcpy(lo, &a, sizeof a);
    memcpy(hi, &z, sizeof z);
}
"""

_SRC = E2M1_DECODE_C + r"""
#include <stdint.h>
#include <math.h>
#include <float.h>
#include <string.h>

static inline uint8_t e4m3_enc(float v) {  /* v >= 0, not NaN: clamp to 448, round to nearest even */
    if (v > 448.f) v = 448.f;
    if (v < 0.015625f) return (uint8_t)nearbyintf(v * 512.f);  /* subnormals: steps of 2^-9 */
    int e; float m = frexpf(v, &e);   /* v = m * 2^e, m in [0.5, 1) */
    float mant = nearbyintf(m * 16.f); /* 3 mantissa bits, 8..16 */
    int E = e - 1;
    if (mant >= 16.f) { mant = 8.f; E += 1; }
    return (uint8_t)(((E + 7) << 3) | ((int)mant - 8));
}

/* x [R, K] -> data [R, K/2], scale [R, K/16], gs_out [R] (per-row S_enc; gs_in NULL) and optionally
   xhat [R, K] (the dequantized values). Returns 1 (outputs undefined) when x holds a NaN.
   The per-element loops are branch-free so the compiler vectorizes them; every value is computed
   by the same IEEE operations in the same order as the scalar reference. */
int nvfp4_qdq(const float* x, int64_t R, int64_t K, const float* gs_in, const float* lut, const float* grid,
              const float* bnd, float one_sixth, uint8_t* data, uint8_t* scale, float* gs_out, float* xhat) {
    const int64_t nb = K / 16;
    const float b0 = bnd[0], b1 = bnd[1], b2 = bnd[2], b3 = bnd[3], b4 = bnd[4], b5 = bnd[5], b6 = bnd[6];
    float bam[nb > 0 ? nb : 1];
    for (int64_t r = 0; r < R; r++) {
        const float* xr = x + r * K;
        float ramax = 0.f;
        int nan = 0;
        for (int64_t b = 0; b < nb; b++) {  /* block amax: two 8-lane halves, then 8 lanes */
            v8u u0, u1;
            memcpy(&u0, xr + b * 16, sizeof u0);
            memcpy(&u1, xr + b * 16 + 8, sizeof u1);
            u0 &= 0x7fffffffu;
            u1 &= 0x7fffffffu;
            v8f a0, a1;
            memcpy(&a0, &u0, sizeof a0);
            memcpy(&a1, &u1, sizeof a1);
            const v8u bad = (v8u)(a0 != a0) | (v8u)(a1 != a1), gt = (v8u)(a0 > a1);
            const v8u mu = (u0 & gt) | (u1 & ~gt);
            float mv[8];
            memcpy(mv, &mu, sizeof mv);
            float m = 0.f;
            for (int j = 0; j < 8; j++) { m = mv[j] > m ? mv[j] : m; nan |= bad[j] != 0; }
            bam[b] = m;
            ramax = m > ramax ? m : ramax;
        }
        if (nan) return 1;
        float s;
        if (gs_in == 0) {
            s = 2688.f / ramax;
            if (s > FLT_MAX) s = FLT_MAX;
            if (ramax == 0.f || s == 0.f) s = 1.f;
            gs_out[r] = s;
        } else {
            s = gs_in[0];
        }
        const float sdec = (float)(1.0 / (double)s);
        const float s6 = s * one_sixth;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t sf = e4m3_enc(bam[b] * s6);
            scale[r * nb + b] = sf;
            const float sfd = lut[sf];
            float enc = 1.0f / (sfd * sdec);
            if (enc > FLT_MAX) enc = FLT_MAX;
            const float* xb = xr + b * 16;
            int32_t code[16];
            for (int j = 0; j < 16; j++) {
                const float z = xb[j] * enc, m = fabsf(z);
                int32_t bits; memcpy(&bits, &z, 4);
                code[j] = (m > b0) + (m > b1) + (m > b2) + (m > b3) + (m > b4) + (m > b5) + (m > b6)
                          + ((bits >> 28) & 8);  /* the sign bit (signbit(z)) -> bit 3 */
            }
            uint8_t* db = data + r * (K / 2) + b * 8;
            for (int j = 0; j < 8; j++) db[j] = (uint8_t)(code[2 * j] | (code[2 * j + 1] << 4));
            if (xhat) {  /* from the codes just written: (e2m1 * sfd) * sdec, as dequantize */
                v8u c0, c1;
                memcpy(&c0, code, sizeof c0);
                memcpy(&c1, code + 8, sizeof c1);
                c0 = e2m1_bits(c0);
                c1 = e2m1_bits(c1);
                v8f lo, hi;
                memcpy(&lo, &c0, sizeof lo);
                memcpy(&hi, &c1, sizeof hi);
                lo = (lo * sfd) * sdec;
                hi = (hi * sfd) * sdec;
                memcpy(xhat + r * K + b * 16, &lo, sizeof lo);
                memcpy(xhat + r * K + b * 16 + 8, &hi, sizeof hi);
            }
        }
    }
    return 0;
}

/* Row t of x [T, n] (one S_enc) quantized straight into codes[slots[t]] [*, n/2] and
   scales[slots[t]] [*, n/16] of S slots: a KV-cache write without temporaries. Returns 1 on a
   NaN, 2 for a slot outside [0, S), 3 for an S_enc that is not finite and positive; on 2 and 3
   nothing was written. */
int nvfp4_quantize_to_slots(const float* x, int64_t T, int64_t n, const float* gs, const int64_t* slots, int64_t S,
                            const float* lut, const float* grid, const float* bnd, float one_sixth,
                            uint8_t* codes, uint8_t* scales) {
    if (!(gs[0] > 0.f && gs[0] <= FLT_MAX)) return 3;
    for (int64_t t = 0; t < T; t++) if (slots[t] < 0 || slots[t] >= S) return 2;
    for (int64_t t = 0; t < T; t++)
        if (nvfp4_qdq(x + t * n, 1, n, gs, lut, grid, bnd, one_sixth, codes + slots[t] * (n / 2),
                      scales + slots[t] * (n / 16), 0, 0))
            return 1;
    return 0;
}

/* Mantissa bits of packed E2M1 codes, as fp4.guided.mantissa_bits_packed: n bytes (n % 4 == 0,
   low nibble first) -> n/4 bytes, element 8i+j at bit j of byte i. Four bytes make one word whose
   elements have their low bits at 0, 4, ..., 28; three shift-or-mask rounds gather them. */
void nvfp4_mantissa_bits(const uint8_t* packed, int64_t n, uint8_t* out) {
    for (int64_t i = 0; i < n / 4; i++) {
        const uint8_t* p = packed + 4 * i;
        uint32_t w = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
        w &= 0x11111111u;
        w = (w | (w >> 3)) & 0x03030303u;
        w = (w | (w >> 6)) & 0x000F000Fu;
        out[i] = (uint8_t)((w | (w >> 12)) & 0xFFu);
    }
}

/* out[n] = dequantize(codes[idx[n]], scales[idx[n]]) for rows of `row` elements (16 per scale byte). */
void nvfp4_gather_dequant(const uint8_t* codes, const uint8_t* scales, const int64_t* idx, int64_t N,
                          int64_t row, int64_t cstride, int64_t sstride, float sdec, const float* lut,
                          const float* grid, float* out) {
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* c = codes + idx[n] * cstride;
        const uint8_t* sc = scales + idx[n] * sstride;
        float* o = out + n * row;
        for (int64_t b = 0; b < row / 16; b++) {
            const float sfd = lut[sc[b]];
            v8f lo, hi;
            e2m1x16(c + b * 8, &lo, &hi);
            lo = (lo * sfd) * sdec;
            hi = (hi * sfd) * sdec;
            memcpy(o + b * 16, &lo, sizeof lo);
            memcpy(o + b * 16 + 8, &hi, sizeof hi);
        }
    }
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_state: dict = {}
ENABLED = True  # set False (before first use) to force the torch reference, e.g. when bisecting
CACHE_DIR = Path.home() / ".cache" / "megatron_trace"


def compile_library(source: str, stem: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build C `source` once into CACHE_DIR (keyed by source, flags and, with -march=native, this
    CPU's feature flags) and load it. Raises when there is no compiler; callers fall back.

    Shared with the engine's CPU kernels (`kernels/cpu_fused.py`): fp4 may import nothing else of
    the project, so the one compile-and-cache helper lives here."""
    key = source + "\0" + " ".join(flags)
    if "-march=native" in flags:
        key += "\0" + _cpu_flags()
    so = CACHE_DIR / f"{stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not so.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            src, out = Path(tmp) / f"{stem}.c", Path(tmp) / f"{stem}.so"
            src.write_text(source)
            subprocess.run(["cc", *flags, "-std=c99", "-shared", "-fPIC", "-o", str(out), str(src), "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(out, so)  # atomic: concurrent builders (test workers) never load half a file
    return ctypes.CDLL(str(so))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build():
    lib = compile_library(_SRC, "fp4fast", ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math",
                                             "-fno-trapping-math"))
    lib.nvfp4_qdq.argtypes = [_P, _I, _I, _P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P]
    lib.nvfp4_qdq.restype = ctypes.c_int
    lib.nvfp4_quantize_to_slots.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _P, ctypes.c_float, _P, _P]
    lib.nvfp4_quantize_to_slots.restype = ctypes.c_int
    lib.nvfp4_gather_dequant.argtypes = [_P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _P]
    lib.nvfp4_gather_dequant.restype = None
    lib.nvfp4_mantissa_bits.argtypes = [_P, _I, _P]
    lib.nvfp4_mantissa_bits.restype = None
    return lib


def _lib():
    """The compiled helpers, or None (no compiler, disabled): callers then use the reference."""
    if "lib" not in _state:
        lib = None
        if ENABLED:
            try:
                lib = _build()
            except Exception:  # no compiler or a read-only cache: the reference path still works
                lib = None
        _state["lib"] = lib
        lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        _state["tables"] = (lut.contiguous(), e2m1_grid("cpu").contiguous(), _boundaries(torch.device("cpu")).contiguous())
        _state["table_ptrs"] = tuple(t.data_ptr() for t in _state["tables"])
    return _state["lib"]


def decode_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 byte -> fp32 [256], E2M1 code -> fp32 [16]): what fused kernels decode NVFP4 with."""
    _lib()
    lut, grid, _ = _state["tables"]
    return lut, grid


def c_functions() -> dict | None:
    """Addresses of the compiled quantizers and their tables, for fused kernels elsewhere that
    call them through function pointers (FP4 math stays here); None without the library."""
    lib = _lib()
    if lib is None:
        return None
    lut, grid, bnd = _state["table_ptrs"]
    return {"qdq": ctypes.cast(lib.nvfp4_qdq, ctypes.c_void_p).value,
            "q2slots": ctypes.cast(lib.nvfp4_quantize_to_slots, ctypes.c_void_p).value,
            "lut": lut, "grid": grid, "bnd": bnd, "one_sixth": nvfp4._ONE_SIXTH}


def available() -> bool:
    return _lib() is not None


def quantize_dequantize(x: torch.Tensor, *, per_row_global: bool = False, global_scale: torch.Tensor | None = None,
                        dequant_dtype: torch.dtype | None = None):
    """(nvfp4.quantize(x, per_row_global=..., global_scale=...), its nvfp4.dequantize(., dequant_dtype)
    or None when dequant_dtype is None), bit for bit, in one pass."""
    lib = _lib()
    gs_t = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32)
    ok = (lib is not None and x.device.type == "cpu" and x.is_floating_point() and x.dim() > 0
          and x.shape[-1] % nvfp4.BLOCK == 0 and per_row_global != (gs_t is not None)
          and (gs_t is None or (gs_t.dim() == 0 and gs_t.device.type == "cpu")))
    if ok and gs_t is not None:
        g = float(gs_t)
        ok = g > 0 and g != float("inf")
    if ok:
        # a decode step calls this dozens of times on tiny tensors: skip every no-op torch call
        xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        lead, k = xf.shape[:-1], xf.shape[-1]
        rows = xf.numel() // k
        data = torch.empty((*lead, k // 2), dtype=torch.uint8)
        scale = torch.empty((*lead, k // nvfp4.BLOCK), dtype=torch.uint8)
        gs_out = torch.empty(lead, dtype=torch.float32) if gs_t is None else gs_t
        xhat = torch.empty_like(xf) if dequant_dtype is not None else None
        lut, grid, bnd = _state["table_ptrs"]
        nan = lib.nvfp4_qdq(xf.data_ptr(), rows, k, None if gs_t is None else gs_t.data_ptr(), lut, grid, bnd,
                            nvfp4._ONE_SIXTH, data.data_ptr(), scale.data_ptr(),
                            gs_out.data_ptr() if gs_t is None else None, None if xhat is None else xhat.data_ptr())
        if not nan:
            q = nvfp4.NVFP4Tensor(data, scale, gs_out)
            if xhat is not None and dequant_dtype is not torch.float32:
                xhat = xhat.to(dequant_dtype)
            return q, xhat
    q = nvfp4.quantize(x, per_row_global=per_row_global, global_scale=global_scale)
    return q, (None if dequant_dtype is None else nvfp4.dequantize(q, dequant_dtype))


def mantissa_bits_packed(packed: torch.Tensor) -> torch.Tensor | None:
    """fp4.guided.mantissa_bits_packed of a CPU uint8 [..., K/2] tensor (checked there) in one C
    pass; None without the library."""
    lib = _lib()
    if lib is None or packed.device.type != "cpu":
        return None
    src = packed.contiguous()
    out = torch.empty((*src.shape[:-1], src.shape[-1] // 4), dtype=torch.uint8)
    lib.nvfp4_mantissa_bits(src.data_ptr(), src.numel(), out.data_ptr())
    return out


def quantize_to_slots(x: torch.Tensor, global_scale: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      slots: torch.Tensor) -> bool:
    """codes[slots], scales[slots] = nvfp4.quantize(x, global_scale=global_scale) (data, scale), bit
    for bit, without temporaries: x [T, ..., K], codes [S, ..., K/2] and scales [S, ..., K/16]
    contiguous, a finite positive 0-d global scale. False (nothing written) when the fast path
    cannot take it (no compiler, other devices or layouts, NaN input): use the reference then."""
    lib = _lib()
    if (lib is None or x.device.type != "cpu" or not codes.is_contiguous() or not scales.is_contiguous()
            or global_scale.dim() != 0 or global_scale.dtype is not torch.float32 or slots.dtype is not torch.int64
            or x.shape[1:-1] != codes.shape[1:-1] or x.shape[-1] != 2 * codes.shape[-1] or x.shape[-1] % nvfp4.BLOCK
            or slots.numel() != x.shape[0] or not slots.is_contiguous()):
        return False
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    lut, grid, bnd = _state["table_ptrs"]
    n = xf[0].numel() if xf.shape[0] else 0
    rc = lib.nvfp4_quantize_to_slots(xf.data_ptr(), xf.shape[0], n, global_scale.data_ptr(), slots.data_ptr(),
                                     codes.shape[0], lut, grid, bnd, nvfp4._ONE_SIXTH, codes.data_ptr(), scales.data_ptr())
    if rc == 2:
        raise IndexError(f"KV slot out of range for {codes.shape[0]} slots")
    return rc == 0  # NaN (1) or an unusable S_enc (3): the reference decides what to write


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor, global_scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """nvfp4.dequantize(NVFP4Tensor(codes[idx], scales[idx], global_scale), dtype) for a 0-d global
    scale and contiguous codes [S, ..., K/2] / scales [S, ..., K/16]: the gather and dequantize fused."""
    lib = _lib()
    if (lib is None or codes.device.type != "cpu" or not codes.is_contiguous() or not scales.is_contiguous()
            or global_scale.dim() != 0):
        return nvfp4.dequantize(nvfp4.NVFP4Tensor(codes[idx], scales[idx], global_scale), dtype)
    idx = idx.to(torch.int64).contiguous()
    row = codes[0].numel() * 2
    out = torch.empty(*idx.shape, *codes.shape[1:-1], codes.shape[-1] * 2, dtype=torch.float32)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= codes.shape[0]):
        raise IndexError(f"slot index out of range for {codes.shape[0]} slots")
    sdec = float(nvfp4.decode_scale(global_scale))
    lut, grid, _ = _state["tables"]
    lib.nvfp4_gather_dequant(codes.data_ptr(), scales.data_ptr(), idx.data_ptr(), idx.numel(), row,
                             row // 2, row // nvfp4.BLOCK, sdec, lut.data_ptr(), grid.data_ptr(), out.data_ptr())
    return out.to(dtype)
