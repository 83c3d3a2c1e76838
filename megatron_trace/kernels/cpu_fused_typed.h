/* Norms, RoPE and SiLU of the engine's CPU forward (see cpu_fused.h).
   Included by cpu_fused.c once per element type, with ELEM the type (float, uint16_t for bf16)
   and F(name) its suffixed name (name_f32, name_bf16): no include guard on purpose. */
/* x [T, N] is the residual stream: x += res first (rounded to the dtype) when res is given;
   out = w * dtype(x * rsqrt(mean(x^2) + eps)), as HF's RMSNorm. */
void F(add_rmsnorm)(ELEM* x, const ELEM* res, const ELEM* w, ELEM* out, int64_t T, int64_t N, float eps) {
    for (int64_t t = 0; t < T; t++) {
        ELEM* xr = x + t * N;
        if (res)
            for (int64_t i = 0; i < N; i++) xr[i] = F(st)(F(ld)(xr[i]) + F(ld)(res[t * N + i]));
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ss = 0.f;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8)
            for (int j = 0; j < 8; j++) { float v = F(ld)(xr[i + j]); acc[j] += v * v; }
        for (; i < N; i++) { float v = F(ld)(xr[i]); ss += v * v; }
        ss += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float r = 1.0f / sqrtf(ss / (float)N + eps);
        ELEM* o = out + t * N;
        for (i = 0; i < N; i++) o[i] = F(st)(F(ld)(w[i]) * F(rnd)(F(ld)(xr[i]) * r));
    }
}

static void F(norm_rope)(const ELEM* x, const ELEM* nw, float eps, const float* c, const float* s, int64_t D, ELEM* o) {
    float b[D];
    for (int64_t i = 0; i < D; i++) b[i] = F(ld)(x[i]);
    if (nw) {
        float ss = 0.f;
        for (int64_t i = 0; i < D; i++) ss += b[i] * b[i];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) b[i] = F(rnd)(F(ld)(nw[i]) * F(rnd)(b[i] * r));
    }
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) o[i] = F(st)(F(rnd)(b[i] * c[i]) + F(rnd)(-b[i + h] * s[i]));
    for (int64_t i = h; i < D; i++) o[i] = F(st)(F(rnd)(b[i] * c[i]) + F(rnd)(b[i - h] * s[i]));
}

/* qkv [T, (H + 2 Hkv) D] -> q_out [T, H, D] with (q-norm and) RoPE; K (k-norm, RoPE) and V rows
   of token t go to row slots[t] of kdst/vdst [*, Hkv, D] (row t when slots is NULL). */
void F(qkv_rope)(const ELEM* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* cs, const float* sn,
                 const int64_t* pos, const ELEM* qn, const ELEM* kn, float eps, ELEM* q_out, ELEM* kdst, ELEM* vdst,
                 const int64_t* slots) {
    const int64_t row = (H + 2 * Hkv) * D, kvrow = Hkv * D;
    for (int64_t t = 0; t < T; t++) {
        const ELEM* x = qkv + t * row;
        const int64_t p = pos ? pos[t] : t;
        const float *c = cs + p * D, *s = sn + p * D;
        for (int64_t h = 0; h < H; h++) F(norm_rope)(x + h * D, qn, eps, c, s, D, q_out + (t * H + h) * D);
        const int64_t dst = slots ? slots[t] : t;
        for (int64_t h = 0; h < Hkv; h++) F(norm_rope)(x + (H + h) * D, kn, eps, c, s, D, kdst + dst * kvrow + h * D);
        memcpy(vdst + dst * kvrow, x + (H + Hkv) * D, (size_t)kvrow * sizeof(ELEM));
    }
}

/* gu [T, 2F] = [gate | up] -> out [T, F] = dtype(silu(gate)) * up, as HF's MLP. */
void F(silu_mul)(const ELEM* gu, int64_t T, int64_t F, ELEM* out) {
    for (int64_t t = 0; t < T; t++) {
        const ELEM *g = gu + t * 2 * F, *u = g + F;
        ELEM* o = out + t * F;
        for (int64_t i = 0; i < F; i++) {
            const float a = F(ld)(g[i]);
            o[i] = F(st)(F(rnd)(a / (1.f + fexp(-a))) * F(ld)(u[i]));
        }
    }
}
