/* What every CPU kernel of the engine shares (cpu_gemv*.c, cpu_quant.c, cpu_fused.c): bf16 and
 * E4M3/E2M1 conversions, the 8-lane SIMD helpers, and the GEMM tile height. This is the one place
 * FP4 decoding is written in C; the tables equal megatron_trace.fp4's (tests/test_cpu_quant.py).
 *
 * All sources are built by torch.utils.cpp_extension (megatron_trace/kernels/cpu_build.py) with
 * -ffp-contract=off and no fast-math, so every fp32 step rounds where the torch reference does.
 */
#ifndef MEGATRON_TRACE_CPU_FP4_H
#define MEGATRON_TRACE_CPU_FP4_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- bf16 ---------------------------------------------------------------------------------- */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* y[i] = v as fp32, or rounded to bf16 when y_bf16 (the GEMVs' output dtypes). */
static inline void store_out(void* y, int y_bf16, int64_t i, float v) {
    if (y_bf16)
        ((uint16_t*)y)[i] = f32_to_bf16(v);
    else
        ((float*)y)[i] = v;
}

/* ---- E4M3 (block scales) ------------------------------------------------------------------- */
/* E4M3 byte times 2^-120 as fp32, exactly, sign ignored (UE4M3): the exponent and mantissa bits
   placed in an fp32 (a subnormal fp32 for exponent 0, which DAZ-free arithmetic keeps). The
   callers multiply by 2^120, or by 2^119 / 2^118 where the GEMVs fold 2 e2m1 (integers) in. */
static inline float e4m3_bits_f32(uint8_t b) {
    uint32_t u = (uint32_t)(b & 0x7f) << 20;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float half_e4m3(uint8_t b) { return e4m3_bits_f32(b) * 0x1p119f; }
static inline float quarter_e4m3(uint8_t b) { return e4m3_bits_f32(b) * 0x1p118f; }

/* E4M3 byte -> fp32 as torch's float8_e4m3fn does: signed; 0x7f/0xff NaN with torch's bit pattern
   (the widened E4M3 NaN), for the decode table. */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24;
    if ((b & 0x7f) == 0x7f) {
        const uint32_t nan = sign | 0x7ff00000u;
        float f;
        memcpy(&f, &nan, 4);
        return f;
    }
    const float mag = e4m3_bits_f32(b) * 0x1p120f;
    return sign ? -mag : mag;
}

/* v >= 0, not NaN -> E4M3 byte: clamp to 448, round to nearest even (fp4.fp8's encoder). Bit
   arithmetic instead of frexpf + nearbyintf (a libm call per block in the quantizers), equal to
   them on every non-negative float (checked exhaustively): subnormals round in steps of 2^-9 by
   the 2^23 trick, normals round the fp32 mantissa to 3 bits (a carry bumps the exponent). */
static inline uint8_t e4m3_enc(float v) {
    if (v > 448.f) v = 448.f;
    if (v < 0.015625f) return (uint8_t)(int)((v * 512.f + 0x1p23f) - 0x1p23f);
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7ffffu + ((u >> 20) & 1u);
    return (uint8_t)((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u)); /* E4M3 bias 7 = fp32's 127 - 120 */
}

/* ---- E2M1 (the 4-bit codes) ---------------------------------------------------------------- */
/* code(|x|) = number of these boundaries strictly below |x| (fp4.codecs._E2M1_BOUNDARIES: the
   midpoints that tie to the upper, even code are the float just below them). */
