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

static float E4M3_LUT[256];
static float E2M1_GRID[16];

void nvfp4_tables_init(void) {
    for (int b = 0; b < 256; b++) E4M3_LUT[b] = e4m3_to_f32((uint8_t)b);
    for (int c = 0; c < 16; c++) E2M1_GRID[c] = e2m1_to_f32((uint8_t)c);
}

const float* nvfp4_e4m3_lut(void) { return E4M3_LUT; }
const float* nvfp4_e2m1_grid(void) { return E2M1_GRID; }

/* x [R, K] -> data [R, K/2], scale [R, K/16], gs_out [R] (per-row S_enc; gs_in NULL) and optionally
   xhat [R, K] (the dequantized values). Returns 1 (outputs undefined) when x holds a NaN.
   The per-element loops are branch-free so the compiler vectorizes them; every value is computed
   by the same IEEE operations in the same order as the scalar reference. */
int nvfp4_qdq(const float* x, int64_t R, int64_t K, const float* gs_in, uint8_t* data, uint8_t* scale, float* gs_out,
              float* xhat) {
    const int64_t nb = K / 16;
    const float* bnd = E2M1_BOUNDS;
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
        const float s6 = s * NVFP4_ONE_SIXTH;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t sf = e4m3_enc(bam[b] * s6);
            scale[r * nb + b] = sf;
            const float sfd = E4M3_LUT[sf];
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
                            uint8_t* codes, uint8_t* scales) {
    if (!(gs[0] > 0.f && gs[0] <= FLT_MAX)) return 3;
    for (int64_t t = 0; t < T; t++) if (slots[t] < 0 || slots[t] >= S) return 2;
    for (int64_t t = 0; t < T; t++)
        if (nvfp4_qdq(x + t * n, 1, n, gs, codes + slots[t] * (n / 2), scales + slots[t] * (n / 16), 0, 0))
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
