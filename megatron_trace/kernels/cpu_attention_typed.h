/* Paged attention of the engine's CPU kernels, prefill and decode alike (see cpu_fused.h).
 *
 * One kernel, F(paged_attention_items), over K and V pages each in its own format (kv_side: the
 * model dtype, NVFP4, MXFP4 with E8M0 per 16, or FP8 E4M3 with one fp32 scale per slot); paged_attention,
 * paged_attention_nvfp4 and paged_attention_kv name its three uses. Row t of q attends to the first
 * row_len[t] positions of its sequence, whose KV slots a table row lists. The work item is
 * (row t, KV head kh): its G = H / Hkv query heads share every decoded K/V head row, and
 * cpu_attention_parallel.cpp spreads the items over torch's threads. Per query head the arithmetic
 * is one fixed order (8-lane partial dot products, one horizontal-sum tree, a two-pass softmax over
 * the stored scores, P.V front to back), so every page format and every thread count gives the
 * bits that attention over the dequantized pages in the model dtype gives (tests/test_cpu_fused.py).
 * FP4 pages are decoded in registers: per 16-block the 16 values its scale allows are formed once
 * (grid * scale * S_dec, rounded to the model dtype as fp4.nvfp4.dequantize rounds) and the codes
 * pick from them with a two-vector permute; nothing is gathered into a dequantized copy.
 * Included by cpu_fused.c once per element type, with ELEM the type (float, uint16_t for bf16)
 * and F(name) its suffixed name (name_f32, name_bf16): the typed part has no include guard on purpose.
 */
#ifndef MEGATRON_TRACE_CPU_ATTENTION_SHARED
#define MEGATRON_TRACE_CPU_ATTENTION_SHARED
#if defined(__AVX2__)
#include <immintrin.h>
#endif
static inline void axpy_rows(float* y, float a, const float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v = ld8_f32(y + i) + a * ld8_f32(x + i);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] += a * x[i];
}

static inline float dot_rows(const float* a, const float* b, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += ld8_f32(a + i) * ld8_f32(b + i);
    float s = 0.f;
    for (; i < n; i++) s += a[i] * b[i];
    return s + hsum8(acc);
}

/* Scores of G query heads (qf [G, D]) against 8 decoded K rows (kr [8, D], D % 8 == 0) into
   sc[g * W + 0..7]: each lane sum equals dot_rows' (hsum8x8 is hsum8's tree, eight at once). */
PREFETCH_FN void scores8_rows(const float* qf, const float* kr, int64_t G, int64_t D, float* sc, int64_t W) {
    for (int64_t g = 0; g < G; g++) {
        v8f p[8];
        for (int r = 0; r < 8; r++) {
            v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t d = 0; d < D; d += 8) a += ld8_f32(qf + g * D + d) * ld8_f32(kr + r * D + d);
            p[r] = a;
        }
        const v8f s = hsum8x8(p);
        memcpy(sc + g * W, &s, sizeof s);
    }
}

/* acc[g] += p[g * W + r] * vr[r] for the nr <= 8 decoded V rows vr [nr, D], r in order: axpy_rows'
   sums. A head's whole accumulator row stays in registers over the rows (D <= 128, D % 8 == 0),
   so its D / 8 independent adds overlap instead of waiting on one another. */
PREFETCH_FN void pv_rows(float* acc, const float* p, int64_t W, const float* vr, int nr, int64_t G, int64_t D) {
    if (D % 8 || D > 128) {
        for (int r = 0; r < nr; r++)
            for (int64_t g = 0; g < G; g++) axpy_rows(acc + g * D, p[g * W + r], vr + r * D, D);
        return;
    }
    for (int64_t g = 0; g < G; g++) {
        v8f a[16];
        for (int64_t c = 0; c < D / 8; c++) a[c] = ld8_f32(acc + g * D + 8 * c);
        for (int r = 0; r < nr; r++) {
            const float pr = p[g * W + r];
            for (int64_t c = 0; c < D / 8; c++) a[c] = a[c] + pr * ld8_f32(vr + r * D + 8 * c);
        }
        for (int64_t c = 0; c < D / 8; c++) memcpy(acc + g * D + 8 * c, &a[c], sizeof a[c]);
    }
}

