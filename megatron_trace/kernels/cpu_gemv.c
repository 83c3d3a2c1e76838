/* Weight-streaming GEMV/small GEMM for the embedded engine's decode on CPU; see cpu_gemv.h.
 *
 * Decode is bound by the bytes of weights read per token, so the weights are read as stored and
 * decoded in registers, never materialized:
 *  - NVFP4: 16 packed codes (8 bytes) per block. A 16-entry table (vpermw) maps each nibble to
 *    the bf16 bits of 2*e2m1 (exact small integers), the block sum of x * 2e is scaled by
 *    E4M3(SF)/2 and the row's sum by the global decode scale:
 *        y = gdec * sum_blocks (SF_b / 2) * sum_k x_k * 2 e_k      (fp32 throughout)
 *    which is fp4's dequantize (e * SF * gdec) followed by a matmul, reassociated: the two differ
 *    by fp32 rounding only. In a bf16 model this uses the exact FP4 weight values (as FP4 GEMM
 *    hardware does), not the bf16-rounded dequantized copy the torch path multiplies by.
 *  - BF16: 32 weights per 64-byte load, widened to fp32 by shifts.
 * x is fp32 for both (bf16 activations widen exactly), accumulation is fp32 FMA.
 * Built for the target MEGATRON_TRACE_CPU_ISA allows (cpu_build.py): the AVX-512 path when the compiler
 * targets it, else portable 8-lane vectors (AVX2 with x86-64-v3, SSE at the baseline, NEON on Arm;
 * gemv_isa() says which). Threads: the caller splits output rows (cpu_gemv_parallel.cpp).
 */
#include "cpu_gemv.h"

#include <string.h>

#include "cpu_fp4.h" /* bf16 and E4M3 conversions, 2 e2m1 tables, TILE_ROWS */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMV_AVX512 1
#else
#define GEMV_AVX512 0
#endif
/* The bf16-activation tiles: vdpbf16ps (AVX512_BF16) and one vpermi2b (AVX512_VBMI) per group step.
   Cooper Lake has the first without the second: it builds the fp32 path. */
#if GEMV_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define GEMV_DPBF16 1
#else
#define GEMV_DPBF16 0
#endif

int64_t gemv_padded_k(int64_t K) { return (K + 31) / 32 * 32; }

void gemv_prepare_x(const void* x, int x_bf16, int64_t M, int64_t K, float* xp) {
    const int64_t kp = gemv_padded_k(K);
    for (int64_t m = 0; m < M; m++) {
        float* row = xp + m * kp;
        for (int64_t k = 0; k < kp; k++) {
            const float v = k >= K ? 0.f
                            : x_bf16 ? bf16_to_f32(((const uint16_t*)x)[m * K + k]) : ((const float*)x)[m * K + k];
#if GEMV_AVX512
            row[k / 32 * 32 + (k % 2) * 16 + (k % 32) / 2] = v; /* chunk: 16 even, then 16 odd columns */
#else
            row[k] = v;
#endif
        }
    }
}

/* bf16 x [M, K] -> the order nvfp4_tile_bf16 reads: in each whole 256-column group, step j's 32
   values are (x[16 i + 2 j], x[16 i + 2 j + 1]) for blocks i = 0..15; the rest of the row as is. */
void gemv_prepare_x_bf16(const uint16_t* x, int64_t M, int64_t K, uint16_t* out) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xr = x + m * K;
        uint16_t* o = out + m * K;
        const int64_t grouped = K / 256 * 256;
        for (int64_t g = 0; g < grouped; g += 256)
            for (int64_t j = 0; j < 8; j++)
                for (int64_t i = 0; i < 16; i++) {
                    o[g + 32 * j + 2 * i] = xr[g + 16 * i + 2 * j];
                    o[g + 32 * j + 2 * i + 1] = xr[g + 16 * i + 2 * j + 1];
                }
        memcpy(o + grouped, xr + grouped, (size_t)(K - grouped) * sizeof(uint16_t));
    }
}

#if GEMV_AVX512
const char* gemv_isa(void) {
#if GEMV_DPBF16
    return "avx512+bf16";
#else
    return "avx512";
#endif
}

/* 16 block scales (one row's next 256 columns; fewer at the row's end) as fp32 SF/2. */
static inline __m512 load_scales(const uint8_t* s, int64_t count) {
    const __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, s));
    const __m512i bits = _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x7f)), 20);
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p119f));
}

