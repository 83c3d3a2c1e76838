/* NVFP4 quantize / dequantize on CPU; see cpu_quant.h.
 *
 * A rollout decode step quantizes a few dozen tiny activations; the torch reference spends ~50
 * small ops on each. These do quantize (+ dequantize) of a whole tensor, and the gather +
 * dequantize of FP4 KV slots, in one pass each. They repeat the reference's fp32 steps in the
 * same order (built without FMA contraction or fast-math), so every byte and float matches.
 */
#include "cpu_quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "cpu_fp4.h"

#define E2M1_MAX_F 6.f /* the largest E2M1 magnitude: guided rounding brackets beyond it as 6 */

static float E4M3_LUT[256];
static float E2M1_GRID[16];

void nvfp4_tables_init(void) {
    for (int b = 0; b < 256; b++) E4M3_LUT[b] = e4m3_to_f32((uint8_t)b);
    for (int c = 0; c < 16; c++) E2M1_GRID[c] = e2m1_to_f32((uint8_t)c);
}

const float* nvfp4_e4m3_lut(void) { return E4M3_LUT; }
const float* nvfp4_e2m1_grid(void) { return E2M1_GRID; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QDQ_AVX512 1
#else
#define QDQ_AVX512 0
#endif

/* The 16 values of block b of a row as fp32 (bf16 widens exactly). */
static inline void load16(const void* x, int x_bf16, int64_t b, float* out) {
    if (x_bf16)
        for (int j = 0; j < 16; j++) out[j] = bf16_to_f32(((const uint16_t*)x)[b * 16 + j]);
    else
        memcpy(out, (const float*)x + b * 16, 16 * sizeof(float));
}

#if QDQ_AVX512
static inline __m512 load16_avx512(const void* x, int x_bf16, int64_t b) {
    if (!x_bf16) return _mm512_loadu_ps((const float*)x + b * 16);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + b * 16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Block amaxes of one row into bam; returns 1 when the row holds a NaN. A max of non-negative
   floats is the same in any order. */
static int block_amax(const void* x, int x_bf16, int64_t nb, float* bam) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = 0;
    for (int64_t b = 0; b < nb; b++) {
        const __m512 v = load16_avx512(x, x_bf16, b);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        bam[b] = _mm512_reduce_max_ps(_mm512_and_ps(v, abs_mask));
    }
    return nan != 0;
}

/* Block b: codes of x * enc (the compares against E2M1_BOUNDS counted, sign to bit 3) packed low
   nibble first into db[8], and when xhat is set its dequantized values (e2m1 * sfd) * sdec. */
static inline void encode_block(const void* x, int x_bf16, int64_t b, float enc, float sfd, float sdec, uint8_t* db,
                                void* xhat, int xhat_bf16) {
    const __m512 z = _mm512_mul_ps(load16_avx512(x, x_bf16, b), _mm512_set1_ps(enc));
    const __m512 m = _mm512_and_ps(z, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)));
    const __m512i one = _mm512_set1_epi32(1);
    __m512i code = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(z), 28), _mm512_set1_epi32(8));
    for (int i = 0; i < 7; i++)
        code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(m, _mm512_set1_ps(E2M1_BOUNDS[i]), _CMP_GT_OQ), code,
                                     one);
    const __m128i c8 = _mm512_cvtepi32_epi8(code);                      /* 16 codes, one per byte */
    const __m128i pairs = _mm_maddubs_epi16(c8, _mm_set1_epi16(0x1001)); /* lo + 16 * hi per byte pair */
    _mm_storel_epi64((__m128i*)db, _mm_packus_epi16(pairs, pairs));
    if (!xhat) return;
    const __m512 v = _mm512_permutexvar_ps(code, _mm512_loadu_ps(E2M1_GRID));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(sfd)), _mm512_set1_ps(sdec));
    if (!xhat_bf16) {
        _mm512_storeu_ps((float*)xhat + b * 16, y);
        return;
    }
    __m512i u = _mm512_castps_si512(y); /* round to nearest even as torch's bf16 cast (y is never NaN) */
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    _mm256_storeu_si256((__m256i*)((uint16_t*)xhat + b * 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#else
static int block_amax(const void* x, int x_bf16, int64_t nb, float* bam) {
    int nan = 0;
    for (int64_t b = 0; b < nb; b++) {
        float xb[16], m = 0.f;
        load16(x, x_bf16, b, xb);
        for (int j = 0; j < 16; j++) {
            const float a = fabsf(xb[j]);
            nan |= a != a;
            m = a > m ? a : m;
        }
        bam[b] = m;
    }
    return nan;
}

static inline void encode_block(const void* x, int x_bf16, int64_t b, float enc, float sfd, float sdec, uint8_t* db,
                                void* xhat, int xhat_bf16) {
    const float* bnd = E2M1_BOUNDS;
    float xb[16];
    int32_t code[16];
    load16(x, x_bf16, b, xb);
    for (int j = 0; j < 16; j++) { /* branch-free, so the compiler vectorizes it */
        const float z = xb[j] * enc, m = fabsf(z);
        int32_t bits;
        memcpy(&bits, &z, 4);
        code[j] = (m > bnd[0]) + (m > bnd[1]) + (m > bnd[2]) + (m > bnd[3]) + (m > bnd[4]) + (m > bnd[5]) +
                  (m > bnd[6]) + ((bits >> 28) & 8); /* the sign bit (signbit(z)) -> bit 3 */
    }
    for (int j = 0; j < 8; j++) db[j] = (uint8_t)(code[2 * j] | (code[2 * j + 1] << 4));
    if (!xhat) return;
    for (int j = 0; j < 16; j++) {
        const float y = (E2M1_GRID[code[j]] * sfd) * sdec;
        if (xhat_bf16)
            ((uint16_t*)xhat)[b * 16 + j] = f32_to_bf16(y);
        else
            ((float*)xhat)[b * 16 + j] = y;
    }
}
#endif

/* Rows [r0, r1) of x [R, K] (fp32, or bf16 when x_bf16) -> data [R, K/2], scale [R, K/16], gs_out
   [R] (per-row S_enc; gs_in NULL) and optionally xhat [R, K] (the dequantized values, fp32 or
   bf16 rounded to nearest even as torch's cast). Returns 1 (outputs undefined) when x holds a NaN.
   Every value is computed by the same IEEE operations in the same order as the scalar reference;
   rows are independent, so any split of them over threads gives the same bytes. */
int nvfp4_qdq_rows(const void* x, int x_bf16, int64_t r0, int64_t r1, int64_t K, const float* gs_in, uint8_t* data,
                   uint8_t* scale, float* gs_out, void* xhat, int xhat_bf16) {
    const int64_t nb = K / 16, esize = x_bf16 ? 2 : 4, hsize = xhat_bf16 ? 2 : 4;
    float bam[nb > 0 ? nb : 1];
    for (int64_t r = r0; r < r1; r++) {
        const void* xr = (const char*)x + r * K * esize;
        void* hr = xhat ? (char*)xhat + r * K * hsize : 0;
        if (block_amax(xr, x_bf16, nb, bam)) return 1;
        float ramax = 0.f;
        for (int64_t b = 0; b < nb; b++) ramax = bam[b] > ramax ? bam[b] : ramax;
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
        const float s6 = s * NVFP4_ONE_SIXTH;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t sf = e4m3_enc(bam[b] * s6);
            scale[r * nb + b] = sf;
            const float sfd = E4M3_LUT[sf];
            float enc = 1.0f / (sfd * sdec);
            if (enc > FLT_MAX) enc = FLT_MAX;
            encode_block(xr, x_bf16, b, enc, sfd, sdec, data + r * (K / 2) + b * 8, hr, xhat_bf16);
        }
    }
    return 0;
}

int nvfp4_qdq(const float* x, int64_t R, int64_t K, const float* gs_in, uint8_t* data, uint8_t* scale, float* gs_out,
              float* xhat) {
    return nvfp4_qdq_rows(x, 0, 0, R, K, gs_in, data, scale, gs_out, xhat, 0);
}

/* Row t of x [T, n] (one S_enc) quantized straight into codes[slots[t]] [*, n/2] and
   scales[slots[t]] [*, n/16] of S slots: a KV-cache write without temporaries. Returns 1 on a
   NaN, 2 for a slot outside [0, S), 3 for an S_enc that is not finite and positive; on 2 and 3
   nothing was written. */
int nvfp4_quantize_to_slots(const float* x, int64_t T, int64_t n, const float* gs, const int64_t* slots, int64_t S,
                            uint8_t* codes, uint8_t* scales) {
    if (!(gs[0] > 0.f && gs[0] <= FLT_MAX)) return 3;
    for (int64_t t = 0; t < T; t++) if (slots[t] < 0 || slots[t] >= S) return 2;
    for (int64_t t = 0; t < T; t++)
        if (nvfp4_qdq(x + t * n, 1, n, gs, codes + slots[t] * (n / 2), scales + slots[t] * (n / 16), 0, 0))
            return 1;
    return 0;
}

/* FP8 E4M3 rows of a KV write, as fp4.fp8.quantize(x, dims=2): row t of x [T, n] (one token's K or V
   over its KV heads) -> codes[slots[t]] [*, n] and S_dec[slots[t]], with S_enc = min(448 / amax, FLT_MAX)
   (1 for an amax of 0 or Inf, or an S_enc of 0), NaN left out of the amax; codes e4m3_rn_satfinite(x *
   S_enc), NaN -> 0x7F. Returns 2 (nothing written) for a slot outside [0, S), else 0. */
int fp8_quantize_to_slots(const float* x, int64_t T, int64_t n, const int64_t* slots, int64_t S, uint8_t* codes,
                          float* sdec) {
    for (int64_t t = 0; t < T; t++) if (slots[t] < 0 || slots[t] >= S) return 2;
    for (int64_t t = 0; t < T; t++) {
        const float* r = x + t * n;
        float amax = 0.f;
        for (int64_t i = 0; i < n; i++) {
            const float a = fabsf(r[i]);
            amax = a > amax ? a : amax;  /* a NaN compares false: left out */
        }
        float s = 448.f / amax;
        s = s > FLT_MAX ? FLT_MAX : s;
        if (amax == 0.f || isinf(amax) || s == 0.f || s != s) s = 1.f;
        uint8_t* c = codes + slots[t] * n;
        for (int64_t i = 0; i < n; i++) {
            const float v = r[i] * s;
            c[i] = v != v ? 0x7f : (uint8_t)((signbit(v) ? 0x80 : 0) | e4m3_enc(fabsf(v)));
        }
        sdec[slots[t]] = (float)(1.0 / (double)s);
    }
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
void nvfp4_gather_dequant(const uint8_t* codes, const uint8_t* scales, const int64_t* idx, int64_t N, int64_t row,
                          int64_t cstride, int64_t sstride, float sdec, float* out) {
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* c = codes + idx[n] * cstride;
        const uint8_t* sc = scales + idx[n] * sstride;
        float* o = out + n * row;
        for (int64_t b = 0; b < row / 16; b++) {
            const float sfd = E4M3_LUT[sc[b]];
            v8f lo, hi;
            e2m1x16(c + b * 8, &lo, &hi);
            lo = (lo * sfd) * sdec;
            hi = (hi * sfd) * sdec;
            memcpy(o + b * 16, &lo, sizeof lo);
            memcpy(o + b * 16 + 8, &hi, sizeof hi);
        }
    }
}

/* E2M1 code of signed-grid index p (-7..7); a zero takes z's sign (fp4.guided.codes_from_index). */
static inline int code_of_index(int p, int neg_z) { return (p < 0 ? -p : p) | ((p < 0 || (p == 0 && neg_z)) << 3); }

static inline int nibble(const uint8_t* packed, int64_t i) { return (packed[i >> 1] >> ((i & 1) * 4)) & 15; }

/* The 16 elements i0..i0+15 of one block: guided codes of z = x * enc (the scalar statement of
   fp4.guided._guided_codes), their values (e2m1 * sfd) * sdec into out, counts[0..1] added to. */
static void guided_block_scalar(const void* x, int x_bf16, int64_t i0, float enc, float sfd, float sdec,
                                const uint8_t* codes, const uint8_t* mant, const uint8_t* rtn,
                                const uint8_t* agree_ref, void* out, int out_bf16, int64_t* counts) {
    for (int64_t i = i0; i < i0 + 16; i++) {
        const float xv = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
        const float z = xv * enc;
        int code = 7; /* NaN */
        if (z == z) {
            const float a = fabsf(z), mag = a < E2M1_MAX_F ? a : E2M1_MAX_F;
            const int lo_m = (mag >= 0.5f) + (mag >= 1.f) + (mag >= 1.5f) + (mag >= 2.f) + (mag >= 3.f) +
                             (mag >= 4.f) + (mag >= 6.f);
            const int on_grid = E2M1_GRID[lo_m] == mag;
            const int hi_m = lo_m + !on_grid, neg = signbit(z) != 0;
            int lo = neg ? -hi_m : lo_m, hi = neg ? -lo_m : hi_m;
            if (codes) {
                const int ref = nibble(codes, i), ri = (ref & 8) ? -(ref & 7) : (ref & 7);
                if (on_grid && a <= E2M1_MAX_F) { /* on a grid point: one codeword either side counts */
                    lo = lo - 1 < -7 ? -7 : lo - 1;
                    hi = hi + 1 > 7 ? 7 : hi + 1;
                }
                int pick = ri < hi ? ri : hi;
                pick = pick > lo ? pick : lo;
                code = pick == ri ? ref : code_of_index(pick, neg);
            } else {
                const int bit = (mant[i >> 3] >> (i & 7)) & 1;
                code = code_of_index(((hi < 0 ? -hi : hi) & 1) == bit ? hi : lo, neg);
            }
        }
        store_out(out, out_bf16, i, (E2M1_GRID[code] * sfd) * sdec);
        if (rtn) counts[0] += code != nibble(rtn, i);
        if (agree_ref) {
            const int ref = nibble(agree_ref, i);
            counts[1] += (code == 8 ? 0 : code) == (ref == 8 ? 0 : ref);
        }
    }
}

#if QDQ_AVX512
/* 16 packed nibbles (8 bytes, low nibble first) -> 16 int32 lanes. */
static inline __m512i nibbles16(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)p);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
}