/* out[0..15] = tab[code] for the 16 codes of 8 packed bytes (low nibble first); tab = lo ++ hi. */
static inline void pick16(const uint8_t* c, v8f lo, v8f hi, float* out) {
#if defined(__clang__)  /* clang has no two-vector shuffle by run-time indices: pick one by one */
    float tab[16];
    memcpy(tab, &lo, sizeof lo);
    memcpy(tab + 8, &hi, sizeof hi);
    for (int i = 0; i < 8; i++) { out[2 * i] = tab[c[i] & 15]; out[2 * i + 1] = tab[c[i] >> 4]; }
#else
#if defined(__AVX2__)  /* one vpmovzxbd: GCC builds the widened bytes of a v8b with 8 inserts */
    long long bytes;
    memcpy(&bytes, c, sizeof bytes);
    const v8i u = (v8i)_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes)), n0 = u & 15, n1 = u >> 4;
#else
    v8b b;
    memcpy(&b, c, sizeof b);
    const v8i u = __builtin_convertvector(b, v8i), n0 = u & 15, n1 = u >> 4;
#endif
    const v8i i0 = SHUF(n0, n1, 0, 8, 1, 9, 2, 10, 3, 11), i1 = SHUF(n0, n1, 4, 12, 5, 13, 6, 14, 7, 15);
    const v8f a = __builtin_shuffle(lo, hi, i0), z = __builtin_shuffle(lo, hi, i1);  /* vpermt2ps on AVX-512 */
    memcpy(out, &a, sizeof a);
    memcpy(out + 8, &z, sizeof z);
#endif
}

static int64_t widest_row(const int64_t* row_len, int64_t t0, int64_t t1) {
    int64_t W = 1;
    for (int64_t t = t0; t < t1; t++) W = row_len[t] > W ? row_len[t] : W;
    return W;
}

static void softmax_numerators(float* sc, int64_t G, int64_t W, int64_t L) {
    for (int64_t g = 0; g < G; g++) {
        float* p = sc + g * W;
        v8f m8 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) {  /* the max is the same in any order: 8 lanes, GCC keeps a scalar loop */
            const v8f x = ld8_f32(p + j);
            m8 = x > m8 ? x : m8;
        }
        float m = -INFINITY;
        for (int i = 0; i < 8; i++) m = m8[i] > m ? m8[i] : m;
        for (; j < L; j++) m = p[j] > m ? p[j] : m;
        for (j = 0; j < L; j++) p[j] = fexp(p[j] - m);
    }
}

/* Where row (slot, kh) of one side starts, and how many bytes of it the prefetcher should fetch. */
PREFETCH_FN void prefetch_head(const kv_side* p, size_t elem, int64_t slot, int64_t Hkv, int64_t kh, int64_t D) {
    const int64_t e = (slot * Hkv + kh) * D;
    if (p->fmt == 1 || p->fmt == 3) {
        prefetch_row((const uint8_t*)p->data + e / 2, D / 2);
        __builtin_prefetch((const uint8_t*)p->scales + e / 16);
    } else {
        prefetch_row((const uint8_t*)p->data + e * (int64_t)(p->fmt == 2 ? 1 : elem), D * (p->fmt == 2 ? 1 : elem));
    }
}
#endif

/* The 16 values each E4M3 scale byte allows in one NVFP4 side, tab [256, 16]: what fp4.nvfp4.dequantize
   gives in the model dtype, dtype((grid[code] * e4m3[scale]) * S_dec), formed once per call so a
   block's decode is two loads and a permute. */
static void F(nvfp4_values)(float sdec, const float* lut, const float* grid, float* tab) {
    const v8f lo = ld8_f32(grid), hi = ld8_f32(grid + 8);
    for (int s = 0; s < 256; s++) {
        const v8f a = F(rnd8)((lo * lut[s]) * sdec), z = F(rnd8)((hi * lut[s]) * sdec);
        memcpy(tab + 16 * s, &a, sizeof a);
        memcpy(tab + 16 * s + 8, &z, sizeof z);
    }
}

/* The same for MXFP4 pages (E8M0 scale per 16: 2^(byte - 127), 0xff NaN), dtype(grid[code] * 2^e) as
   fp4.mxfp4.dequantize gives it. */
static void F(mxfp4_values)(const float* grid, float* tab) {
    const v8f lo = ld8_f32(grid), hi = ld8_f32(grid + 8);
    for (int s = 0; s < 256; s++) {
        const uint32_t bits = s == 255 ? 0x7fc00000u : s == 0 ? 0x00400000u : (uint32_t)s << 23;
        float e;
        memcpy(&e, &bits, sizeof e);
        const v8f a = F(rnd8)(lo * e), z = F(rnd8)(hi * e);
        memcpy(tab + 16 * s, &a, sizeof a);
        memcpy(tab + 16 * s + 8, &z, sizeof z);
    }
}

