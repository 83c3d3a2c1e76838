"""C kernels for the embedded engine's forward on CPU, and the library they compile into.

    x ─► add_rmsnorm (residual add + RMSNorm, one pass) ─► qkv GEMM
      ─► qkv_rope (q/k RMSNorm for Qwen3, RoPE, K/V stored straight into their cache slots)
      ─► paged_attention (cpu_attention.py: every row of every sequence over its KV slots)
      ─► o GEMM ─► add_rmsnorm ─► gate_up GEMM ─► silu_mul ─► down GEMM
Dense layers chain these inside one C call (cpu_layer.py, with its own GEMM); MoE layers and
MXFP4 call them one by one around torch's GEMMs. On a small model the torch version of a layer
is ~40 tiny ops at ~10 us of dispatch each. Each kernel computes in fp32 and rounds where HF's
module rounds (bfloat16 runs keep HF's rounding points); fp32 results match the torch reference
to a few ulp (other summation orders, a polynomial exp), never bit for bit. FP4 decoding comes
from `megatron_trace.fp4.fast` (E2M1_DECODE_C); FP4 quantizing is called there by pointer.

Built with the system C compiler on first use (`fp4.fast.compile_library`); `available()` is False
without one, for dtypes other than float32/bfloat16, or with ENABLED = False, and the engine then
runs its torch reference path.
"""
from __future__ import annotations

import ctypes

import torch

from megatron_trace.fp4.fast import E2M1_DECODE_C, compile_library

ENABLED = True  # set False (before first use) to force the engine's torch path, e.g. when bisecting
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_HEADER = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#define PREFETCH 8  /* KV rows ahead: attention is bound by streaming the pages in */
static inline void prefetch_row(const void* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o);
}

static inline float ld_f32(float v) { return v; }
static inline float st_f32(float v) { return v; }
static inline float rnd_f32(float v) { return v; }
static inline float ld_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t st_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float rnd_bf16(float f) { return ld_bf16(st_bf16(f)); }

