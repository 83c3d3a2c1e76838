/* One C call per dense decoder layer (arguments: cpu_layer.h), the fused kernels chained with a
 * small GEMM, so a decode step crosses from Python into C once per layer instead of ~12 times:
 *     x -> add+RMSNorm -> [NVFP4 act quant?] -> qkv GEMM -> q/k norm, RoPE -> K/V into pages
 *       -> paged attention -> [act quant?] -> o GEMM -> add+RMSNorm -> [act quant?] -> gate_up GEMM
 *       -> SiLU*up -> [act quant?] -> down GEMM -> residual for the next layer
 * FP4 quantizing is cpu_quant's (the same functions the per-kernel path calls). The GEMM reads
 * weights transposed ([K, N]: contiguous rows of N outputs per input feature), accumulates in fp32
 * with FMA, rounds the output to the model dtype.
 * Included by cpu_fused.c once per element type, with ELEM the type (float, uint16_t for bf16)
 * and F(name) its suffixed name (name_f32, name_bf16): no include guard on purpose.
 */
/* y[M, N] = x[M, K] wt[K, N] (+ bias), fp32 accumulate, rounded to the dtype. TILE_ROWS rows x 16 columns
   of accumulators stay in registers; FMA contraction is allowed here only. */
FMA_FN static void F(gemm)(const float* x, const ELEM* wt, const ELEM* bias, ELEM* y, int64_t M, int64_t N, int64_t K) {
    int64_t m = 0;
    for (; m < M; m += TILE_ROWS) {
        const int64_t mr = M - m < TILE_ROWS ? M - m : TILE_ROWS;
        int64_t n = 0;
        for (; n + 16 <= N; n += 16) {
            v8f a[TILE_ROWS][2];
            for (int r = 0; r < TILE_ROWS; r++) a[r][0] = a[r][1] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < K; k++) {
                const v8f b0 = F(ld8)(wt + k * N + n), b1 = F(ld8)(wt + k * N + n + 8);
                for (int r = 0; r < TILE_ROWS; r++) {
                    const float c = r < mr ? x[(m + r) * K + k] : 0.f;
                    a[r][0] += c * b0;
                    a[r][1] += c * b1;
                }
            }
            for (int r = 0; r < mr; r++)
                for (int i = 0; i < 16; i++)
                    y[(m + r) * N + n + i] =
                        F(st)((i < 8 ? a[r][0][i] : a[r][1][i - 8]) + (bias ? F(ld)(bias[n + i]) : 0.f));
        }
        for (; n < N; n++)
            for (int r = 0; r < mr; r++) {
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += x[(m + r) * K + k] * F(ld)(wt[k * N + n]);
                y[(m + r) * N + n] = F(st)(s + (bias ? F(ld)(bias[n]) : 0.f));
            }
    }
}

/* One linear: x [T, K] (dtype) -> y [T, N]; with act != 0 the input is NVFP4-quantized first by
   fp4's qdq (per token: gs NULL; static: gs = &S_enc), its codes/scales/S_enc going to the capture
   buffers when given, and the GEMM reads the dequantized input rounded to the dtype. */
static int F(linear)(const layer_args* a, int which, const ELEM* x, int64_t T, int64_t K, int64_t N, const ELEM* wt,
                     const ELEM* bias, ELEM* y, float* xf, float* xhat, uint8_t* qd, uint8_t* qs, float* qg) {
    for (int64_t i = 0; i < T * K; i++) xf[i] = F(ld)(x[i]);
    const float* in = xf;
    if (a->act_mode[which]) {
        const int64_t r = a->cap_row;
        uint8_t* d = a->cap_data[which] ? (uint8_t*)a->cap_data[which] + r * (K / 2) : qd;
        uint8_t* s = a->cap_scale[which] ? (uint8_t*)a->cap_scale[which] + r * (K / 16) : qs;
        float* g = a->cap_gs[which] ? (float*)a->cap_gs[which] + r : qg;
        const float* gs = a->act_mode[which] == 2 ? a->act_gs[which] : 0;
        if (nvfp4_qdq(xf, T, K, gs, d, s, gs ? 0 : g, xhat)) return 1;
        if (gs && a->cap_gs[which])  /* a per-row S_enc log under a static scale: every row gets it */
            for (int64_t t = 0; t < T; t++) g[t] = *gs;
        for (int64_t i = 0; i < T * K; i++) xhat[i] = F(rnd)(xhat[i]);
        in = xhat;
    }
    F(gemm)(in, wt, bias, y, T, N, K);
    return 0;
}