/* guided_block_scalar for mantissa guidance, 16 lanes at once. With z's sign s, the bracket's
   magnitudes are lo_m <= hi_m and the code is (the one of them whose parity is the rollout's bit,
   taking |hi| = s ? lo_m : hi_m first) | s << 3: codes_from_index gives every element of a
   negative bracket (zero included, z being -0 or below) the sign bit and none of a positive one. */
static void guided_block_mantissa_avx512(const void* x, int x_bf16, int64_t i0, float enc, float sfd, float sdec,
                                         const uint8_t* mant, const uint8_t* rtn, const uint8_t* agree_ref,
                                         void* out, int out_bf16, int64_t* counts) {
    const __m512 z = _mm512_mul_ps(load16_avx512(x, x_bf16, i0 / 16), _mm512_set1_ps(enc));
    const __mmask16 nan = _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q);
    const __m512 mag = _mm512_min_ps(_mm512_and_ps(z, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff))),
                                     _mm512_set1_ps(E2M1_MAX_F));
    const __m512i one = _mm512_set1_epi32(1);
    __m512i lo_m = _mm512_setzero_si512();
    for (int g = 1; g < 8; g++) /* grid points 0.5 .. 6 at or below mag */
        lo_m = _mm512_mask_add_epi32(lo_m, _mm512_cmp_ps_mask(mag, _mm512_set1_ps(E2M1_GRID[g]), _CMP_GE_OQ), lo_m, one);
    const __m512 grid = _mm512_loadu_ps(E2M1_GRID);
    const __mmask16 on_grid = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(lo_m, grid), mag, _CMP_EQ_OQ);
    const __m512i hi_m = _mm512_mask_add_epi32(lo_m, (__mmask16)~on_grid, lo_m, one);
    const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(z), 31);
    const __mmask16 neg = _mm512_test_epi32_mask(sign, one);
    const __m512i hmag = _mm512_mask_blend_epi32(neg, hi_m, lo_m), lmag = _mm512_mask_blend_epi32(neg, lo_m, hi_m);
    uint16_t bits;
    memcpy(&bits, mant + (i0 >> 3), 2); /* element j of the block at bit j (i0 % 16 == 0) */
    const __mmask16 parity = _mm512_test_epi32_mask(hmag, one);
    const __mmask16 take_hi = (__mmask16)~(parity ^ bits);
    __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(take_hi, lmag, hmag), _mm512_slli_epi32(sign, 3));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(7));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_permutexvar_ps(code, grid), _mm512_set1_ps(sfd)),
                                   _mm512_set1_ps(sdec));
    if (out_bf16) { /* y is never NaN here (the caller takes NaN block scales scalar): the RNE add is exact */
        __m512i u = _mm512_castps_si512(y);
        u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                             _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + i0), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_storeu_ps((float*)out + i0, y);
    }
    if (rtn) counts[0] += __builtin_popcount(_mm512_cmpneq_epi32_mask(code, nibbles16(rtn + (i0 >> 1))));
    if (agree_ref) {
        const __m512i eight = _mm512_set1_epi32(8), zero = _mm512_setzero_si512();
        const __m512i ref = nibbles16(agree_ref + (i0 >> 1));
        const __m512i c0 = _mm512_mask_mov_epi32(code, _mm512_cmpeq_epi32_mask(code, eight), zero);
        const __m512i r0 = _mm512_mask_mov_epi32(ref, _mm512_cmpeq_epi32_mask(ref, eight), zero);
        counts[1] += __builtin_popcount(_mm512_cmpeq_epi32_mask(c0, r0));
    }
}
#endif