/* e^x for x <= 88.7 to ~2 ulp: Cody-Waite reduction + degree-6 polynomial, vectorizable. */
static inline float fexp(float x) {
    x = x < -87.3f ? -87.3f : x;  /* not fminf/fmaxf: those stay library calls and block vectorizing */
    x = x > 88.7f ? 88.7f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f; p = p * r + 1.f / 6.f;
    p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
    union { int32_t i; float f; } s;  /* 2^n; a union (not memcpy) lets the loops vectorize */
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

/* v8f, v8u, SHUF: GCC/Clang vector extensions from fp4's E2M1_DECODE_C (explicit 8-lane SIMD that stays
   portable: AVX on x86, NEON pairs on Arm). */
typedef uint16_t v8h __attribute__((vector_size(16)));
static inline v8f ld8_f32(const float* p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline v8f ld8_bf16(const uint16_t* p) {
    v8h h; memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f; memcpy(&f, &u, sizeof f);
    return f;
}
static inline v8f rnd8_f32(v8f x) { return x; }
static inline v8f rnd8_bf16(v8f x) {  /* round to bf16 and back, nearest even (no NaN reaches here) */
    v8u u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* [sum(a0), ..., sum(a7)]: eight horizontal sums in 12 vector ops instead of 8 x 7 scalar adds */
static inline v8f hsum8x8(const v8f* a) {
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = SHUF(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline float hsum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }


static inline float sum(const float* a, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j];
    float s = 0.f;
    for (; i < n; i++) s += a[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Greedy pick of each row of fp32 logits [B, V] and its log-softmax: tok = first argmax,
   lp = (x[tok] - max) - log(sum(exp(x - max))), log_softmax's formula (vectorized exp). */
int greedy_logprob(const float* x, int64_t B, int64_t V, int64_t* tok, float* lp) {
    float* e = malloc((size_t)(V > 0 ? V : 1) * sizeof(float));
    if (!e) return 1;
    for (int64_t b = 0; b < B; b++) {
        const float* r = x + b * V;
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++) if (r[i] > r[best]) best = i;
        const float m = r[best];
        for (int64_t i = 0; i < V; i++) e[i] = fexp(r[i] - m);
        tok[b] = best;
        lp[b] = -logf(sum(e, V));
    }
    free(e);
    return 0;
}

"""

_BODY = r"""
/* x [T, N] is the residual stream: x += res first (rounded to the dtype) when res is given;
   out = w * dtype(x * rsqrt(mean(x^2) + eps)), as HF's RMSNorm. */
void add_rmsnorm_@S(@T* x, const @T* res, const @T* w, @T* out, int64_t T, int64_t N, float eps) {
    for (int64_t t = 0; t < T; t++) {
        @T* xr = x + t * N;
        if (res)
            for (int64_t i = 0; i < N; i++) xr[i] = st_@S(ld_@S(xr[i]) + ld_@S(res[t * N + i]));
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ss = 0.f;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8)
            for (int j = 0; j < 8; j++) { float v = ld_@S(xr[i + j]); acc[j] += v * v; }
        for (; i < N; i++) { float v = ld_@S(xr[i]); ss += v * v; }
        ss += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float r = 1.0f / sqrtf(ss / (float)N + eps);
        @T* o = out + t * N;
        for (i = 0; i < N; i++) o[i] = st_@S(ld_@S(w[i]) * rnd_@S(ld_@S(xr[i]) * r));
    }
}

static void norm_rope_@S(const @T* x, const @T* nw, float eps, const float* c, const float* s, int64_t D, @T* o) {
    float b[D];
    for (int64_t i = 0; i < D; i++) b[i] = ld_@S(x[i]);
    if (nw) {
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += b[i] * b[i];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) b[i] = rnd_@S(ld_@S(nw[i]) * rnd_@S(b[i] * r));
    }
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) o[i] = st_@S(rnd_@S(b[i] * c[i]) + rnd_@S(-b[i + h] * s[i]));
    for (int64_t i = h; i < D; i++) o[i] = st_@S(rnd_@S(b[i] * c[i]) + rnd_@S(b[i - h] * s[i]));
}

/* qkv [T, (H + 2 Hkv) D] -> q_out [T, H, D] with (q-norm and) RoPE; K (k-norm, RoPE) and V rows
   of token t go to row slots[t] of kdst/vdst [*, Hkv, D] (row t when slots is NULL). */
void qkv_rope_@S(const @T* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* cs, const float* sn,
                 const int64_t* pos, const @T* qn, const @T* kn, float eps, @T* q_out, @T* kdst, @T* vdst,
                 const int64_t* slots) {
    const int64_t row = (H + 2 * Hkv) * D, kvrow = Hkv * D;
    for (int64_t t = 0; t < T; t++) {
        const @T* x = qkv + t * row;
        const int64_t p = pos ? pos[t] : t;
        const float *c = cs + p * D, *s = sn + p * D;
        for (int64_t h = 0; h < H; h++) norm_rope_@S(x + h * D, qn, eps, c, s, D, q_out + (t * H + h) * D);
        const int64_t dst = slots ? slots[t] : t;
        for (int64_t h = 0; h < Hkv; h++) norm_rope_@S(x + (H + h) * D, kn, eps, c, s, D, kdst + dst * kvrow + h * D);
        memcpy(vdst + dst * kvrow, x + (H + Hkv) * D, (size_t)kvrow * sizeof(@T));
    }
}

/* gu [T, 2F] = [gate | up] -> out [T, F] = dtype(silu(gate)) * up, as HF's MLP. */
void silu_mul_@S(const @T* gu, int64_t T, int64_t F, @T* out) {
    for (int64_t t = 0; t < T; t++) {
        const @T *g = gu + t * 2 * F, *u = g + F;
        @T* o = out + t * F;
        for (int64_t i = 0; i < F; i++) {
            const float a = ld_@S(g[i]);
            o[i] = st_@S(rnd_@S(a / (1.f + fexp(-a))) * ld_@S(u[i]));
        }
    }
}
"""

def _source() -> str:
    from .cpu_attention import ATTENTION_BODY
    from .cpu_layer import LAYER_BODY, LAYER_HEADER

    return E2M1_DECODE_C + _HEADER + LAYER_HEADER + "".join(
        (_BODY + ATTENTION_BODY + LAYER_BODY).replace("@S", sfx).replace("@T", ctype)
        for sfx, ctype in (("f32", "float"), ("bf16", "uint16_t")))
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rmsnorm": [_P, _P, _P, _P, _I, _I, _F],
    "qkv_rope": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P],
    "paged_attention": [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _F, _P],
    "silu_mul": [_P, _I, _I, _P],
    "paged_attention_nvfp4": [_P, _P, _P, _P, _P, _F, _F, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _F, _P],
    "paged_attention_kv": [_P, ctypes.c_int, _P, _P, _F, ctypes.c_int, _P, _P, _F, _P, _P, _P, _I, _P, _P,
                           _I, _I, _I, _I, _F, _P],
}
_state: dict = {}


def _lib():
    if "lib" not in _state:
        lib = None
        if ENABLED:
            try:
                lib = compile_library(_source(), "cpu_fused", ("-O3", "-march=native", "-ffp-contract=off",
                                                           "-fno-math-errno", "-fno-trapping-math"))
                for sfx in DTYPES.values():
                    for name, args in _SIGNATURES.items():
                        fn = getattr(lib, f"{name}_{sfx}")
                        fn.argtypes = args
                        fn.restype = ctypes.c_int if name.startswith("paged_attention") else None
                    lib.greedy_logprob.argtypes, lib.greedy_logprob.restype = [_P, _I, _I, _P, _P], ctypes.c_int
                    layer = getattr(lib, f"decode_layer_{sfx}")
                    layer.argtypes, layer.restype = [ctypes.c_void_p], ctypes.c_int
            except Exception:  # no compiler: the engine's torch path still works
                lib = None
        _state["lib"] = lib
    return _state["lib"]


def layer_fn(dtype: torch.dtype):
    """The compiled `decode_layer` for dtype (see kernels/cpu_layer.py)."""
    return _fn("decode_layer", dtype)


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype in DTYPES and _lib() is not None


def _fn(name: str, dtype: torch.dtype):
    return getattr(_lib(), f"{name}_{DTYPES[dtype]}")


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] contiguous, updated in place to x + residual; returns RMSNorm(x) * weight."""
    t, n = x.shape
    out = torch.empty_like(x)
    _fn("add_rmsnorm", x.dtype)(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), t, n, eps)
    return out


