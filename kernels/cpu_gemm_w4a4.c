/* W4A4 NVFP4 x NVFP4 GEMM for batches and prefill on CPU (more rows than decode's gemv tiles; see
 * cpu_gemv.h). The same exact integer block products as cpu_gemv_w4a4.c:
 *     y[m, n] = adec[m] * wdec[n] * sum_b (SFa_b SFw_b / 4) * sum_{k in b} (2 ea_k) (2 ew_k)
 * but with output rows in the vector lanes, so each block's scale product is one multiply per
 * 16 outputs and no horizontal sums are left at the end:
 *  - weights are read as stored (ModelOpt: uint8 [N, K/2] low nibble first, E4M3 [N, K/16]) and
 *    decoded once per call into a panel of 16 * GEMM_NV rows held in cache: per block and quad of
 *    4 columns, one dword lane per row holding its 4 codes as 2 ew + 12 (unsigned bytes, for
 *    vpdpbusd), and the row's SFw / 4 in fp32 lanes;
 *  - activations are laid out once per call (gemm_w4a4_prepare): 2 ea as signed bytes in column
 *    order, -12 * sum(2 ea) per block (undoing the weights' offset), SFa per block;
 *  - every block term is exact in fp32 (|integer sum| <= 16 * 144 times an 8-bit scale product),
 *    and the blocks are summed in column order into one fp32 accumulator per output, so a row's
 *    result does not depend on M, the tiling or the thread count, and the portable scalar build
 *    gives the same bits as the AVX-512 one.
 */
#include "cpu_gemv.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_fp4.h" /* E4M3 conversions, 2 e2m1 as int8, TILE_ROWS / TILE_SWITCH, store_out */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#define GEMM_VNNI 1
#else
#define GEMM_VNNI 0
#endif

#define GEMM_NV 3                /* 16-row weight vectors per panel */
#define GEMM_PANEL (16 * GEMM_NV) /* weight rows decoded together */
#define GEMM_CHUNK_BLOCKS 32      /* blocks (512 columns) decoded at a time: 30 KB of panel, L1-sized */

int64_t gemm_w4a4_panel_rows(void) { return GEMM_PANEL; }

int64_t gemm_w4a4_act_bytes(int64_t K) { return K + 8 * (K / 16); }

/* Per activation row: int8 2 ea [K], int32 -12 * sum(2 ea) [K/16], fp32 SFa [K/16]. */
void gemm_w4a4_prepare(const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K, uint8_t* out) {
    const int64_t blocks = K / 16, stride = gemm_w4a4_act_bytes(K);
    for (int64_t m = 0; m < M; m++) {
        int8_t* a = (int8_t*)(out + m * stride);
        int32_t corr[1];
        float sfa[1];
        for (int64_t b = 0; b < blocks; b++) {
            int32_t s = 0;
            for (int64_t i = 0; i < 8; i++) {
                const uint8_t byte = codes[m * (K / 2) + b * 8 + i];
                a[16 * b + 2 * i] = TWO_E2M1_I8[byte & 15];
                a[16 * b + 2 * i + 1] = TWO_E2M1_I8[byte >> 4];
                s += a[16 * b + 2 * i] + a[16 * b + 2 * i + 1];
            }
            corr[0] = -12 * s;
            sfa[0] = quarter_e4m3(scales[m * blocks + b]) * 4.f;
            memcpy(out + m * stride + K + 4 * b, corr, 4);
            memcpy(out + m * stride + K + 4 * (blocks + b), sfa, 4);
        }
    }
}

static inline int32_t act_corr(const uint8_t* a, int64_t K, int64_t b) {
    int32_t v;
    memcpy(&v, a + K + 4 * b, 4);
    return v;
}

static inline float act_sfa(const uint8_t* a, int64_t K, int64_t b) {
    float v;
    memcpy(&v, a + K + 4 * (K / 16 + b), 4);
    return v;
}

#if GEMM_VNNI
const char* gemm_w4a4_isa(void) { return "avx512-vnni"; }

/* Blocks b0 .. b1 - 1 of panel rows n0 .. n0 + GEMM_PANEL - 1 (rows >= N decode as zeros), with
   b relative to b0: wp[(4 b + q) NV + v] lane l = the 4 codes of row n0 + 16 v + l at columns
   16 b + 4 q .. + 3 as 2 ew + 12; sw[b NV + v] lane l = that row's SFw / 4 of block b. Two qword gathers fetch a block's 8 code bytes of 16 rows; one
   word permute per quad moves each row's 2 bytes into its dword lane and vpmultishiftqb spreads
   the 4 nibbles over the lane's 4 bytes. */
