/* C kernels of the embedded engine's forward on CPU (megatron_trace/kernels/cpu_fused.c):
 *
 *     x -> add_rmsnorm (residual add + RMSNorm, one pass) -> qkv GEMM
 *       -> qkv_rope (q/k RMSNorm for Qwen3, RoPE, K/V stored straight into their cache slots)
 *       -> paged_attention (every row of every sequence over its KV slots)
 *       -> o GEMM -> add_rmsnorm -> gate_up GEMM -> silu_mul -> down GEMM
 * Dense layers chain these inside one call (decode_layer, cpu_layer.h); MoE layers and MXFP4 call
 * them one by one around the GEMVs. Each typed kernel exists as name_f32 (float) and name_bf16
 * (bfloat16 as uint16_t bits). Nothing here is bounds-checked: the engine builds every index.
 */
#ifndef MEGATRON_TRACE_CPU_FUSED_H
#define MEGATRON_TRACE_CPU_FUSED_H
#include <stdint.h>

#include "cpu_layer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One side (K or V) of a layer's pages for the attention kernels: fmt 0 the model dtype (data
   [slots, Hkv, D]), 1 NVFP4 (data: codes [slots, Hkv, D/2] low nibble first, scales: E4M3
   [slots, Hkv, D/16], sdec: the layer's S_dec), 2 FP8 (data: E4M3 [slots, Hkv, D], scales: one
   fp32 S_dec per slot), 3 MXFP4 (NVFP4's layout with E8M0 scales per 16, no S_dec). add: NULL, or
   fp32 [positions, Hkv, D] added to each decoded row at its position in the row (column j of the
   table) and rounded to the model dtype again: a de-biased K cache's RoPE_pos(k_proj bias). */
typedef struct {
    int fmt;
    const void* data;
    const void* scales;
    float sdec;
    const float* add;
} kv_side;

/* Row argmax of fp32 logits [B, V] and the log-softmax there; 1 when out of memory. _parallel: the
   rows split over torch's threads (cpu_sampling_parallel.cpp), the same bits. */
int greedy_logprob(const float* x, int64_t B, int64_t V, int64_t* tok, float* lp);
int greedy_logprob_parallel(const float* x, int64_t B, int64_t V, int64_t* tok, float* lp);

#define CPU_FUSED_DECLARE(SFX, ELEM)                                                                                \
    void add_rmsnorm_##SFX(ELEM* x, const ELEM* res, const ELEM* w, ELEM* out, int64_t T, int64_t N, float eps);  \
    void qkv_rope_##SFX(const ELEM* qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const float* cs,            \
                        const float* sn, const int64_t* pos, const ELEM* qn, const ELEM* kn, float eps, ELEM* q_out, \
                        ELEM* kdst, ELEM* vdst, const int64_t* slots);                                              \
    void silu_mul_##SFX(const ELEM* gu, int64_t T, int64_t F, ELEM* out);                                           \
    int paged_attention_##SFX(const ELEM* q, const ELEM* kc, const ELEM* vc, const int64_t* table, int64_t ldt,     \
                              const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv,   \
                              int64_t D, float scale, ELEM* out);                                                   \
    int paged_attention_nvfp4_##SFX(const ELEM* q, const uint8_t* kc, const uint8_t* ks, const uint8_t* vc,         \
                                    const uint8_t* vs, float sdec_k, float sdec_v, const int64_t* table, int64_t ldt, \
                                    const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H,           \
                                    int64_t Hkv, int64_t D, float scale, ELEM* out);                                \
    int paged_attention_kv_##SFX(const ELEM* q, int kfmt, const void* kd, const void* ks, float sdec_k,             \
                                 const float* k_add, int vfmt, const void* vd, const void* vs, float sdec_v,        \
                                 const int64_t* table, int64_t ldt,                                                  \
                                 const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv, \
                                 int64_t D, float scale, ELEM* out);                                                \
    int paged_attention_items_##SFX(const ELEM* q, const kv_side* k, const kv_side* v, const int64_t* table,        \
                                    int64_t ldt, const int64_t* row_seq, const int64_t* row_len, int64_t T,         \
                                    int64_t H, int64_t Hkv, int64_t D, float scale, ELEM* out, int64_t i0,          \
                                    int64_t i1);                                                                    \
    int paged_attention_threaded_##SFX(const ELEM* q, const kv_side* k, const kv_side* v, const int64_t* table,     \
                                       int64_t ldt, const int64_t* row_seq, const int64_t* row_len, int64_t T,      \
                                       int64_t H, int64_t Hkv, int64_t D, float scale, ELEM* out);                  \
    int decode_layer_##SFX(const layer_args* a);

/* paged_attention*: 0, or 1 when out of memory; _items runs work items i0..i1 of T * Hkv, item i
   = (row i / Hkv, KV head i % Hkv), and _threaded all of them on torch's intra-op threads.
   decode_layer: 0, or 1 when an FP4 quantizer met NaN, 2 when out of memory, 3 for a KV slot
   outside the cache, 4 for a KV S_enc that is not finite and positive. kfmt/vfmt of
   paged_attention_kv: 0 the model dtype, 1 NVFP4, 2 FP8, 3 MXFP4 (kv_side). */
CPU_FUSED_DECLARE(f32, float)
CPU_FUSED_DECLARE(bf16, uint16_t)
#undef CPU_FUSED_DECLARE

/* One NVFP4 side (which: 0 K, 1 V) of a layer's KV write, for decode_layer and decode_layers_stream:
   x fp32 [T, kv_heads * head_dim] quantized into the pages at write_slots with the side's S_enc and,
   where the layer is logged (cap_kv, cap_kv_gs), the rows' codes, scales and S_enc copied into the
   guidance log. decode_layer's return codes: 0, 1 NaN, 3 slot outside the cache, 4 bad S_enc. */
int layer_kv_store_nvfp4(const layer_args* a, int which, const float* x);

/* n bf16 layers at decode widths, each streaming its linears (lin_kind 1 or 2) through the decode
   GEMVs, in one parallel region (megatron_trace/kernels/cpu_layer_stream.cpp); layer i + 1's res_in is layer i's
   res_out. Returns decode_layer's codes. */
int decode_layers_stream_bf16(const layer_args* const* layers, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