/* Which fp32 scale lane each 32-column chunk's 16 lanes take: lanes 0-7 block 2j, 8-15 block 2j + 1
   of the 16 blocks a load_scales vector holds (j = chunk % 8). */
static inline __m512i scale_pick(int64_t j) {
    const __m512i lane = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_add_epi32(lane, _mm512_set1_epi32((int)(2 * j)));
}

/* 32 weights of chunk c as bf16 bits of 2 e2m1 in column order: dword i = byte i | byte << 12
   puts byte i's low nibble in word 2i's low bits and its high nibble in word 2i+1's. */
static inline __m512i decode_chunk(const uint8_t* cr, int64_t c, int64_t full, __m512i lut) {
    const __m128i raw = c < full ? _mm_loadu_si128((const __m128i*)(cr + 16 * c))
                                 : _mm_maskz_loadu_epi8((__mmask16)0x00ff, cr + 16 * c);
    const __m512i d = _mm512_cvtepu8_epi32(raw);
    return _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), lut);
}

/* MR fp32 activation rows (laid out by gemv_prepare_x) against weight row n: one decode of each
   32-weight chunk serves all MR. */
static inline __attribute__((always_inline)) void nvfp4_tile(const float* xp, int64_t kp, int64_t K,
                                                             const uint8_t* cr, const uint8_t* sr, __m512* out,
                                                             const int mr) {
    const __m512i lut = _mm512_loadu_si512((const void*)TWO_E2M1_BF16);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const int64_t chunks = kp / 32, full = K / 32, blocks = K / 16;
    /* two accumulators per row, alternating by chunk: one FMA chain would wait on its latency */
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    /* Groups of 8 chunks share one scale load; unrolled, so the accumulator and scale lane picks are constants. */
#define NVFP4_F32_CHUNK(c, j, a)                                                                   \
    do {                                                                                          \
        if (((c) & 3) == 0) __builtin_prefetch(cr + 16 * (c) + GEMV_PREFETCH_BYTES);              \
        const __m512i w = decode_chunk(cr, c, full, lut);                                         \
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); /* columns 2i */         \
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, hi));  /* columns 2i + 1 */     \
        const __m512 sv = _mm512_permutexvar_ps(scale_pick(j), s16);                              \
        for (int r = 0; r < mr; r++) {                                                            \
            const float* xr = xp + r * kp + 32 * (c);                                             \
            __m512 t = _mm512_mul_ps(_mm512_loadu_ps(xr), we);                                    \
            t = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), wo, t);                                 \
            acc[r][a] = _mm512_fmadd_ps(t, sv, acc[r][a]);                                        \
        }                                                                                         \
    } while (0)
    int64_t c = 0;
    for (; c + 8 <= chunks; c += 8) {
        if ((c & 31) == 0) __builtin_prefetch(sr + 2 * c + GEMV_PREFETCH_BYTES / 8);
        const __m512 s16 = load_scales(sr + 2 * c, blocks - 2 * c);
        NVFP4_F32_CHUNK(c, 0, 0); NVFP4_F32_CHUNK(c + 1, 1, 1); NVFP4_F32_CHUNK(c + 2, 2, 0); NVFP4_F32_CHUNK(c + 3, 3, 1);
        NVFP4_F32_CHUNK(c + 4, 4, 0); NVFP4_F32_CHUNK(c + 5, 5, 1); NVFP4_F32_CHUNK(c + 6, 6, 0); NVFP4_F32_CHUNK(c + 7, 7, 1);
    }
    if (c < chunks) {
        const __m512 s16 = load_scales(sr + 2 * c, blocks - 2 * c);
        for (int64_t j = 0; c + j < chunks; j++) NVFP4_F32_CHUNK(c + j, j, 0);
    }
#undef NVFP4_F32_CHUNK
    for (int r = 0; r < mr; r++) out[r] = _mm512_add_ps(acc[r][0], acc[r][1]); /* lane sums, reduced by the caller */
}

#if GEMV_DPBF16
/* x's 32 bf16 columns of chunk c (the row's tail zero-filled), as read in place. */
static inline __m512i load_x_bf16(const uint16_t* xr, int64_t c, int64_t K) {
    const int64_t left = K - 32 * c;
    return left >= 32 ? _mm512_loadu_si512((const void*)(xr + 32 * c))
                      : _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1ull), xr + 32 * c);
}

