/* Paged attention of the engine's CPU kernels, prefill and decode alike (see cpu_fused.h).
 *
 * Three kernels: pages in the model dtype, NVFP4 K and V, and K and V each in its own format
 * (model dtype, NVFP4 or FP8 E4M3 with a per-(token, KV head) scale: paged_attention_kv).
 * Row t of q attends to the first row_len[t] positions of its sequence, whose KV slots a table
 * row lists; FP4 pages are decoded in registers with cpu_quant's tables (never gathered into a
 * dequantized copy). Scores of 8 positions share one horizontal-sum network; K/V rows are
 * prefetched ahead, since on CPU this step is bound by streaming the pages in.
 * Included by cpu_fused.c once per element type, with ELEM the type (float, uint16_t for bf16)
 * and F(name) its suffixed name (name_f32, name_bf16): no include guard on purpose.
 */
static inline void F(axpy)(float* y, float a, const ELEM* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v = ld8_f32(y + i) + a * F(ld8)(x + i);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] += a * F(ld)(x[i]);
}

static inline float F(dot)(const float* a, const ELEM* b, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += ld8_f32(a + i) * F(ld8)(b + i);
    float s = 0.f;
    for (; i < n; i++) s += a[i] * F(ld)(b[i]);
    return s + hsum8(acc);
}

/* Scores of every query head against 8 KV rows (pointers kr, D % 8 == 0) into sc[h * W + 0..7]. */
static inline void F(scores8)(const float* qf, const ELEM* const* kr, int64_t H, int64_t G, int64_t D, float* sc,
                              int64_t W) {
    for (int64_t h = 0; h < H; h++) {
        const int64_t off = (h / G) * D;
        v8f p[8];
        for (int r = 0; r < 8; r++) {
            v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t d = 0; d < D; d += 8) a += ld8_f32(qf + h * D + d) * F(ld8)(kr[r] + off + d);
            p[r] = a;
        }
        const v8f s = hsum8x8(p);
        memcpy(sc + h * W, &s, sizeof s);
    }
}

/* Pieces both attention kernels share: the widest row, a query row scaled into fp32, the softmax
   numerators in place, and the normalized output. */
static int64_t F(widest)(const int64_t* row_len, int64_t T) {
    int64_t W = 1;
    for (int64_t t = 0; t < T; t++) if (row_len[t] > W) W = row_len[t];
    return W;
}

static void F(load_query)(const ELEM* q, int64_t n, float scale, float* qf, float* acc) {
    for (int64_t i = 0; i < n; i++) { qf[i] = F(ld)(q[i]) * scale; acc[i] = 0.f; }
}

static void F(softmax_numerators)(float* sc, int64_t H, int64_t W, int64_t L) {
    for (int64_t h = 0; h < H; h++) {
        float* p = sc + h * W;
        float m = -INFINITY;
        for (int64_t j = 0; j < L; j++) m = p[j] > m ? p[j] : m;
        for (int64_t j = 0; j < L; j++) p[j] = fexp(p[j] - m);
    }
}

static void F(write_output)(const float* acc, const float* sc, int64_t H, int64_t W, int64_t L, int64_t D, ELEM* o) {
    for (int64_t h = 0; h < H; h++) {
        const float den = sum(sc + h * W, L), inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; i++) o[h * D + i] = F(st)(acc[h * D + i] * inv);
    }
}

/* Row t of q [T, H, D] belongs to sequence row_seq[t] and sees its first row_len[t] positions,
   whose KV slots are table[row_seq[t] * ldt + j]; kc/vc [slots, Hkv, D]. out [T, H, D].
   Each K and V row (all KV heads) is read once per query row, front to back, so the hardware
   prefetcher streams the pages; query head h uses KV head h / (H / Hkv). */
