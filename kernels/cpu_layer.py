"""One C call per decoder layer for the embedded engine on CPU: the `cpu_fused` kernels chained with
a small GEMM, so a decode step crosses from Python into C once per layer instead of ~12 times.

    x ─► add+RMSNorm ─► [NVFP4 act quant?] ─► qkv GEMM ─► q/k norm, RoPE ─► K/V into pages (NVFP4: via fp4)
      ─► paged attention ─► [act quant?] ─► o GEMM ─► add+RMSNorm ─► [act quant?] ─► gate_up GEMM
      ─► SiLU·up ─► [act quant?] ─► down GEMM ─► residual for the next layer
FP4 stays in `megatron_trace.fp4`: activation and KV quantization are that module's compiled
functions, called here through function pointers. The GEMM reads weights transposed ([K, N]:
contiguous rows of N outputs per input feature), accumulates in fp32 with FMA, rounds the output
to the model dtype. Dense (BF16-policy) and NVFP4 KV pages, NVFP4 W4A4/W4A16 and BF16 linears are
served; MoE layers and MXFP4 run the per-kernel path (`cpu_fused`).
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_fused  # its source pulls this module's C text in only when it compiles

LAYER_BODY = r"""
/* y[M, N] = x[M, K] wt[K, N] (+ bias), fp32 accumulate, rounded to the dtype. 4 rows x 16 columns
   of accumulators stay in registers; FMA contraction is allowed here only. */
FMA_FN static void gemm_@S(const float* x, const @T* wt, const @T* bias, @T* y, int64_t M, int64_t N, int64_t K) {
    int64_t m = 0;
    for (; m < M; m += 4) {
        const int64_t mr = M - m < 4 ? M - m : 4;
        int64_t n = 0;
        for (; n + 16 <= N; n += 16) {
            v8f a[4][2];
            for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < K; k++) {
                const v8f b0 = ld8_@S(wt + k * N + n), b1 = ld8_@S(wt + k * N + n + 8);
                for (int r = 0; r < 4; r++) {
                    const float c = r < mr ? x[(m + r) * K + k] : 0.f;
                    a[r][0] += c * b0;
                    a[r][1] += c * b1;
                }
            }
            for (int r = 0; r < mr; r++)
                for (int i = 0; i < 16; i++)
                    y[(m + r) * N + n + i] = st_@S((i < 8 ? a[r][0][i] : a[r][1][i - 8]) + (bias ? ld_@S(bias[n + i]) : 0.f));
        }
        for (; n < N; n++)
            for (int r = 0; r < mr; r++) {
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += x[(m + r) * K + k] * ld_@S(wt[k * N + n]);
                y[(m + r) * N + n] = st_@S(s + (bias ? ld_@S(bias[n]) : 0.f));
            }
    }
}

/* One linear: x [T, K] (dtype) -> y [T, N]; with act != 0 the input is NVFP4-quantized first by
   fp4's qdq (per token: gs NULL; static: gs = &S_enc), its codes/scales/S_enc going to the capture
   buffers when given, and the GEMM reads the dequantized input rounded to the dtype. */
static int linear_@S(const layer_args* a, int which, const @T* x, int64_t T, int64_t K, int64_t N, const @T* wt,
                     const @T* bias, @T* y, float* xf, float* xhat, uint8_t* qd, uint8_t* qs, float* qg) {
    for (int64_t i = 0; i < T * K; i++) xf[i] = ld_@S(x[i]);
    const float* in = xf;
    if (a->act_mode[which]) {
        const int64_t r = a->cap_row;
        uint8_t* d = a->cap_data[which] ? (uint8_t*)a->cap_data[which] + r * (K / 2) : qd;
        uint8_t* s = a->cap_scale[which] ? (uint8_t*)a->cap_scale[which] + r * (K / 16) : qs;
        float* g = a->cap_gs[which] ? (float*)a->cap_gs[which] + r : qg;
        const float* gs = a->act_mode[which] == 2 ? a->act_gs[which] : 0;
        if (((qdq_fn)a->qdq)(xf, T, K, gs, a->lut, a->grid, a->bnd, a->one_sixth, d, s, gs ? 0 : g, xhat)) return 1;
        if (gs && a->cap_gs[which])  /* a per-row S_enc log under a static scale: every row gets it */
            for (int64_t t = 0; t < T; t++) g[t] = *gs;
        for (int64_t i = 0; i < T * K; i++) xhat[i] = rnd_@S(xhat[i]);
        in = xhat;
    }
    gemm_@S(in, wt, bias, y, T, N, K);
    return 0;
}

/* The whole layer; returns 0, or 1 when an FP4 quantizer met NaN, 2 when out of memory, 3 for a KV
   slot outside the cache, 4 for a KV S_enc that is not finite and positive. */