/* Row (slot, KV head kh) of one side, D values, decoded into fp32 exactly as the cache's torch read
   in the model dtype: NVFP4 and MXFP4 from their value tables (F(nvfp4_values), F(mxfp4_values)),
   dtype(e4m3[byte] * s) for FP8,
   the stored element otherwise. */
PREFETCH_FN void F(head_row)(const kv_side* p, const float* tab, int64_t slot, int64_t Hkv, int64_t kh, int64_t D,
                             const float* lut, float* out) {
    const int64_t e = (slot * Hkv + kh) * D;
    if (p->fmt == 1 || p->fmt == 3) {
        const uint8_t *c = (const uint8_t*)p->data + e / 2, *s = (const uint8_t*)p->scales + e / 16;
        for (int64_t b = 0; b < D / 16; b++) {
            const float* t = tab + 16 * s[b];
            pick16(c + 8 * b, ld8_f32(t), ld8_f32(t + 8), out + 16 * b);
        }
    } else if (p->fmt == 2) {
        const uint8_t* c = (const uint8_t*)p->data + e;
        const float sd = ((const float*)p->scales)[slot];
        for (int64_t i = 0; i < D; i++) out[i] = F(rnd)(lut[c[i]] * sd);
    } else {
        const ELEM* x = (const ELEM*)p->data + e;
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
            const v8f v = F(ld8)(x + i);
            memcpy(out + i, &v, sizeof v);
        }
        for (; i < D; i++) out[i] = F(ld)(x[i]);
    }
}

/* row = dtype(row + add) over D values: the torch read of a de-biased K, (read.float() + RoPE_pos(b)).to(dtype). */
static inline void F(add_row)(const float* add, int64_t D, float* row) {
    for (int64_t i = 0; i < D; i++) row[i] = F(rnd)(row[i] + add[i]);
}

/* Scratch of one run of items: the query heads, accumulators, 8 decoded rows, scores, value tables. */
typedef struct {
    float *qf, *acc, *rows, *sc;
    const float *ktab, *vtab, *lut;
} F(scratch);

/* Item (row t, KV head kh): q scaled into fp32, its G heads scored against its L positions 8 at a
   time, softmax numerators in place, P.V 8 rows at a time, normalized into out. Always inlined so
   that the common head dims (F(paged_attention_items)) unroll with D a constant. */
PREFETCH_FN void F(attend)(const ELEM* q, const kv_side* k, const kv_side* v, const int64_t* tab, int64_t L,
                           int64_t h0, int64_t G, int64_t Hkv, int64_t kh, int64_t D, int64_t W, float scale,
                           const F(scratch)* m, ELEM* out) {
    float *qf = m->qf, *acc = m->acc, *kr = m->rows, *sc = m->sc;
    const size_t es = sizeof(ELEM);
    for (int64_t i = 0; i < G * D; i++) { qf[i] = F(ld)(q[h0 * D + i]) * scale; acc[i] = 0.f; }
    int64_t j0 = 0;
    for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
        for (int r = 0; r < 8; r++) {
            if (j0 + PREFETCH + r < L) prefetch_head(k, es, tab[j0 + PREFETCH + r], Hkv, kh, D);
            F(head_row)(k, m->ktab, tab[j0 + r], Hkv, kh, D, m->lut, kr + r * D);
            if (k->add) F(add_row)(k->add + ((j0 + r) * Hkv + kh) * D, D, kr + r * D);
        }
        scores8_rows(qf, kr, G, D, sc + j0, W);
    }
    for (int64_t j = j0; j < L; j++) {
        F(head_row)(k, m->ktab, tab[j], Hkv, kh, D, m->lut, kr);
        if (k->add) F(add_row)(k->add + (j * Hkv + kh) * D, D, kr);
        for (int64_t g = 0; g < G; g++) sc[g * W + j] = dot_rows(qf + g * D, kr, D);
    }
    softmax_numerators(sc, G, W, L);
    for (j0 = 0; j0 < L; j0 += 8) {
        const int nr = L - j0 < 8 ? (int)(L - j0) : 8;
        for (int r = 0; r < nr; r++) {
            if (j0 + PREFETCH + r < L) prefetch_head(v, es, tab[j0 + PREFETCH + r], Hkv, kh, D);
            F(head_row)(v, m->vtab, tab[j0 + r], Hkv, kh, D, m->lut, kr + r * D);
        }
        pv_rows(acc, sc + j0, W, kr, nr, G, D);
    }
    for (int64_t g = 0; g < G; g++) {
        const float den = sum(sc + g * W, L), inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; i++) out[(h0 + g) * D + i] = F(st)(acc[g * D + i] * inv);
    }
}