/* Rows [r0, r1) of TRACE's guided rounding (fp4.guided.guided_quantize), dequantized: row r of x [R, K]
   (fp32, or bf16 when x_bf16) scaled with the rollout's E4M3 block scales scale [R, K/16] and S_enc
   (gs[r], or gs[0] when !gs_per_row), each element bracketed by its two E2M1 neighbours and pinned to
   the rollout's packed codes codes [R, K/2] (full guidance) or packed mantissa bits mant [R, K/8]
   (exactly one set); rows with mask[r] get their values (nvfp4.dequantize: (e2m1 * sfd) * sdec) in
   out [R, K] (fp32, or bf16 rounded to nearest even when out_bf16), other rows are left as they are.
   counts[3] += (elements whose guided code differs from rtn's packed codes [R, K/2] when rtn is set,
   elements whose value-code equals agree_ref's (both zeros one code) when agree_ref is set, elements
   guided). Every fp32 step is the reference's, in its order; mantissa guidance runs 16 lanes at a
   time where the build has AVX-512. */
void nvfp4_guided_dq_rows(const void* x, int x_bf16, int64_t r0, int64_t r1, int64_t K, const uint8_t* scale,
                          const float* gs, int gs_per_row, const uint8_t* codes, const uint8_t* mant,
                          const uint8_t* mask, const uint8_t* rtn, const uint8_t* agree_ref, void* out, int out_bf16,
                          int64_t* counts) {
    const int64_t nb = K / 16;
    int64_t c[2] = {0, 0}, guided = 0;
    for (int64_t r = r0; r < r1; r++) {
        if (!mask[r]) continue;
        const float sdec = (float)(1.0 / (double)gs[gs_per_row ? r : 0]);
        for (int64_t b = 0; b < nb; b++) {
            const float sfd = E4M3_LUT[scale[r * nb + b]];
            float enc = 1.0f / (sfd * sdec);
            if (enc > FLT_MAX) enc = FLT_MAX;
            const int64_t i0 = r * K + b * 16;
#if QDQ_AVX512
            if (!codes && sfd == sfd) {
                guided_block_mantissa_avx512(x, x_bf16, i0, enc, sfd, sdec, mant, rtn, agree_ref, out, out_bf16, c);
                continue;
            }
#endif
            guided_block_scalar(x, x_bf16, i0, enc, sfd, sdec, codes, mant, rtn, agree_ref, out, out_bf16, c);
        }
        guided += K;
    }
    if (counts) {
        counts[0] += c[0];
        counts[1] += c[1];
        counts[2] += guided;
    }
}