int decode_layer_@S(const layer_args* a) {
    const int64_t T = a->T, Hd = a->hidden, H = a->heads, Hkv = a->kv_heads, D = a->head_dim, F = a->inter;
    const int64_t widest = Hd > F ? (Hd > H * D ? Hd : H * D) : (F > H * D ? F : H * D);
    const int64_t nq = a->qkv_n, n_el = T * (2 * Hd + nq + 2 * H * D + 2 * Hkv * D + 3 * F);
    @T* buf = malloc((size_t)n_el * sizeof(@T));
    float* fb = malloc((size_t)(2 * T * widest + 2 * T * Hkv * D + T) * sizeof(float));
    uint8_t* qb = malloc((size_t)(T * widest));
    if (!buf || !fb || !qb) { free(buf); free(fb); free(qb); return 2; }
    @T *h = buf, *qkv = h + T * Hd, *q = qkv + T * nq, *att = q + T * H * D, *kn = att + T * H * D;
    @T *vn = kn + T * Hkv * D, *o = vn + T * Hkv * D, *gu = o + T * Hd, *m = gu + 2 * T * F;
    float *xf = fb, *xhat = xf + T * widest, *kvf = xhat + T * widest, *qg = kvf + 2 * T * Hkv * D;
    uint8_t *qd = qb, *qs = qb + T * widest / 2;
    @T* x = (@T*)a->x;
    int rc = 0;
    add_rmsnorm_@S(x, (const @T*)a->res_in, (const @T*)a->in_norm, h, T, Hd, a->eps);
    if ((rc = linear_@S(a, 0, h, T, Hd, nq, (const @T*)a->qkv_wt, (const @T*)a->qkv_b, qkv, xf, xhat, qd, qs, qg))) goto out;
    if (a->kv_fmt == 0) {
        qkv_rope_@S(qkv, T, H, Hkv, D, a->cos, a->sin, a->pos, (const @T*)a->q_norm, (const @T*)a->k_norm, a->eps,
                    q, (@T*)a->kc, (@T*)a->vc, a->write_slots);
        rc = paged_attention_@S(q, (const @T*)a->kc, (const @T*)a->vc, a->table, a->ldt, a->row_seq, a->row_len, T, H,
                                Hkv, D, a->attn_scale, att);
    } else {
        qkv_rope_@S(qkv, T, H, Hkv, D, a->cos, a->sin, a->pos, (const @T*)a->q_norm, (const @T*)a->k_norm, a->eps,
                    q, kn, vn, 0);
        for (int64_t i = 0; i < T * Hkv * D; i++) { kvf[i] = ld_@S(kn[i]); kvf[T * Hkv * D + i] = ld_@S(vn[i]); }
        q2slots_fn put = (q2slots_fn)a->q2slots;
        for (int which = 0; which < 2; which++) {  /* fp4's codes: 1 NaN, 2 slot out of range, 3 bad S_enc */
            rc = put(kvf + which * T * Hkv * D, T, Hkv * D, which ? a->gs_v : a->gs_k, a->write_slots, a->num_slots,
                     a->lut, a->grid, a->bnd, a->one_sixth, (uint8_t*)(which ? a->vc : a->kc),
                     (uint8_t*)(which ? a->vs : a->ks));
            if (rc) { rc = rc == 1 ? 1 : rc + 1; goto out; }
            const uint8_t *pd = (const uint8_t*)(which ? a->vc : a->kc), *ps = (const uint8_t*)(which ? a->vs : a->ks);
            const int64_t nd = Hkv * D / 2, ns = Hkv * D / 16, r = a->cap_row;
            if (a->cap_kv[2 * which]) {  /* guidance: the codes and scales just written, row by row */
                uint8_t *cd = (uint8_t*)a->cap_kv[2 * which] + r * nd, *cs = (uint8_t*)a->cap_kv[2 * which + 1] + r * ns;
                for (int64_t t = 0; t < T; t++) {
                    memcpy(cd + t * nd, pd + a->write_slots[t] * nd, (size_t)nd);
                    memcpy(cs + t * ns, ps + a->write_slots[t] * ns, (size_t)ns);
                }
            }
            if (a->cap_kv_gs[which])  /* a per-row S_enc log: the layer's static K/V scale on every row */
                for (int64_t t = 0; t < T; t++) ((float*)a->cap_kv_gs[which])[r + t] = *(which ? a->gs_v : a->gs_k);
        }
        rc = paged_attention_nvfp4_@S(q, a->kc, a->ks, a->vc, a->vs, a->sdec_k, a->sdec_v, a->lut, a->grid, a->table,
                                      a->ldt, a->row_seq, a->row_len, T, H, Hkv, D, a->attn_scale, att);
    }
    if (rc) { rc = 2; goto out; }
    if ((rc = linear_@S(a, 1, att, T, H * D, Hd, (const @T*)a->o_wt, (const @T*)a->o_b, o, xf, xhat, qd, qs, qg))) goto out;
    add_rmsnorm_@S(x, o, (const @T*)a->post_norm, h, T, Hd, a->eps);
    if ((rc = linear_@S(a, 2, h, T, Hd, 2 * F, (const @T*)a->gu_wt, 0, gu, xf, xhat, qd, qs, qg))) goto out;
    silu_mul_@S(gu, T, F, m);
    rc = linear_@S(a, 3, m, T, F, Hd, (const @T*)a->down_wt, 0, (@T*)a->res_out, xf, xhat, qd, qs, qg);
out:
    free(buf); free(fb); free(qb);
    return rc;
}
"""

LAYER_HEADER = r"""
typedef int (*qdq_fn)(const float*, int64_t, int64_t, const float*, const float*, const float*, const float*, float,
                      uint8_t*, uint8_t*, float*, float*);
