/* C kernels of the embedded engine's forward on CPU; see cpu_fused.h.
 *
 * Each kernel computes in fp32 and rounds where HF's module rounds (bfloat16 runs keep HF's
 * rounding points); fp32 results match the torch reference to a few ulp (other summation orders,
 * a polynomial exp), never bit for bit. The typed kernels are written once (cpu_*_typed.h) and
 * instantiated here for float32 and bfloat16 (uint16_t bits).
 */
#include "cpu_fused.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_fp4.h"
#include "cpu_quant.h"

#define PREFETCH 32  /* KV head rows ahead: scattered slots defeat the hardware prefetcher, DRAM latency is long */
/* always_inline: a function whose only effect is a prefetch counts as side-effect free to GCC's
   IPA, which then deletes its calls (the pages were never prefetched before this was forced). */
#define PREFETCH_FN static inline __attribute__((always_inline))
PREFETCH_FN void prefetch_row(const void* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o);
}

static inline float ld_f32(float v) { return v; }
static inline float st_f32(float v) { return v; }
static inline float rnd_f32(float v) { return v; }
static inline float ld_bf16(uint16_t h) { return bf16_to_f32(h); }
static inline uint16_t st_bf16(float f) { return f32_to_bf16(f); }
static inline float rnd_bf16(float f) { return ld_bf16(st_bf16(f)); }

/* e^x for x <= 88.7 to ~2 ulp: Cody-Waite reduction + degree-6 polynomial, vectorizable. */
static inline float fexp(float x) {
    x = x < -87.3f ? -87.3f : x;  /* not fminf/fmaxf: those stay library calls and block vectorizing */
    x = x > 88.7f ? 88.7f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f; p = p * r + 1.f / 6.f;
    p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
    union { int32_t i; float f; } s;  /* 2^n; a union (not memcpy) lets the loops vectorize */
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

static inline float sum(const float* a, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j];
    float s = 0.f;
    for (; i < n; i++) s += a[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* sum(a) accumulated in double, 8 lanes: a vocabulary's 151,936 softmax numerators summed in fp32
   lanes of ~19 K terms each lost ~1e-4 of the logprob against torch's log_softmax. */
static inline double sum_f64(const float* a, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j];
    double s = 0.;
    for (; i < n; i++) s += a[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Greedy pick of each row of fp32 logits [B, V] and its log-softmax: tok = first argmax,
   lp = (x[tok] - max) - log(sum(exp(x - max))), log_softmax's formula (vectorized exp). */
int greedy_logprob(const float* x, int64_t B, int64_t V, int64_t* tok, float* lp) {
    float* e = (float*)malloc((size_t)(V > 0 ? V : 1) * sizeof(float));
    if (!e) return 1;
    for (int64_t b = 0; b < B; b++) {
        const float* r = x + b * V;
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++) if (r[i] > r[best]) best = i;
        const float m = r[best];
        for (int64_t i = 0; i < V; i++) e[i] = fexp(r[i] - m);
        tok[b] = best;
        lp[b] = -(float)log(sum_f64(e, V));
    }
    free(e);
    return 0;
}

int layer_kv_store_nvfp4(const layer_args* a, int which, const float* x) {
    const int64_t T = a->T, n = a->kv_heads * a->head_dim, nd = n / 2, ns = n / 16, r = a->cap_row;
    uint8_t *pd = (uint8_t*)(which ? a->vc : a->kc), *ps = (uint8_t*)(which ? a->vs : a->ks);
    const float* gs = which ? a->gs_v : a->gs_k;
    const int rc = nvfp4_quantize_to_slots(x, T, n, gs, a->write_slots, a->num_slots, pd, ps);
    if (rc) return rc == 1 ? 1 : rc + 1;
    if (a->cap_kv[2 * which]) { /* guidance: the codes and scales just written, row by row */
        uint8_t* cd = (uint8_t*)a->cap_kv[2 * which] + r * nd;
        uint8_t* cs = (uint8_t*)a->cap_kv[2 * which + 1] + r * ns;
        for (int64_t t = 0; t < T; t++) {
            memcpy(cd + t * nd, pd + a->write_slots[t] * nd, (size_t)nd);
            memcpy(cs + t * ns, ps + a->write_slots[t] * ns, (size_t)ns);
        }
    }
    if (a->cap_kv_gs[which]) /* a per-row S_enc log: the layer's static K/V scale on every row */
        for (int64_t t = 0; t < T; t++) ((float*)a->cap_kv_gs[which])[r + t] = *gs;
    return 0;
}

#if defined(__GNUC__) && !defined(__clang__)
#define FMA_FN __attribute__((optimize("fp-contract=fast"))) /* the layer GEMM only: not an FP4 path */
#else
#define FMA_FN
#endif

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define F(name) CAT(name, SFX)

#define SFX f32
#define ELEM float
#include "cpu_fused_typed.h"
#include "cpu_attention_typed.h"
#include "cpu_layer_typed.h"
#undef SFX
#undef ELEM

#define SFX bf16
#define ELEM uint16_t
#include "cpu_fused_typed.h"
#include "cpu_attention_typed.h"
#include "cpu_layer_typed.h"
#undef SFX
#undef ELEM