int F(paged_attention)(const ELEM* q, const ELEM* kc, const ELEM* vc, const int64_t* table, int64_t ldt,
                       const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                       int64_t D, float scale, ELEM* out) {
    const int64_t G = H / Hkv, kvrow = Hkv * D;
    const int64_t W = F(widest)(row_len, T);
    float* qf = (float*)malloc((size_t)(2 * H * D + H * W) * sizeof(float));  /* heap: long contexts overflow stacks */
    if (!qf) return 1;
    float *acc = qf + H * D, *sc = acc + H * D;
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        F(load_query)(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const ELEM* kr[8];
            for (int r = 0; r < 8; r++) kr[r] = kc + tab[j0 + r] * kvrow;
            for (int r = 0; r < 8 && j0 + PREFETCH + r < L; r++)
                prefetch_row(kc + tab[j0 + PREFETCH + r] * kvrow, kvrow * (int64_t)sizeof(ELEM));
            F(scores8)(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            const ELEM* kr = kc + tab[j] * kvrow;
            if (j + PREFETCH < L) prefetch_row(kc + tab[j + PREFETCH] * kvrow, kvrow * (int64_t)sizeof(ELEM));
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = F(dot)(qf + h * D, kr + kh * D, D);
        }
        F(softmax_numerators)(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            const ELEM* vr = vc + tab[j] * kvrow;
            if (j + PREFETCH < L) prefetch_row(vc + tab[j + PREFETCH] * kvrow, kvrow * (int64_t)sizeof(ELEM));
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) F(axpy)(acc + h * D, sc[h * W + j], vr + kh * D, D);
        }
        F(write_output)(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

/* The same attention over NVFP4 pages: codes [slots, Hkv, D/2] (low nibble first) and E4M3 block
   scales [slots, Hkv, D/16] of K and V. Each element is decoded as fp4.nvfp4.dequantize does,
   dtype((grid[code] * lut[scale]) * s_dec), one row at a time into a buffer, never a gathered copy. */
static void F(nvfp4_row)(const uint8_t* c, const uint8_t* s, int64_t n, const float* lut, const float (*pairs)[2],
                         float sdec, float* out) {
    for (int64_t b = 0; b < n / 16; b++) {
        const float sf = lut[s[b]];
        float* o = out + b * 16;
        for (int i = 0; i < 8; i++) memcpy(o + 2 * i, pairs[c[b * 8 + i]], 2 * sizeof(float));
        v8f lo, hi;
        memcpy(&lo, o, sizeof lo);
        memcpy(&hi, o + 8, sizeof hi);
        lo = F(rnd8)((lo * sf) * sdec);
        hi = F(rnd8)((hi * sf) * sdec);
        memcpy(o, &lo, sizeof lo);
        memcpy(o + 8, &hi, sizeof hi);
    }
}

int F(paged_attention_nvfp4)(const ELEM* q, const uint8_t* kc, const uint8_t* ks, const uint8_t* vc,
                             const uint8_t* vs, float sdec_k, float sdec_v, const int64_t* table, int64_t ldt,
                             const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                             int64_t D, float scale, ELEM* out) {
    const int64_t G = H / Hkv, n = Hkv * D;
    const int64_t W = F(widest)(row_len, T);
    float* qf = (float*)malloc((size_t)(2 * H * D + 8 * n + H * W) * sizeof(float));
    if (!qf) return 1;
    float *acc = qf + H * D, *row = acc + H * D, *sc = row + 8 * n;
    const float *lut = nvfp4_e4m3_lut(), *grid = nvfp4_e2m1_grid();
    float pairs[256][2];  /* both E2M1 values of each packed byte: one 8-byte copy per byte */
    for (int b = 0; b < 256; b++) { pairs[b][0] = grid[b & 15]; pairs[b][1] = grid[b >> 4]; }
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        F(load_query)(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const float* kr[8];
            for (int r = 0; r < 8; r++) {
                F(nvfp4_row)(kc + tab[j0 + r] * (n / 2), ks + tab[j0 + r] * (n / 16), n, lut, pairs, sdec_k,
                             row + r * n);
                kr[r] = row + r * n;
            }
            scores8_f32(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            F(nvfp4_row)(kc + tab[j] * (n / 2), ks + tab[j] * (n / 16), n, lut, pairs, sdec_k, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = dot_f32(qf + h * D, row + kh * D, D);
        }
        F(softmax_numerators)(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            F(nvfp4_row)(vc + tab[j] * (n / 2), vs + tab[j] * (n / 16), n, lut, pairs, sdec_v, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) axpy_f32(acc + h * D, sc[h * W + j], row + kh * D, D);
        }
        F(write_output)(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

/* K or V of one slot, every KV head (n = Hkv * D elements), decoded into fp32 `out` exactly as
   the cache's torch read would produce it in the model dtype. fmt: 0 the model dtype, 1 NVFP4
   (codes + E4M3 per 16, S_dec), 2 FP8 (E4M3 bytes + one fp32 S_dec per slot: fp4.fp8). */
static void F(kv_row)(int fmt, const void* d, const void* s, int64_t slot, int64_t Hkv, int64_t D, const float* lut,
                      const float (*pairs)[2], float sdec, float* out) {
    const int64_t n = Hkv * D;
    if (fmt == 1) {
        F(nvfp4_row)((const uint8_t*)d + slot * (n / 2), (const uint8_t*)s + slot * (n / 16), n, lut, pairs, sdec, out);
    } else if (fmt == 2) {
        const uint8_t* c = (const uint8_t*)d + slot * n;
        const float sd = ((const float*)s)[slot];
        for (int64_t i = 0; i < n; i++) out[i] = F(rnd)(lut[c[i]] * sd);
    } else {
        const ELEM* x = (const ELEM*)d + slot * n;
        for (int64_t i = 0; i < n; i++) out[i] = F(ld)(x[i]);
    }
}

/* `paged_attention` with K and V each in its own page format (F(kv_row)), e.g. FP8 K + NVFP4 V:
   rows are decoded one at a time into a buffer, never gathered into a dequantized copy. */
int F(paged_attention_kv)(const ELEM* q, int kfmt, const void* kd, const void* ks, float sdec_k, int vfmt,
                          const void* vd, const void* vs, float sdec_v, const int64_t* table, int64_t ldt,
                          const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                          int64_t D, float scale, ELEM* out) {
    const int64_t G = H / Hkv, n = Hkv * D;
    const int64_t W = F(widest)(row_len, T);
    float* qf = (float*)malloc((size_t)(2 * H * D + 8 * n + H * W) * sizeof(float));
    if (!qf) return 1;
    float *acc = qf + H * D, *row = acc + H * D, *sc = row + 8 * n;
    const float *lut = nvfp4_e4m3_lut(), *grid = nvfp4_e2m1_grid();
    float pairs[256][2];
    for (int b = 0; b < 256; b++) { pairs[b][0] = grid[b & 15]; pairs[b][1] = grid[b >> 4]; }
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        F(load_query)(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const float* kr[8];
            for (int r = 0; r < 8; r++) {
                F(kv_row)(kfmt, kd, ks, tab[j0 + r], Hkv, D, lut, pairs, sdec_k, row + r * n);
                kr[r] = row + r * n;
            }
            scores8_f32(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            F(kv_row)(kfmt, kd, ks, tab[j], Hkv, D, lut, pairs, sdec_k, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = dot_f32(qf + h * D, row + kh * D, D);
        }
        F(softmax_numerators)(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            F(kv_row)(vfmt, vd, vs, tab[j], Hkv, D, lut, pairs, sdec_v, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) axpy_f32(acc + h * D, sc[h * W + j], row + kh * D, D);
        }
        F(write_output)(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