static void decode_panel(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t N, int64_t n0, int64_t b0,
                         int64_t b1, __m512i* wp, __m512* sw) {
    const int64_t blocks = K / 16, rb = K / 2;
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i spread = _mm512_set1_epi64(0x2C2824200C080400LL); /* bit offsets 0, 4, 8, 12 of each dword */
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i lane64 = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane32 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i quad[4];
    for (int q = 0; q < 4; q++) /* word 2 l <- word 4 l + q of the two gathers (row l's quad q) */
        quad[q] = _mm512_add_epi32(_mm512_slli_epi32(lane32, 2), _mm512_set1_epi32(q));
    /* the scale dword at min(b, blocks - 4) keeps the last row's reads inside its tensor */
    const int64_t last = blocks >= 4 ? blocks - 4 : 0;
    for (int v = 0; v < GEMM_NV; v++) {
        const int64_t base = n0 + 16 * v;
        const int64_t valid = N - base <= 0 ? 0 : N - base >= 16 ? 16 : N - base;
        const __mmask16 live = (__mmask16)((1u << valid) - 1u);
        const __mmask8 live_lo = (__mmask8)(live & 0xff), live_hi = (__mmask8)(live >> 8);
        const __m512i off_lo = _mm512_mullo_epi64(_mm512_add_epi64(lane64, _mm512_set1_epi64(base)), _mm512_set1_epi64(rb));
        const __m512i off_hi = _mm512_add_epi64(off_lo, _mm512_set1_epi64(8 * rb));
        const __m512i soff = _mm512_mullo_epi32(_mm512_add_epi32(lane32, _mm512_set1_epi32((int)base)),
                                                _mm512_set1_epi32((int)blocks));
        for (int64_t b = b0; b < b1; b++) {
            const __m512i blk = _mm512_set1_epi64(8 * b);
            const __m512i g0 = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live_lo, _mm512_add_epi64(off_lo, blk), codes, 1);
            const __m512i g1 = _mm512_mask_i64gather_epi64(_mm512_setzero_si512(), live_hi, _mm512_add_epi64(off_hi, blk), codes, 1);
            for (int q = 0; q < 4; q++) {
                const __m512i d = _mm512_maskz_permutex2var_epi16(0x55555555u, g0, quad[q], g1);
                const __m512i nib = _mm512_and_si512(_mm512_multishift_epi64_epi8(spread, d), low4);
                wp[(4 * (b - b0) + q) * GEMM_NV + v] = _mm512_shuffle_epi8(lut, nib);
            }
            if (blocks >= 4) {
                const int64_t at = b < last ? b : last;
                const __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                                _mm512_add_epi32(soff, _mm512_set1_epi32((int)at)), scales, 1);
                const __m512i sd = _mm512_srli_epi32(raw, (unsigned)(8 * (b - at)));
                sw[(b - b0) * GEMM_NV + v] = _mm512_mul_ps(
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(sd, _mm512_set1_epi32(0x7f)), 20)),
                    _mm512_set1_ps(0x1p118f));
            } else {
                float s[16] = {0};
                for (int64_t l = 0; l < valid; l++) s[l] = quarter_e4m3(scales[(base + l) * blocks + b]);
                sw[(b - b0) * GEMM_NV + v] = _mm512_loadu_ps(s);
            }
        }
    }
}

/* The next chunk's code and scale bytes (blocks b0 .. b1 - 1 of rows n0 ..) towards L2 while this one
   computes: its decode gathers 16 rows at a time, 48 interleaved streams the hardware prefetchers
   do not follow. */
static void prefetch_chunk(const uint8_t* codes, const uint8_t* scales, int64_t K, int64_t N, int64_t n0, int64_t b0,
                           int64_t b1) {
    const int64_t end = n0 + GEMM_PANEL < N ? n0 + GEMM_PANEL : N;
    const int64_t rb = K / 2, sb = K / 16;
    for (int64_t n = n0; n < end; n++) {
        for (int64_t o = 8 * b0; o < 8 * b1; o += 64) _mm_prefetch((const char*)(codes + n * rb + o), _MM_HINT_T1);
        _mm_prefetch((const char*)(codes + n * rb + 8 * b1 - 1), _MM_HINT_T1);
        _mm_prefetch((const char*)(scales + n * sb + b0), _MM_HINT_T1);
    }
}

/* MR prepared activation rows against blocks b0 .. b1 - 1 of a decoded panel, continuing the fp32
   sums in acc[r * GEMM_PANEL + 16 v + l] (zeros before the first chunk). */