/* Work items i0..i1 of T * Hkv, item i = (row i / Hkv, KV head i % Hkv), into out [T, H, D].
   Returns 1 when out of memory. */
int F(paged_attention_items)(const ELEM* q, const kv_side* k, const kv_side* v, const int64_t* table, int64_t ldt,
                             const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                             int64_t D, float scale, ELEM* out, int64_t i0, int64_t i1) {
    (void)T;
    if (i0 >= i1) return 0;
    const int64_t G = H / Hkv, W = widest_row(row_len, i0 / Hkv, (i1 - 1) / Hkv + 1);
    const int k4 = k->fmt == 1 || k->fmt == 3, v4 = v->fmt == 1 || v->fmt == 3;  /* sides with a value table */
    const int64_t ntab = 256 * 16 * (k4 + v4);
    float* buf = (float*)malloc((size_t)(2 * G * D + 8 * D + G * W + ntab) * sizeof(float));  /* heap: long contexts */
    if (!buf) return 1;
    const float *lut = nvfp4_e4m3_lut(), *grid = nvfp4_e2m1_grid();
    F(scratch) m = {buf, buf + G * D, buf + 2 * G * D, buf + 2 * G * D + 8 * D, 0, 0, lut};
    float* tabs = m.sc + G * W;
    const kv_side* sides[2] = {k, v};
    for (int i = 0; i < 2; i++) {
        if (sides[i]->fmt == 1) F(nvfp4_values)(sides[i]->sdec, lut, grid, tabs);
        else if (sides[i]->fmt == 3) F(mxfp4_values)(grid, tabs);
        else continue;
        *(i ? &m.vtab : &m.ktab) = tabs;
        tabs += 256 * 16;
    }
    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / Hkv, kh = it % Hkv, L = row_len[t], h0 = t * H + kh * G;
        const int64_t* tab = table + row_seq[t] * ldt;
        if (D == 16)  /* the test models' head dim: with D a constant the row loops unroll */
            F(attend)(q, k, v, tab, L, h0, G, Hkv, kh, 16, W, scale, &m, out);
        else if (D == 64)
            F(attend)(q, k, v, tab, L, h0, G, Hkv, kh, 64, W, scale, &m, out);
        else if (D == 128)
            F(attend)(q, k, v, tab, L, h0, G, Hkv, kh, 128, W, scale, &m, out);
        else
            F(attend)(q, k, v, tab, L, h0, G, Hkv, kh, D, W, scale, &m, out);
    }
    free(buf);
    return 0;
}

/* The three uses, each over all T * Hkv items on torch's threads (cpu_attention_parallel.cpp). */
int F(paged_attention)(const ELEM* q, const ELEM* kc, const ELEM* vc, const int64_t* table, int64_t ldt,
                       const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                       int64_t D, float scale, ELEM* out) {
    const kv_side k = {0, kc, 0, 0.f, 0}, v = {0, vc, 0, 0.f, 0};
    return F(paged_attention_threaded)(q, &k, &v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out);
}

int F(paged_attention_nvfp4)(const ELEM* q, const uint8_t* kc, const uint8_t* ks, const uint8_t* vc,
                             const uint8_t* vs, float sdec_k, float sdec_v, const int64_t* table, int64_t ldt,
                             const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                             int64_t D, float scale, ELEM* out) {
    const kv_side k = {1, kc, ks, sdec_k, 0}, v = {1, vc, vs, sdec_v, 0};
    return F(paged_attention_threaded)(q, &k, &v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out);
}

int F(paged_attention_kv)(const ELEM* q, int kfmt, const void* kd, const void* ks, float sdec_k,
                          const float* k_add, int vfmt, const void* vd, const void* vs, float sdec_v,
                          const int64_t* table, int64_t ldt, const int64_t* row_seq, const int64_t* row_len,
                          int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale, ELEM* out) {
    const kv_side k = {kfmt, kd, ks, sdec_k, k_add}, v = {vfmt, vd, vs, sdec_v, 0};
    return F(paged_attention_threaded)(q, &k, &v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out);
}
