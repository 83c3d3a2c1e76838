/* W4A4 NVFP4 x NVFP4 rows for decode (see cpu_gemv.h): both operands as fp4 codes, the block
 * products in exact integers, as NVFP4 GEMM hardware computes them:
 *     y[m, n] = adec[m] * wdec[n] * sum_b (SFa_b SFw_b / 4) * sum_{k in b} (2 ea_k) (2 ew_k)
 * The integer block sum (|.| <= 16 * 144) times the 8-significant-bit scale product is exact in fp32;
 * only the sum over blocks and the two global scales round, so the result equals fp4's dequantize
 * of both operands followed by a matmul to fp32 rounding.
 * AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so weights enter offset by +12
 * (2 ew + 12 in 0..24, straight from the nibble table) and each block's 12 * sum(2 ea) is
 * subtracted up front. Elsewhere fp32 vectors (exact: see the portable tile). Activations are laid
 * out once per call (gemv_w4a4_prepare), in the layout of the build's path.
 */
#include "cpu_gemv.h"

#include <string.h>

#include "cpu_fp4.h" /* E4M3 conversions, 2 e2m1 as int8, TILE_ROWS */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define W4A4_VNNI 1
#else
#define W4A4_VNNI 0
#endif

int64_t gemv_w4a4_chunks(int64_t K) { return (K + 127) / 128; }

#if W4A4_VNNI
int64_t gemv_w4a4_row_bytes(int64_t K) { return gemv_w4a4_chunks(K) * 256; }

/* Per activation row and 128-column chunk c (8 blocks): 64 bytes of 2 ea at even columns, 64 at
   odd columns (the packed bytes' low and high nibbles, in place), 16 int32 lanes of -6 * sum(2 ea)
   of the lane's block (two lanes per block), 16 fp32 lanes of SFa / 4 of the lane's block. Bytes
   per chunk: 128 + 64 + 64; zero past the row's end. */
void gemv_w4a4_prepare(const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K, uint8_t* out) {
    const int64_t chunks = gemv_w4a4_chunks(K), blocks = K / 16;
    for (int64_t m = 0; m < M; m++) {
        uint8_t* row = out + m * chunks * 256;
        memset(row, 0, (size_t)(chunks * 256));
        for (int64_t c = 0; c < chunks; c++) {
            int8_t *lo = (int8_t*)(row + c * 256), *hi = lo + 64;
            int32_t* corr = (int32_t*)(row + c * 256 + 128);
            float* sfa = (float*)(row + c * 256 + 192);
            for (int64_t j = 0; j < 8 && 8 * c + j < blocks; j++) {
                const int64_t b = 8 * c + j;
                int32_t s = 0;
                for (int64_t i = 0; i < 8; i++) {
                    const uint8_t byte = codes[m * (K / 2) + b * 8 + i];
                    lo[j * 8 + i] = TWO_E2M1_I8[byte & 15];
                    hi[j * 8 + i] = TWO_E2M1_I8[byte >> 4];
                    s += lo[j * 8 + i] + hi[j * 8 + i];
                }
                corr[2 * j] = corr[2 * j + 1] = -6 * s;
                sfa[2 * j] = sfa[2 * j + 1] = quarter_e4m3(scales[m * blocks + b]) * 4.f;  /* SFa; /4 on the weight side */
            }
        }
    }
}
#else
int64_t gemv_w4a4_row_bytes(int64_t K) { return 4 * (K + K / 16); }

/* Per activation row: K fp32 2 ea in column order (exact small integers), then K / 16 fp32 SFa. */
void gemv_w4a4_prepare(const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K, uint8_t* out) {
    const int64_t blocks = K / 16;
    for (int64_t m = 0; m < M; m++) {
        float* row = (float*)(out + m * gemv_w4a4_row_bytes(K));
        for (int64_t i = 0; i < K / 2; i++) {
            const uint8_t byte = codes[m * (K / 2) + i];
            row[2 * i] = TWO_E2M1_I8[byte & 15];
            row[2 * i + 1] = TWO_E2M1_I8[byte >> 4];
        }
        for (int64_t b = 0; b < blocks; b++) row[K + b] = quarter_e4m3(scales[m * blocks + b]) * 4.f; /* SFa */
    }
}
#endif

#if W4A4_VNNI
#define W4A4_FMA
/* Weight row n against MR prepared activation rows: one nibble decode of 128 weights serves all MR;
   acc[r] gets row r's 16 lane sums. */
static inline __attribute__((always_inline)) void w4a4_tile(const uint8_t* ap, int64_t chunks, int64_t K,
                                                            const uint8_t* cr, const uint8_t* sr, __m512* acc,
                                                            const int mr) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int64_t bytes = K / 2, blocks = K / 16;
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t left = bytes - 64 * c, lb = blocks - 8 * c;
        __builtin_prefetch(cr + 64 * c + GEMV_PREFETCH_BYTES);
        if ((c & 7) == 0) __builtin_prefetch(sr + 8 * c + GEMV_PREFETCH_BYTES / 8);
        const __m512i raw = left >= 64 ? _mm512_loadu_si512((const void*)(cr + 64 * c))
                                       : _mm512_maskz_loadu_epi8((__mmask64)((1ull << left) - 1ull), cr + 64 * c);
        const __m512i wl = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, low4));
        const __m512i wh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
        const __m128i s8 = lb >= 8 ? _mm_loadl_epi64((const __m128i*)(sr + 8 * c))
                                   : _mm_maskz_loadu_epi8((__mmask16)((1u << lb) - 1u), sr + 8 * c);
        const __m512i sd = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(s8, dup));
        const __m512 sw = _mm512_mul_ps(
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(sd, _mm512_set1_epi32(0x7f)), 20)),
            _mm512_set1_ps(0x1p118f));
        for (int r = 0; r < mr; r++) {
            const uint8_t* a = ap + (r * chunks + c) * 256;
            __m512i t = _mm512_loadu_si512((const void*)(a + 128));
            t = _mm512_dpbusd_epi32(t, wl, _mm512_loadu_si512((const void*)a));
            t = _mm512_dpbusd_epi32(t, wh, _mm512_loadu_si512((const void*)(a + 64)));
            const __m512 s = _mm512_mul_ps(sw, _mm512_loadu_ps((const float*)(a + 192)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[r]);
        }
    }
}