/* The whole layer; returns 0, or 1 when an FP4 quantizer met NaN, 2 when out of memory, 3 for a KV
   slot outside the cache, 4 for a KV S_enc that is not finite and positive. */
int F(decode_layer)(const layer_args* a) {
    const int64_t T = a->T, Hd = a->hidden, H = a->heads, Hkv = a->kv_heads, D = a->head_dim, F = a->inter;
    const int64_t widest = Hd > F ? (Hd > H * D ? Hd : H * D) : (F > H * D ? F : H * D);
    const int64_t nq = a->qkv_n, n_el = T * (2 * Hd + nq + 2 * H * D + 2 * Hkv * D + 3 * F);
    ELEM* buf = (ELEM*)malloc((size_t)n_el * sizeof(ELEM));
    float* fb = (float*)malloc((size_t)(2 * T * widest + 2 * T * Hkv * D + T) * sizeof(float));
    uint8_t* qb = (uint8_t*)malloc((size_t)(T * widest));
    if (!buf || !fb || !qb) { free(buf); free(fb); free(qb); return 2; }
    ELEM *h = buf, *qkv = h + T * Hd, *q = qkv + T * nq, *att = q + T * H * D, *kn = att + T * H * D;
    ELEM *vn = kn + T * Hkv * D, *o = vn + T * Hkv * D, *gu = o + T * Hd, *m = gu + 2 * T * F;
    float *xf = fb, *xhat = xf + T * widest, *kvf = xhat + T * widest, *qg = kvf + 2 * T * Hkv * D;
    uint8_t *qd = qb, *qs = qb + T * widest / 2;
    ELEM* x = (ELEM*)a->x;
    int rc = 0;
    F(add_rmsnorm)(x, (const ELEM*)a->res_in, (const ELEM*)a->in_norm, h, T, Hd, a->eps);
    rc = F(linear)(a, 0, h, T, Hd, nq, (const ELEM*)a->qkv_wt, (const ELEM*)a->qkv_b, qkv, xf, xhat, qd, qs, qg);
    if (rc) goto out;
    if (a->kv_fmt == 0) {
        F(qkv_rope)(qkv, T, H, Hkv, D, a->cos, a->sin, a->pos, (const ELEM*)a->q_norm, (const ELEM*)a->k_norm, a->eps,
                    q, (ELEM*)a->kc, (ELEM*)a->vc, a->write_slots);
        rc = F(paged_attention)(q, (const ELEM*)a->kc, (const ELEM*)a->vc, a->table, a->ldt, a->row_seq, a->row_len,
                                T, H,
                                Hkv, D, a->attn_scale, att);
    } else {
        F(qkv_rope)(qkv, T, H, Hkv, D, a->cos, a->sin, a->pos, (const ELEM*)a->q_norm, (const ELEM*)a->k_norm, a->eps,
                    q, kn, vn, 0);
        for (int64_t i = 0; i < T * Hkv * D; i++) { kvf[i] = F(ld)(kn[i]); kvf[T * Hkv * D + i] = F(ld)(vn[i]); }
        for (int which = 0; which < 2; which++)  /* 1 NaN, 3 slot out of range, 4 bad S_enc */
            if ((rc = layer_kv_store_nvfp4(a, which, kvf + which * T * Hkv * D))) goto out;
        rc = F(paged_attention_nvfp4)(q, (const uint8_t*)a->kc, (const uint8_t*)a->ks, (const uint8_t*)a->vc,
                                      (const uint8_t*)a->vs, a->sdec_k, a->sdec_v, a->table, a->ldt, a->row_seq,
                                      a->row_len, T, H, Hkv, D, a->attn_scale, att);
    }
    if (rc) { rc = 2; goto out; }
    rc = F(linear)(a, 1, att, T, H * D, Hd, (const ELEM*)a->o_wt, (const ELEM*)a->o_b, o, xf, xhat, qd, qs, qg);
    if (rc) goto out;
    F(add_rmsnorm)(x, o, (const ELEM*)a->post_norm, h, T, Hd, a->eps);
    if ((rc = F(linear)(a, 2, h, T, Hd, 2 * F, (const ELEM*)a->gu_wt, 0, gu, xf, xhat, qd, qs, qg))) goto out;
    F(silu_mul)(gu, T, F, m);
    rc = F(linear)(a, 3, m, T, F, Hd, (const ELEM*)a->down_wt, 0, (ELEM*)a->res_out, xf, xhat, qd, qs, qg);
out:
    free(buf); free(fb); free(qb);
    return rc;
}