/* bf16 activations (rows of stride K, in place): vdpbf16ps multiplies bf16 pairs exactly (2e has
   3 significant bits, x 8) and adds them in fp32, half the instructions of the fp32 path. */
static inline __attribute__((always_inline)) void nvfp4_tile_bf16(const uint16_t* x, int64_t K, const uint8_t* cr,
                                                                  const uint8_t* sr, __m512* out, const int mr) {
    const __m512i lut = _mm512_loadu_si512((const void*)TWO_E2M1_BF16);
    const int64_t chunks = (K + 31) / 32, full = K / 32, blocks = K / 16;
    /* two accumulators per row, alternating by chunk: one FMA chain would wait on its latency */
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#define NVFP4_BF16_CHUNK(c, j, a)                                                                        \
    do {                                                                                               \
        if (((c) & 3) == 0) __builtin_prefetch(cr + 16 * (c) + GEMV_PREFETCH_BYTES);                   \
        const __m512bh w = (__m512bh)decode_chunk(cr, c, full, lut);                                   \
        const __m512 sv = _mm512_permutexvar_ps(scale_pick(j), s16);                                   \
        for (int r = 0; r < mr; r++) {                                                                 \
            const __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)load_x_bf16(x + r * K, c, K), w); \
            acc[r][a] = _mm512_fmadd_ps(t, sv, acc[r][a]);                                             \
        }                                                                                              \
    } while (0)
    int64_t c = 0;
    /* Whole 256-column groups (16 blocks) from x laid out by gemv_prepare_x_bf16: step j gathers code
       byte j of every block into dword lane i = block i (one masked vpermi2b), so the 8 dot products
       of a group accumulate per block with no scale in between; one FMA applies the 16 block scales. */
    const __m512i gather = _mm512_set_epi32(120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24, 16, 8, 0);
#define NVFP4_GROUP_STEP(j, a)                                                                            \
    do {                                                                                                 \
        const __m512i d = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, lo,                       \
                                                         _mm512_add_epi32(gather, _mm512_set1_epi32(j)), hi); \
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), lut); \
        for (int r = 0; r < mr; r++)                                                                     \
            part[r][a] = _mm512_dpbf16_ps(part[r][a], (__m512bh)_mm512_loadu_si512((const void*)(xg + r * K + 32 * (j))), w); \
    } while (0)
    for (int64_t g = 0; g < K / 256; g++, c += 8) {
        __builtin_prefetch(cr + 128 * g + GEMV_PREFETCH_BYTES);
        __builtin_prefetch(cr + 128 * g + 64 + GEMV_PREFETCH_BYTES);
        if ((g & 3) == 0) __builtin_prefetch(sr + 16 * g + GEMV_PREFETCH_BYTES / 8);
        const __m512i lo = _mm512_loadu_si512((const void*)(cr + 128 * g)), hi = _mm512_loadu_si512((const void*)(cr + 128 * g + 64));
        const uint16_t* xg = x + 256 * g;
        __m512 part[TILE_ROWS][2];
        for (int r = 0; r < TILE_ROWS; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
        NVFP4_GROUP_STEP(0, 0); NVFP4_GROUP_STEP(1, 1); NVFP4_GROUP_STEP(2, 0); NVFP4_GROUP_STEP(3, 1);
        NVFP4_GROUP_STEP(4, 0); NVFP4_GROUP_STEP(5, 1); NVFP4_GROUP_STEP(6, 0); NVFP4_GROUP_STEP(7, 1);
        const __m512 s16 = load_scales(sr + 16 * g, 16);
        for (int r = 0; r < mr; r++) acc[r][g & 1] = _mm512_fmadd_ps(_mm512_add_ps(part[r][0], part[r][1]), s16, acc[r][g & 1]);
    }
#undef NVFP4_GROUP_STEP
    for (; c + 8 <= chunks; c += 8) {
        if ((c & 31) == 0) __builtin_prefetch(sr + 2 * c + GEMV_PREFETCH_BYTES / 8);
        const __m512 s16 = load_scales(sr + 2 * c, blocks - 2 * c);
        NVFP4_BF16_CHUNK(c, 0, 0); NVFP4_BF16_CHUNK(c + 1, 1, 1); NVFP4_BF16_CHUNK(c + 2, 2, 0); NVFP4_BF16_CHUNK(c + 3, 3, 1);
        NVFP4_BF16_CHUNK(c + 4, 4, 0); NVFP4_BF16_CHUNK(c + 5, 5, 1); NVFP4_BF16_CHUNK(c + 6, 6, 0); NVFP4_BF16_CHUNK(c + 7, 7, 1);
    }
    if (c < chunks) {
        const __m512 s16 = load_scales(sr + 2 * c, blocks - 2 * c);
        for (int64_t j = 0; c + j < chunks; j++) NVFP4_BF16_CHUNK(c + j, j, 0);
    }
#undef NVFP4_BF16_CHUNK
    for (int r = 0; r < mr; r++) out[r] = _mm512_add_ps(acc[r][0], acc[r][1]); /* lane sums, reduced by the caller */
}