/* Output rows n0..n1 for activation rows m0..m0+mr: whole groups of 16 weight rows reduce together
   (reduce16_ps: the same sums as one row at a time, a third of the reduction work off the critical
   path; measured 1.20x on 9728x896, 1.14x on 896x4864, one thread), the rest one by one. */
static void w4a4_rows_avx512(const uint8_t* a, const float* adec, int64_t m0, int mr, int64_t K, const uint8_t* codes,
                             const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16,
                             int64_t N, int64_t n0, int64_t n1) {
    const int64_t chunks = gemv_w4a4_chunks(K);
    __m512 acc[TILE_ROWS][16], one[TILE_ROWS];
    int64_t n = n0;
#define W4A4_ACC(R) w4a4_tile(a, chunks, K, codes + (n + i) * (K / 2), scales + (n + i) * (K / 16), row, R)
    for (; n + 16 <= n1; n += 16) {
        for (int i = 0; i < 16; i++) {
            __m512 row[TILE_ROWS];
            TILE_SWITCH(mr, W4A4_ACC)
            for (int r = 0; r < mr; r++) acc[r][i] = row[r];
        }
        const __m512 w = _mm512_loadu_ps(wdec + n), b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(reduce16_ps(acc[r]), _mm512_set1_ps(adec[m0 + r])), w);
            store16_out(y, y_bf16, (m0 + r) * N + n, _mm512_add_ps(v, b));
        }
    }
#undef W4A4_ACC
    for (; n < n1; n++) {
        const uint8_t *cr = codes + n * (K / 2), *sr = scales + n * (K / 16);
#define W4A4_ONE(R) w4a4_tile(a, chunks, K, cr, sr, one, R)
        TILE_SWITCH(mr, W4A4_ONE)
#undef W4A4_ONE
        for (int r = 0; r < mr; r++)
            store_out(y, y_bf16, (m0 + r) * N + n,
                      _mm512_reduce_add_ps(one[r]) * adec[m0 + r] * wdec[n] + (bias ? bias[n] : 0.f));
    }
}

const char* gemv_w4a4_isa(void) { return "avx512-vnni"; }
#else
/* Portable: the same exact block products in 8-lane GCC/Clang vectors (AVX2 with x86-64-v3, SSE or
   NEON elsewhere), from fp32 activations laid out once (2 ea: exact small integers) against the
   weight's e2m1 values: a block's 16 products and their sum are exact in fp32 (multiples of 1/2
   below 2^11), and so is that sum times SFa SFw / 2; only the sum over blocks rounds, as in the
   AVX-512 path. */
#if defined(__GNUC__) && !defined(__clang__)
#define W4A4_FMA __attribute__((optimize("fp-contract=fast"))) /* exact products: contraction changes nothing */
#else
#define W4A4_FMA
#endif

static inline W4A4_FMA void w4a4_tile(const uint8_t* ap, int64_t K, const uint8_t* cr, const uint8_t* sr, v8f* out,
                                      const int mr) {
    const int64_t blocks = K / 16, row_floats = gemv_w4a4_row_bytes(K) / 4;
    v8f acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < blocks; b++) {
        if ((b & 7) == 0) __builtin_prefetch(cr + 8 * b + GEMV_PREFETCH_BYTES);
        v8f lo, hi;
        e2m1x16(cr + 8 * b, &lo, &hi);
        const float sw = half_e4m3(sr[b]);
        for (int r = 0; r < mr; r++) {
            const float* a = (const float*)ap + r * row_floats;
            const v8f t = ld8_f32(a + 16 * b) * lo + ld8_f32(a + 16 * b + 8) * hi;
            acc[r][b & 1] += t * (a[K + b] * sw);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r][0] + acc[r][1];
}

const char* gemv_w4a4_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "vec8-avx2";
#elif defined(__ARM_NEON) || defined(__aarch64__)
    return "vec8-neon";
#else
    return "vec8";
#endif
}
#endif

W4A4_FMA void gemv_w4a4_rows(const uint8_t* ap, const float* adec, int64_t M, int64_t K, const uint8_t* codes,
                    const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16, int64_t N,
                    int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
        const uint8_t* a = ap + m0 * gemv_w4a4_row_bytes(K);
#if W4A4_VNNI
        w4a4_rows_avx512(a, adec, m0, mr, K, codes, scales, wdec, bias, y, y_bf16, N, n0, n1);
#else
        for (int64_t n = n0; n < n1; n++) {
            v8f out[TILE_ROWS];
            const uint8_t *cr = codes + n * (K / 2), *sr = scales + n * (K / 16);
#define W4A4_CALL(R) w4a4_tile(a, K, cr, sr, out, R)
            TILE_SWITCH(mr, W4A4_CALL)
#undef W4A4_CALL
            for (int r = 0; r < mr; r++)
                store_out(y, y_bf16, (m0 + r) * N + n, hsum8(out[r]) * adec[m0 + r] * wdec[n] + (bias ? bias[n] : 0.f));
        }
#endif
    }
}
