"""Paged attention of the engine's CPU kernels (compiled with `cpu_fused`), prefill and decode alike.

Three kernels: pages in the model dtype, NVFP4 K and V, and K and V each in its own format
(model dtype, NVFP4 or FP8 E4M3 with a per-(token, KV head) scale: `paged_attention_kv`).

Row t of q attends to the first row_len[t] positions of its sequence, whose KV slots a table
row lists; pages hold K and V in the model dtype or as NVFP4 codes + E4M3 scales, decoded in
registers by fp4's E2M1_DECODE_C (never gathered into a dequantized copy). Scores of 8
positions share one horizontal-sum network; K/V rows are prefetched ahead, since on CPU this
step is bound by streaming the pages in.
"""
from __future__ import annotations

import torch

from megatron_trace.fp4.fast import decode_tables

from . import cpu_fused  # its source pulls this module's C text in only when it compiles

ATTENTION_BODY = r"""
static inline void axpy_@S(float* y, float a, const @T* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v = ld8_f32(y + i) + a * ld8_@S(x + i);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] += a * ld_@S(x[i]);
}

static inline float dot_@S(const float* a, const @T* b, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += ld8_f32(a + i) * ld8_@S(b + i);
    float s = 0.f;
    for (; i < n; i++) s += a[i] * ld_@S(b[i]);
    return s + hsum8(acc);
}

/* Scores of every query head against 8 KV rows (pointers kr, D % 8 == 0) into sc[h * W + 0..7]. */
static inline void scores8_@S(const float* qf, const @T* const* kr, int64_t H, int64_t G, int64_t D, float* sc,
                              int64_t W) {
    for (int64_t h = 0; h < H; h++) {
        const int64_t off = (h / G) * D;
        v8f p[8];
        for (int r = 0; r < 8; r++) {
            v8f a = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t d = 0; d < D; d += 8) a += ld8_f32(qf + h * D + d) * ld8_@S(kr[r] + off + d);
            p[r] = a;
        }
        const v8f s = hsum8x8(p);
        memcpy(sc + h * W, &s, sizeof s);
    }
}

/* Pieces both attention kernels share: the widest row, a query row scaled into fp32, the softmax
   numerators in place, and the normalized output. */
static int64_t widest_@S(const int64_t* row_len, int64_t T) {
    int64_t W = 1;
    for (int64_t t = 0; t < T; t++) if (row_len[t] > W) W = row_len[t];
    return W;
}

static void load_query_@S(const @T* q, int64_t n, float scale, float* qf, float* acc) {
    for (int64_t i = 0; i < n; i++) { qf[i] = ld_@S(q[i]) * scale; acc[i] = 0.f; }
}

static void softmax_numerators_@S(float* sc, int64_t H, int64_t W, int64_t L) {
    for (int64_t h = 0; h < H; h++) {
        float* p = sc + h * W;
        float m = -INFINITY;
        for (int64_t j = 0; j < L; j++) m = p[j] > m ? p[j] : m;
        for (int64_t j = 0; j < L; j++) p[j] = fexp(p[j] - m);
    }
}

static void write_output_@S(const float* acc, const float* sc, int64_t H, int64_t W, int64_t L, int64_t D, @T* o) {
    for (int64_t h = 0; h < H; h++) {
        const float den = sum(sc + h * W, L), inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; i++) o[h * D + i] = st_@S(acc[h * D + i] * inv);
    }
}

/* Row t of q [T, H, D] belongs to sequence row_seq[t] and sees its first row_len[t] positions,
   whose KV slots are table[row_seq[t] * ldt + j]; kc/vc [slots, Hkv, D]. out [T, H, D].
   Each K and V row (all KV heads) is read once per query row, front to back, so the hardware
   prefetcher streams the pages; query head h uses KV head h / (H / Hkv). */
int paged_attention_@S(const @T* q, const @T* kc, const @T* vc, const int64_t* table, int64_t ldt,
                       const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,
                       int64_t D, float scale, @T* out) {
    const int64_t G = H / Hkv, kvrow = Hkv * D;
    const int64_t W = widest_@S(row_len, T);
    float* qf = malloc((size_t)(2 * H * D + H * W) * sizeof(float));  /* heap: long contexts overflow stacks */
    if (!qf) return 1;
    float *acc = qf + H * D, *sc = acc + H * D;
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        load_query_@S(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const @T* kr[8];
            for (int r = 0; r < 8; r++) kr[r] = kc + tab[j0 + r] * kvrow;
            for (int r = 0; r < 8 && j0 + PREFETCH + r < L; r++)
                prefetch_row(kc + tab[j0 + PREFETCH + r] * kvrow, kvrow * (int64_t)sizeof(@T));
            scores8_@S(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            const @T* kr = kc + tab[j] * kvrow;
            if (j + PREFETCH < L) prefetch_row(kc + tab[j + PREFETCH] * kvrow, kvrow * (int64_t)sizeof(@T));
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = dot_@S(qf + h * D, kr + kh * D, D);
        }
        softmax_numerators_@S(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            const @T* vr = vc + tab[j] * kvrow;
            if (j + PREFETCH < L) prefetch_row(vc + tab[j + PREFETCH] * kvrow, kvrow * (int64_t)sizeof(@T));
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) axpy_@S(acc + h * D, sc[h * W + j], vr + kh * D, D);
        }
        write_output_@S(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

/* The same attention over NVFP4 pages: codes [slots, Hkv, D/2] (low nibble first) and E4M3 block
   scales [slots, Hkv, D/16] of K and V. Each element is decoded as fp4.nvfp4.dequantize does,
   dtype((grid[code] * lut[scale]) * s_dec), one row at a time into a buffer, never a gathered copy. */
static void nvfp4_row_@S(const uint8_t* c, const uint8_t* s, int64_t n, const float* lut, const float (*pairs)[2],
                         float sdec, float* out) {
    for (int64_t b = 0; b < n / 16; b++) {
        const float sf = lut[s[b]];
        float* o = out + b * 16;
        for (int i = 0; i < 8; i++) memcpy(o + 2 * i, pairs[c[b * 8 + i]], 2 * sizeof(float));
        v8f lo, hi;
        memcpy(&lo, o, sizeof lo);
        memcpy(&hi, o + 8, sizeof hi);
        lo = rnd8_@S((lo * sf) * sdec);
        hi = rnd8_@S((hi * sf) * sdec);
        memcpy(o, &lo, sizeof lo);
        memcpy(o + 8, &hi, sizeof hi);
    }
}

int paged_attention_nvfp4_@S(const @T* q, const uint8_t* kc, const uint8_t* ks, const uint8_t* vc,
                             const uint8_t* vs, float sdec_k, float sdec_v, const float* lut, const float* grid,
                             const int64_t* table, int64_t ldt, const int64_t* row_seq, const int64_t* row_len,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale, @T* out) {
    const int64_t G = H / Hkv, n = Hkv * D;
    const int64_t W = widest_@S(row_len, T);
    float* qf = malloc((size_t)(2 * H * D + 8 * n + H * W) * sizeof(float));
    if (!qf) return 1;
    float *acc = qf + H * D, *row = acc + H * D, *sc = row + 8 * n;
    float pairs[256][2];  /* both E2M1 values of each packed byte: one 8-byte copy per byte */
    for (int b = 0; b < 256; b++) { pairs[b][0] = grid[b & 15]; pairs[b][1] = grid[b >> 4]; }
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        load_query_@S(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const float* kr[8];
            for (int r = 0; r < 8; r++) {
                nvfp4_row_@S(kc + tab[j0 + r] * (n / 2), ks + tab[j0 + r] * (n / 16), n, lut, pairs, sdec_k, row + r * n);
                kr[r] = row + r * n;
            }
            scores8_f32(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            nvfp4_row_@S(kc + tab[j] * (n / 2), ks + tab[j] * (n / 16), n, lut, pairs, sdec_k, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = dot_f32(qf + h * D, row + kh * D, D);
        }
        softmax_numerators_@S(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            nvfp4_row_@S(vc + tab[j] * (n / 2), vs + tab[j] * (n / 16), n, lut, pairs, sdec_v, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) axpy_f32(acc + h * D, sc[h * W + j], row + kh * D, D);
        }
        write_output_@S(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

/* K or V of one slot, every KV head (n = Hkv * D elements), decoded into fp32 `out` exactly as
   the cache's torch read would produce it in the model dtype. fmt: 0 the model dtype, 1 NVFP4
   (codes + E4M3 per 16, S_dec), 2 FP8 (E4M3 bytes + one fp32 S_dec per slot: fp4.fp8). */
static void kv_row_@S(int fmt, const void* d, const void* s, int64_t slot, int64_t Hkv, int64_t D, const float* lut,
                      const float (*pairs)[2], float sdec, float* out) {
    const int64_t n = Hkv * D;
    if (fmt == 1) {
        nvfp4_row_@S((const uint8_t*)d + slot * (n / 2), (const uint8_t*)s + slot * (n / 16), n, lut, pairs, sdec, out);
    } else if (fmt == 2) {
        const uint8_t* c = (const uint8_t*)d + slot * n;
        const float sd = ((const float*)s)[slot];
        for (int64_t i = 0; i < n; i++) out[i] = rnd_@S(lut[c[i]] * sd);
    } else {
        const @T* x = (const @T*)d + slot * n;
        for (int64_t i = 0; i < n; i++) out[i] = ld_@S(x[i]);
    }
}

/* `paged_attention` with K and V each in its own page format (kv_row_@S), e.g. FP8 K + NVFP4 V:
   rows are decoded one at a time into a buffer, never gathered into a dequantized copy. */
int paged_attention_kv_@S(const @T* q, int kfmt, const void* kd, const void* ks, float sdec_k, int vfmt,
                          const void* vd, const void* vs, float sdec_v, const float* lut, const float* grid,
                          const int64_t* table, int64_t ldt, const int64_t* row_seq, const int64_t* row_len,
                          int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale, @T* out) {
    const int64_t G = H / Hkv, n = Hkv * D;
    const int64_t W = widest_@S(row_len, T);
    float* qf = malloc((size_t)(2 * H * D + 8 * n + H * W) * sizeof(float));
    if (!qf) return 1;
    float *acc = qf + H * D, *row = acc + H * D, *sc = row + 8 * n;
    float pairs[256][2];
    for (int b = 0; b < 256; b++) { pairs[b][0] = grid[b & 15]; pairs[b][1] = grid[b >> 4]; }
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = table + row_seq[t] * ldt;
        const int64_t L = row_len[t];
        load_query_@S(q + t * H * D, H * D, scale, qf, acc);
        int64_t j0 = 0;
        for (; D % 8 == 0 && j0 + 8 <= L; j0 += 8) {
            const float* kr[8];
            for (int r = 0; r < 8; r++) {
                kv_row_@S(kfmt, kd, ks, tab[j0 + r], Hkv, D, lut, pairs, sdec_k, row + r * n);
                kr[r] = row + r * n;
            }
            scores8_f32(qf, kr, H, G, D, sc + j0, W);
        }
        for (int64_t j = j0; j < L; j++) {
            kv_row_@S(kfmt, kd, ks, tab[j], Hkv, D, lut, pairs, sdec_k, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) sc[h * W + j] = dot_f32(qf + h * D, row + kh * D, D);
        }
        softmax_numerators_@S(sc, H, W, L);
        for (int64_t j = 0; j < L; j++) {
            kv_row_@S(vfmt, vd, vs, tab[j], Hkv, D, lut, pairs, sdec_v, row);
            for (int64_t kh = 0, h = 0; kh < Hkv; kh++)
                for (int64_t g = 0; g < G; g++, h++) axpy_f32(acc + h * D, sc[h * W + j], row + kh * D, D);
        }
        write_output_@S(acc, sc, H, W, L, D, out + t * H * D);
    }
    free(qf);
    return 0;
}

"""