static inline __attribute__((always_inline)) void gemm_tile(const uint8_t* a0, int64_t stride, int64_t K, int64_t b0,
                                                            int64_t b1, const __m512i* wp, const __m512* sw, float* acc,
                                                            const int mr) {
    __m512 facc[TILE_ROWS][GEMM_NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < GEMM_NV; v++) facc[r][v] = _mm512_loadu_ps(acc + r * GEMM_PANEL + 16 * v);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t j = b - b0;
        __m512i iacc[TILE_ROWS][GEMM_NV];
        for (int r = 0; r < mr; r++) {
            const __m512i c = _mm512_set1_epi32(act_corr(a0 + r * stride, K, b));
            for (int v = 0; v < GEMM_NV; v++) iacc[r][v] = c;
        }
        for (int q = 0; q < 4; q++) {
            __m512i w[GEMM_NV];
            for (int v = 0; v < GEMM_NV; v++) w[v] = wp[(4 * j + q) * GEMM_NV + v];
            for (int r = 0; r < mr; r++) {
                int32_t xq;
                memcpy(&xq, a0 + r * stride + 16 * b + 4 * q, 4);
                const __m512i x = _mm512_set1_epi32(xq);
                for (int v = 0; v < GEMM_NV; v++) iacc[r][v] = _mm512_dpbusd_epi32(iacc[r][v], w[v], x);
            }
        }
        for (int r = 0; r < mr; r++) {
            const __m512 sa = _mm512_set1_ps(act_sfa(a0 + r * stride, K, b));
            for (int v = 0; v < GEMM_NV; v++)
                facc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][v]), _mm512_mul_ps(sw[j * GEMM_NV + v], sa), facc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < GEMM_NV; v++) _mm512_storeu_ps(acc + r * GEMM_PANEL + 16 * v, facc[r][v]);
}

int gemm_w4a4_panels(const uint8_t* ap, const float* adec, int64_t M, int64_t K, const uint8_t* codes,
                     const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16, int64_t N,
                     int64_t p0, int64_t p1) {
    const int64_t blocks = K / 16, stride = gemm_w4a4_act_bytes(K);
    const int64_t chunk = blocks < GEMM_CHUNK_BLOCKS ? blocks : GEMM_CHUNK_BLOCKS;
    const size_t wbytes = (size_t)(4 * chunk * GEMM_NV) * 64, sbytes = (size_t)(chunk * GEMM_NV) * 64;
    const size_t abytes = (size_t)(M * GEMM_PANEL) * sizeof(float);
    uint8_t* scratch = (uint8_t*)aligned_alloc(64, wbytes + sbytes + abytes);
    if (!scratch) return 1;
    __m512i* wp = (__m512i*)scratch;
    __m512* sw = (__m512*)(scratch + wbytes);
    float* acc = (float*)(scratch + wbytes + sbytes); /* [M][GEMM_PANEL] running sums of this panel */
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * GEMM_PANEL;
        memset(acc, 0, abytes);
        for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
            const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
            decode_panel(codes, scales, K, N, n0, b0, b1, wp, sw);
            if (b1 < blocks)
                prefetch_chunk(codes, scales, K, N, n0, b1, b1 + chunk < blocks ? b1 + chunk : blocks);
            else if (p + 1 < p1)
                prefetch_chunk(codes, scales, K, N, n0 + GEMM_PANEL, 0, chunk);
            for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
                const int mr = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define GEMM_CALL(R) gemm_tile(ap + m0 * stride, stride, K, b0, b1, wp, sw, acc + m0 * GEMM_PANEL, R)
                TILE_SWITCH(mr, GEMM_CALL)
#undef GEMM_CALL
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < GEMM_PANEL && n0 + j < N; j++)
                store_out(y, y_bf16, m * N + n0 + j,
                          acc[m * GEMM_PANEL + j] * adec[m] * wdec[n0 + j] + (bias ? bias[n0 + j] : 0.f));
    }
    free(scratch);
    return 0;
}
#else
const char* gemm_w4a4_isa(void) { return "scalar"; }

/* Portable C: the same block terms, summed in the same order, so the same bits. */
int gemm_w4a4_panels(const uint8_t* ap, const float* adec, int64_t M, int64_t K, const uint8_t* codes,
                     const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16, int64_t N,
                     int64_t p0, int64_t p1) {
    const int64_t blocks = K / 16, stride = gemm_w4a4_act_bytes(K);
    const int64_t n_end = p1 * GEMM_PANEL < N ? p1 * GEMM_PANEL : N;
    for (int64_t n = p0 * GEMM_PANEL; n < n_end; n++)
        for (int64_t m = 0; m < M; m++) {
            const uint8_t* a = ap + m * stride;
            float acc = 0.f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t s = act_corr(a, K, b);
                for (int64_t i = 0; i < 8; i++) {
                    const uint8_t byte = codes[n * (K / 2) + b * 8 + i];
                    s += (int32_t)(int8_t)a[16 * b + 2 * i] * (TWO_E2M1_I8[byte & 15] + 12) +
                         (int32_t)(int8_t)a[16 * b + 2 * i + 1] * (TWO_E2M1_I8[byte >> 4] + 12);
                }
                acc += (float)s * (quarter_e4m3(scales[n * blocks + b]) * act_sfa(a, K, b));
            }
            store_out(y, y_bf16, m * N + n, acc * adec[m] * wdec[n] + (bias ? bias[n] : 0.f));
        }
    return 0;
}
#endif