typedef int (*q2slots_fn)(const float*, int64_t, int64_t, const float*, const int64_t*, int64_t, const float*,
                          const float*, const float*, float, uint8_t*, uint8_t*);
#if defined(__GNUC__) && !defined(__clang__)
#define FMA_FN __attribute__((optimize("fp-contract=fast")))
#else
#define FMA_FN
#endif

typedef struct {
    int64_t T, hidden, heads, kv_heads, head_dim, inter, qkv_n;
    float eps, attn_scale;
    const void *in_norm, *post_norm, *q_norm, *k_norm, *qkv_wt, *qkv_b, *o_wt, *o_b, *gu_wt, *down_wt;
    int64_t act_mode[4];           /* per linear (qkv, o, gate_up, down): 0 none, 1 NVFP4 per token, 2 static */
    const float* act_gs[4];
    /* Guidance capture: row 0 of the log's arrays (NULL: not captured); this step writes its T rows
       from row cap_row on. An S_enc address under a static scale gets that scale on every row. */
    void *cap_data[4], *cap_scale[4], *cap_gs[4];
    void* cap_kv[4];               /* NVFP4 KV: K codes, K scales, V codes, V scales */
    void* cap_kv_gs[2];            /* NVFP4 KV: S_enc of K, of V (NULL while the log keeps one static value) */
    int64_t cap_row;
    int64_t kv_fmt;                /* 0: pages in the dtype, 1: NVFP4 codes + scales */
    void *kc, *vc, *ks, *vs;
    const float *gs_k, *gs_v;
    float sdec_k, sdec_v;
    const int64_t* write_slots;
    int64_t num_slots;
    const int64_t *table, *row_seq, *row_len;
    int64_t ldt;
    const float *cos, *sin;         /* RoPE tables [positions, D], read at row pos[t] */
    const int64_t* pos;
    void* x;
    const void* res_in;
    void* res_out;
    void *qdq, *q2slots;
    const float *lut, *grid, *bnd;
    float one_sixth;
} layer_args;
"""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """Mirror of the C `layer_args` (same field order and types)."""

    _fields_ = ([(n, _I) for n in ("T", "hidden", "heads", "kv_heads", "head_dim", "inter", "qkv_n")]
                + [("eps", _F), ("attn_scale", _F)]
                + [(n, _P) for n in ("in_norm", "post_norm", "q_norm", "k_norm", "qkv_wt", "qkv_b", "o_wt", "o_b",
                                     "gu_wt", "down_wt")]
                + [("act_mode", _I * 4), ("act_gs", _P * 4), ("cap_data", _P * 4), ("cap_scale", _P * 4),
                   ("cap_gs", _P * 4), ("cap_kv", _P * 4), ("cap_kv_gs", _P * 2), ("cap_row", _I), ("kv_fmt", _I), ("kc", _P), ("vc", _P), ("ks", _P), ("vs", _P),
                   ("gs_k", _P), ("gs_v", _P), ("sdec_k", _F), ("sdec_v", _F), ("write_slots", _P), ("num_slots", _I),
                   ("table", _P), ("row_seq", _P), ("row_len", _P), ("ldt", _I), ("cos", _P), ("sin", _P),
                   ("pos", _P), ("x", _P), ("res_in", _P), ("res_out", _P), ("qdq", _P), ("q2slots", _P),
                   ("lut", _P), ("grid", _P), ("bnd", _P), ("one_sixth", _F)])


def run(args: LayerArgs, dtype: torch.dtype) -> None:
    rc = cpu_fused.layer_fn(dtype)(ctypes.byref(args))
    if rc:
        raise _ERRORS[rc][0](f"decode_layer: {_ERRORS[rc][1]}")


_ERRORS = {1: (FloatingPointError, "an FP4 quantizer met NaN (the activations diverged)"),
           2: (MemoryError, "out of memory for its scratch buffers"),
           3: (IndexError, "a KV slot lies outside the cache"),
           4: (ValueError, "a KV global scale is not finite and positive")}