def _fn(name: str, dtype: torch.dtype):
    return cpu_fused._fn(name, dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    row_seq: torch.Tensor, row_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k/v_cache [slots, Hkv, D] contiguous, q's dtype; table int64 [S, >= max row_len]
    with contiguous rows; row_seq, row_len int64 [T]. Returns softmax(q k^T * scale) v over each
    row's slots. The engine builds every index itself; nothing here is bounds-checked."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    if _fn("paged_attention", q.dtype)(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                                       table.stride(0), row_seq.data_ptr(), row_len.data_ptr(), t, h,
                                       k_cache.shape[-2], d, scale, out.data_ptr()):
        raise MemoryError(f"paged_attention: no memory for the scores of {t} rows")
    return out


def paged_attention_nvfp4(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor,
                          v_scales: torch.Tensor, sdec_k: float, sdec_v: float, table: torch.Tensor,
                          row_seq: torch.Tensor, row_len: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_attention` over NVFP4 pages: codes uint8 [slots, Hkv, D/2], E4M3 scales uint8
    [slots, Hkv, D/16], S_dec of K and V (fp4.nvfp4.decode_scale). Elements decode exactly as
    fp4.nvfp4.dequantize(..., q.dtype) would."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    lut, grid = decode_tables()
    if _fn("paged_attention_nvfp4", q.dtype)(
            q.data_ptr(), k_codes.data_ptr(), k_scales.data_ptr(), v_codes.data_ptr(), v_scales.data_ptr(),
            sdec_k, sdec_v, lut.data_ptr(), grid.data_ptr(), table.data_ptr(), table.stride(0), row_seq.data_ptr(),
            row_len.data_ptr(), t, h, k_codes.shape[-2], d, scale, out.data_ptr()):
        raise MemoryError(f"paged_attention_nvfp4: no memory for the scores of {t} rows")
    return out


# Page formats the mixed-format kernel decodes itself (its `fmt` codes); others have no kernel.
KV_ROW_FORMATS = {"bf16": 0, "nvfp4": 1, "fp8": 2}


def paged_attention_kv(q: torch.Tensor, k_fmt: str, k_pages: tuple, sdec_k: float, v_fmt: str, v_pages: tuple,
                       sdec_v: float, table: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """`paged_attention` with K and V in their own page formats (KV_ROW_FORMATS): each of k_pages /
    v_pages is (data, scales) of one layer as PagedKVCache keeps them (scales None for the model
    dtype; for fp8, fp32 [slots]); sdec_* is NVFP4's per-layer S_dec (ignored otherwise).
    Elements decode exactly as the cache's torch read in q.dtype would."""
    for name, fmt in (("K", k_fmt), ("V", v_fmt)):
        if fmt not in KV_ROW_FORMATS:
            raise ValueError(f"paged_attention_kv has no decoder for {name} pages in {fmt!r}; "
                             f"it decodes {', '.join(KV_ROW_FORMATS)}")
    t, h, d = q.shape
    out = torch.empty_like(q)
    lut, grid = decode_tables()
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    if _fn("paged_attention_kv", q.dtype)(
            q.data_ptr(), KV_ROW_FORMATS[k_fmt], ptr(k_pages[0]), ptr(k_pages[1]), sdec_k, KV_ROW_FORMATS[v_fmt],
            ptr(v_pages[0]), ptr(v_pages[1]), sdec_v, lut.data_ptr(), grid.data_ptr(), table.data_ptr(),
            table.stride(0), row_seq.data_ptr(), row_len.data_ptr(), t, h, k_pages[0].shape[-2], d, scale,
            out.data_ptr()):
        raise MemoryError(f"paged_attention_kv: no memory for the scores of {t} rows")
    return out