static inline __attribute__((always_inline)) void bf16_tile_bf16(const uint16_t* x, int64_t K, const uint16_t* wr,
                                                                 __m512* out, const int mr) {
    const int64_t chunks = (K + 31) / 32;
    /* two accumulators per row, alternating by chunk: one FMA chain would wait on its latency */
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
        __builtin_prefetch(wr + 32 * c + GEMV_PREFETCH_BYTES / 2);
        __builtin_prefetch(wr + 32 * c + 32 + GEMV_PREFETCH_BYTES / 2);
        const __m512bh w0 = (__m512bh)load_x_bf16(wr, c, K), w1 = (__m512bh)load_x_bf16(wr, c + 1, K);
        for (int r = 0; r < mr; r++) {
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)load_x_bf16(x + r * K, c, K), w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)load_x_bf16(x + r * K, c + 1, K), w1);
        }
    }
    if (c < chunks) {
        const __m512bh w = (__m512bh)load_x_bf16(wr, c, K);
        for (int r = 0; r < mr; r++) acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)load_x_bf16(x + r * K, c, K), w);
    }
    for (int r = 0; r < mr; r++) out[r] = _mm512_add_ps(acc[r][0], acc[r][1]); /* lane sums, reduced by the caller */
}
#endif

static inline __attribute__((always_inline)) void bf16_tile(const float* xp, int64_t kp, int64_t K,
                                                            const uint16_t* wr, __m512* out, const int mr) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const int64_t chunks = kp / 32, full = K / 32;
    /* two accumulators per row, alternating by chunk: one FMA chain would wait on its latency */
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __builtin_prefetch(wr + 32 * c + GEMV_PREFETCH_BYTES / 2);
        /* the tail chunk reads only the row's remaining (K % 32) / 2 dwords */
        const __m512i w = c < full ? _mm512_loadu_si512((const void*)(wr + 32 * c))
                                   : _mm512_maskz_loadu_epi32((__mmask16)((1u << ((K % 32) / 2)) - 1u), wr + 32 * c);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
        for (int r = 0; r < mr; r++) {
            const float* xr = xp + r * kp + 32 * c;
            acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), we, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), wo, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = _mm512_add_ps(acc[r][0], acc[r][1]); /* lane sums, reduced by the caller */
}

/* Output rows n0..n1 of activation rows m0..m0+mr: TILE_AT(n) puts row n's mr lane-sum vectors in
   `one`; whole groups of 16 rows reduce together (reduce16_ps: the sums one row alone gets, with the
   lone reductions and scalar epilogues off the per-row path), the rest one by one. The epilogue is
   sum * scale[n] + bias[n] (scale: the NVFP4 rows' S_dec, or none for BF16), as before grouping. */