def qkv_rope(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
             k_dst: torch.Tensor, v_dst: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """qkv [T, (H+2Hkv)D] contiguous; cos/sin fp32 tables [P, D] read at row positions[t] (int64
    [T], each < P; row t when None); K/V rows into k_dst/v_dst [*, Hkv, D] at `slots` (int64 [T],
    or row t when None). Returns q [T, H, D] after (q-norm and) RoPE."""
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype)
    slots = None if slots is None else slots.to(torch.int64).contiguous()  # kept alive across the call
    _fn("qkv_rope", qkv.dtype)(qkv.data_ptr(), t, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                               _ptr(positions), _ptr(q_norm), _ptr(k_norm), eps, q.data_ptr(), k_dst.data_ptr(), v_dst.data_ptr(),
                               _ptr(slots))
    return q


def greedy_logprob(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """(argmax, log_softmax at the argmax) of each row of contiguous fp32 logits [B, V], as lists."""
    b, v = logits.shape
    tok, lp = torch.empty(b, dtype=torch.int64), torch.empty(b, dtype=torch.float32)
    if _lib().greedy_logprob(logits.data_ptr(), b, v, tok.data_ptr(), lp.data_ptr()):
        raise MemoryError(f"greedy_logprob: no memory for a row of {v} logits")
    return tok.tolist(), lp.tolist()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] contiguous -> silu(gate) * up [T, F]."""
    t, f2 = gate_up.shape
    out = torch.empty(t, f2 // 2, dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), t, f2 // 2, out.data_ptr())
    return out