static const float E2M1_BOUNDS[7] = {0.25f, 0x1.7ffffep-1f, 1.25f, 0x1.bffffep+0f, 2.5f, 0x1.bffffep+1f, 5.f};
/* fp32(1/6), as fp4.nvfp4._ONE_SIXTH: block scale = amax * S_enc * (1/6). */
#define NVFP4_ONE_SIXTH 0x1.555556p-3f
/* 2 * e2m1(code) (exact small integers) for the GEMVs, as fp32 and int8 (sign bit 3). */
static const float TWO_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, -0.f, -1, -2, -3, -4, -6, -8, -12};
static const int8_t TWO_E2M1_I8[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* ... and as bf16 bits, twice: AVX-512 vpermw reads 5 index bits and bit 4 is the neighbour nibble's. */
static const uint16_t TWO_E2M1_BF16[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40c0, 0x4100, 0x4140,
    0x8000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0c0, 0xc100, 0xc140,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40c0, 0x4100, 0x4140,
    0x8000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0c0, 0xc100, 0xc140};

/* GCC/Clang vector extensions: explicit 8-lane SIMD that stays portable (AVX on x86, NEON pairs on Arm). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v8h __attribute__((vector_size(16)));
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* 8 codes as fp32 bits, built from the code bits: sign bit 3, exponent bits 2-1 (0: subnormal,
   0 or 0.5), mantissa bit 0; equal to fp4.codecs.e2m1_grid, -0.0 included. */
static inline v8u e2m1_bits(v8u n) {
    const v8u sign = (n >> 3) << 31, e = (n >> 1) & 3, m = n & 1;
    const v8u normal = sign | ((e + 126) << 23) | (m << 22), sub = sign | (m * 0x3F000000u);
    const v8u is_normal = (v8u)(e != 0);
    return (normal & is_normal) | (sub & ~is_normal);
}

/* 16 E2M1 values of 8 packed bytes (low nibble first) as fp32. */
static inline void e2m1x16(const uint8_t* c, v8f* lo, v8f* hi) {
    v8b b;
    memcpy(&b, c, sizeof b);
    const v8u u = __builtin_convertvector(b, v8u), n0 = e2m1_bits(u & 15), n1 = e2m1_bits(u >> 4);
    const v8u a = SHUF(n0, n1, 0, 8, 1, 9, 2, 10, 3, 11), z = SHUF(n0, n1, 4, 12, 5, 13, 6, 14, 7, 15);
    memcpy(lo, &a, sizeof a);
    memcpy(hi, &z, sizeof z);
}

/* The value of one E2M1 code (0..15) as fp32: what the decode table holds. */
static inline float e2m1_to_f32(uint8_t code) {
    v8u n = {code, 0, 0, 0, 0, 0, 0, 0};
    n = e2m1_bits(n);
    float f;
    memcpy(&f, &n, 4);
    return f;
}

/* ---- 8-lane loads, rounding and horizontal sums -------------------------------------------- */
static inline v8f ld8_f32(const float* p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline v8f ld8_bf16(const uint16_t* p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline v8f rnd8_f32(v8f x) { return x; }
static inline v8f rnd8_bf16(v8f x) { /* round to bf16 and back, nearest even (no NaN reaches here) */
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
        t[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
               + SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = SHUF(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
               + SHUF(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline float hsum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* ---- weight streaming ---------------------------------------------------------------------- */
/* How far ahead of the weight bytes being read the GEMVs' inner loops prefetch, one line per 64
   bytes consumed (the scale stream: the same rows ahead, distance / 8). The hardware prefetchers
   alone held one core at ~17 GB/s on NVFP4 rows from DRAM, whose kernel runs at 46 GB/s in cache;
   a line per 64 bytes 8-24 KB ahead measured 1.2-1.6x (a burst per row at its start: ~1.05x). */
#define GEMV_PREFETCH_BYTES 12288

/* ---- 16 output rows at once (AVX-512 GEMVs) ------------------------------------------------ */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* The sums of 16 rows' 16-lane accumulators, row r in lane r, each summed with exactly the pairing
   _mm512_reduce_add_ps gives one row ((a_j + a_j+8), then + 4, + 2, + 1 lanes apart), so a row's
   result does not depend on whether it was reduced alone or with 15 others: 45 ops for 16 rows
   where one row alone takes 8 on a latency chain. */
static inline __m512 reduce16_ps(const __m512* a) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++)
        l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xEE));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
    /* the tree leaves row r in lane 4 (r % 4) + r / 4 (a 4 x 4 transpose, its own inverse) */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

/* store_out of 16 consecutive outputs y[i..i+16): fp32, or bf16 by f32_to_bf16's rounding (NaN included). */
static inline void store16_out(void* y, int y_bf16, int64_t i, __m512 v) {
    if (!y_bf16) {
        _mm512_storeu_ps((float*)y + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i*)((uint16_t*)y + i), _mm512_cvtepi32_epi16(b));
}
#endif

/* ---- GEMM tiles ---------------------------------------------------------------------------- */
/* Activation rows one weight-row pass serves (gemv NVFP4/BF16/W4A4 and the layer GEMM): decode
   batches are small, and 4 rows of accumulators stay in registers. */
#define TILE_ROWS 4
/* call(R) with R the compile-time row count of this tile (mr <= TILE_ROWS), so loops over R unroll. */
#define TILE_SWITCH(mr, call)   \
    switch (mr) {               \
        case 4: call(4); break; \
        case 3: call(3); break; \
        case 2: call(2); break; \
        default: call(1);       \
    }
#endif