#define GEMV_ROWS(TILE_AT, scale)                                                                            \
    do {                                                                                                     \
        __m512 grp[TILE_ROWS][16], one[TILE_ROWS];                                                           \
        int64_t n = n0;                                                                                      \
        for (; n + 16 <= n1; n += 16) {                                                                      \
            for (int i = 0; i < 16; i++) {                                                                   \
                TILE_AT(n + i);                                                                              \
                for (int r = 0; r < mr; r++) grp[r][i] = one[r];                                             \
            }                                                                                                \
            const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();                         \
            for (int r = 0; r < mr; r++) {                                                                   \
                __m512 v = reduce16_ps(grp[r]);                                                              \
                if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps((scale) + n));                               \
                store16_out(y, y_bf16, (m0 + r) * N + n, _mm512_add_ps(v, b));                               \
            }                                                                                                \
        }                                                                                                    \
        for (; n < n1; n++) {                                                                                \
            TILE_AT(n);                                                                                      \
            for (int r = 0; r < mr; r++) {                                                                   \
                const float v = _mm512_reduce_add_ps(one[r]);                                                \
                store_out(y, y_bf16, (m0 + r) * N + n, ((scale) ? v * (scale)[n] : v) + (bias ? bias[n] : 0.f)); \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

/* x: raw bf16 rows [M, K] when x_bf16 (the dpbf16 build only, see gemv_reads_bf16), else fp32
   rows laid out by gemv_prepare_x. */
void gemv_nvfp4_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                     const float* gdec, const float* bias, void* y, int y_bf16, int64_t N, int64_t n0, int64_t n1) {
    const int64_t kp = gemv_padded_k(K);
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define NVFP4_ROW(R) nvfp4_tile((const float*)x + m0 * kp, kp, K, cr, sr, one, R)
#define NVFP4_AT(row)                                                                      \
    do {                                                                                   \
        const uint8_t *cr = codes + (row) * (K / 2), *sr = scales + (row) * (K / 16);      \
        TILE_SWITCH(mr, NVFP4_ROW)                                                         \
    } while (0)
#if GEMV_DPBF16
#define NVFP4_BF16_ROW(R) nvfp4_tile_bf16((const uint16_t*)x + m0 * K, K, cr, sr, one, R)
#define NVFP4_BF16_AT(row)                                                                 \
    do {                                                                                   \
        const uint8_t *cr = codes + (row) * (K / 2), *sr = scales + (row) * (K / 16);      \
        TILE_SWITCH(mr, NVFP4_BF16_ROW)                                                    \
    } while (0)
        if (x_bf16)
            GEMV_ROWS(NVFP4_BF16_AT, gdec);
        else
#endif
            GEMV_ROWS(NVFP4_AT, gdec);
    }
}

void gemv_bf16_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint16_t* w, const float* bias, void* y,
                    int y_bf16, int64_t N, int64_t n0, int64_t n1) {
    const int64_t kp = gemv_padded_k(K);
    const float* none = 0; /* BF16 rows have no decode scale */
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define BF16_ROW(R) bf16_tile((const float*)x + m0 * kp, kp, K, wr, one, R)
#define BF16_AT(row)                                                                       \
    do {                                                                                   \
        const uint16_t* wr = w + (row) * K;                                                \
        TILE_SWITCH(mr, BF16_ROW)                                                          \
    } while (0)
#if GEMV_DPBF16
#define BF16_BF16_ROW(R) bf16_tile_bf16((const uint16_t*)x + m0 * K, K, wr, one, R)
#define BF16_BF16_AT(row)                                                                  \
    do {                                                                                   \
        const uint16_t* wr = w + (row) * K;                                                \
        TILE_SWITCH(mr, BF16_BF16_ROW)                                                     \
    } while (0)
        if (x_bf16)
            GEMV_ROWS(BF16_BF16_AT, none);
        else
#endif
            GEMV_ROWS(BF16_AT, none);
    }
}

int gemv_reads_bf16(void) { return GEMV_DPBF16; }

#else /* portable: 8-lane GCC/Clang vectors, the same factorization, natural column order */
/* One AVX2 register where the target has AVX2 (x86-64-v3), SSE or NEON pairs elsewhere. A GEMV sum is
   not an FP4 rounding (the results hold to fp32 rounding, tests/test_cpu_gemv.py): contracted into FMAs
   where the target has them. */
#if defined(__GNUC__) && !defined(__clang__)
#define GEMV_FMA __attribute__((optimize("fp-contract=fast")))
#else
#define GEMV_FMA
#endif
const char* gemv_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "vec8-avx2";
#elif defined(__ARM_NEON) || defined(__aarch64__)
    return "vec8-neon";
#else
    return "vec8";
#endif
}
int gemv_reads_bf16(void) { return 0; }

/* MR laid-out fp32 rows (natural order, zero past K) against NVFP4 weight row cr/sr: lane sums in out. */
static inline GEMV_FMA void nvfp4_tile(const float* xp, int64_t kp, int64_t K, const uint8_t* cr, const uint8_t* sr,
                                       v8f* out, const int mr) {
    v8f acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < K / 16; b++) {
        if ((b & 7) == 0) __builtin_prefetch(cr + 8 * b + GEMV_PREFETCH_BYTES);
        v8f lo, hi;
        e2m1x16(cr + 8 * b, &lo, &hi);
        const float sf = e4m3_bits_f32(sr[b]) * 0x1p120f;
        for (int r = 0; r < mr; r++) {
            const float* xr = xp + r * kp + 16 * b;
            const v8f t = ld8_f32(xr) * lo + ld8_f32(xr + 8) * hi;
            acc[r][b & 1] += t * sf;
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r][0] + acc[r][1];
}

static inline GEMV_FMA void bf16_tile(const float* xp, int64_t kp, int64_t K, const uint16_t* wr, v8f* out,
                                      const int mr) {
    v8f acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    (void)kp;
    for (int64_t k = 0; k < K; k += 8) {
        if ((k & 31) == 0) __builtin_prefetch(wr + k + GEMV_PREFETCH_BYTES / 2);
        uint16_t tail[8] = {0};
        const uint16_t* w8 = wr + k;
        if (k + 8 > K) { /* the row's last K % 8 weights; x is zero past K */
            memcpy(tail, w8, (size_t)(K - k) * sizeof(uint16_t));
            w8 = tail;
        }
        const v8f w = ld8_bf16(w8);
        for (int r = 0; r < mr; r++) acc[r][(k >> 3) & 1] += ld8_f32(xp + r * kp + k) * w;
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r][0] + acc[r][1];
}

/* Output rows n0..n1 of activation rows m0..m0+mr, 8 at a time through hsum8x8, the rest alone:
   sum * scale[n] + bias[n] (scale: the NVFP4 rows' S_dec, or none for BF16). */
#define GEMV_ROWS(TILE_AT, scale)                                                                            \
    do {                                                                                                     \
        v8f grp[TILE_ROWS][8], one[TILE_ROWS];                                                               \
        int64_t n = n0;                                                                                      \
        for (; n + 8 <= n1; n += 8) {                                                                        \
            for (int i = 0; i < 8; i++) {                                                                    \
                TILE_AT(n + i);                                                                              \
                for (int r = 0; r < mr; r++) grp[r][i] = one[r];                                             \
            }                                                                                                \
            for (int r = 0; r < mr; r++) {                                                                   \
                const v8f v = hsum8x8(grp[r]);                                                               \
                for (int i = 0; i < 8; i++)                                                                  \
                    store_out(y, y_bf16, (m0 + r) * N + n + i,                                               \
                              ((scale) ? v[i] * (scale)[n + i] : v[i]) + (bias ? bias[n + i] : 0.f));        \
            }                                                                                                \
        }                                                                                                    \
        for (; n < n1; n++) {                                                                                \
            TILE_AT(n);                                                                                      \
            for (int r = 0; r < mr; r++) {                                                                   \
                const float v = hsum8(one[r]);                                                               \
                store_out(y, y_bf16, (m0 + r) * N + n, ((scale) ? v * (scale)[n] : v) + (bias ? bias[n] : 0.f)); \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

GEMV_FMA void gemv_nvfp4_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes,
                              const uint8_t* scales, const float* gdec, const float* bias, void* y, int y_bf16, int64_t N,
                              int64_t n0, int64_t n1) {
    const int64_t kp = gemv_padded_k(K);
    (void)x_bf16; /* this build always reads laid-out fp32 rows */
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define NVFP4_VEC_ROW(R) nvfp4_tile((const float*)x + m0 * kp, kp, K, cr, sr, one, R)
#define NVFP4_VEC_AT(row)                                                                  \
    do {                                                                                   \
        const uint8_t *cr = codes + (row) * (K / 2), *sr = scales + (row) * (K / 16);      \
        TILE_SWITCH(mr, NVFP4_VEC_ROW)                                                     \
    } while (0)
        GEMV_ROWS(NVFP4_VEC_AT, gdec);
    }
}

GEMV_FMA void gemv_bf16_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                             void* y, int y_bf16, int64_t N, int64_t n0, int64_t n1) {
    const int64_t kp = gemv_padded_k(K);
    const float* none = 0; /* BF16 rows have no decode scale */
    (void)x_bf16;
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define BF16_VEC_ROW(R) bf16_tile((const float*)x + m0 * kp, kp, K, wr, one, R)
#define BF16_VEC_AT(row)                                                                   \
    do {                                                                                   \
        const uint16_t* wr = w + (row) * K;                                                \
        TILE_SWITCH(mr, BF16_VEC_ROW)                                                      \
    } while (0)
        GEMV_ROWS(BF16_VEC_AT, none);
    }
}
#endif
