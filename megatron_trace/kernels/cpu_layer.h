/* One C call per dense decoder layer (megatron_trace/kernels/cpu_layer_typed.h), or per run of layers at decode
 * widths (megatron_trace/kernels/cpu_layer_stream.cpp): its arguments.
 *
 * The fields are listed once, below, and both the C struct and its Python binding
 * (megatron_trace/kernels/cpu_ops.cpp: megatron_trace.kernels.cpu_layer.LayerArgs) are generated from these lists, so the two
 * cannot drift. Addresses cross from Python as integers (tensor.data_ptr(), guidance-log rows).
 */
#ifndef MEGATRON_TRACE_CPU_LAYER_H
#define MEGATRON_TRACE_CPU_LAYER_H
#include <stdint.h>

/* X(type, name): numbers */
#define LAYER_ARGS_NUMBERS(X)                                                                       \
    X(int64_t, T) X(int64_t, hidden) X(int64_t, heads) X(int64_t, kv_heads) X(int64_t, head_dim)    \
    X(int64_t, inter) X(int64_t, qkv_n) X(float, eps) X(float, attn_scale)                          \
    X(int64_t, cap_row)   /* guidance: this step writes its T rows of the log from row cap_row on */ \
    X(int64_t, kv_fmt)    /* decode_layer: 0 pages in the dtype, 1 NVFP4 codes + scales */           \
    X(int64_t, k_fmt) X(int64_t, v_fmt) /* decode_layers_stream, per side: kv_side.fmt 0, 1 or 2 (FP8) */ \
    X(float, sdec_k) X(float, sdec_v) X(int64_t, num_slots) X(int64_t, ldt)

/* X(type, name): addresses (0 / None: absent) */
#define LAYER_ARGS_ADDRESSES(X)                                                                     \
    X(const void*, in_norm) X(const void*, post_norm) X(const void*, q_norm) X(const void*, k_norm) \
    X(const void*, qkv_wt) X(const void*, qkv_b) X(const void*, o_wt) X(const void*, o_b)           \
    X(const void*, gu_wt) X(const void*, down_wt)                                                   \
    X(void*, kc) X(void*, vc) X(void*, ks) X(void*, vs)                                             \
    X(const float*, gs_k) X(const float*, gs_v) X(const int64_t*, write_slots)                      \
    X(const int64_t*, table) X(const int64_t*, row_seq) X(const int64_t*, row_len)                  \
    X(const float*, cos) X(const float*, sin) /* RoPE tables [positions, D], read at row pos[t] */  \
    X(const int64_t*, pos) X(void*, x) X(const void*, res_in) X(void*, res_out)                    \
    X(const float*, k_off) /* stream, de-biased K: fp32 RoPE_j(k bias) [>= width, Hkv, D] added at read, or 0 */

/* X(type, name, n): arrays of numbers, one per linear (qkv, o, gate_up, down).
   act_mode: 0 none, 1 NVFP4 per token, 2 static S_enc (act_gs).
   lin_kind: 0 the GEMM over the transposed copy (*_wt, decode_layer), 1 a BF16 weight streamed as
   stored (lin_w [N, K]), 2 an NVFP4 weight streamed as stored (lin_w codes [N, K/2], lin_scales
   E4M3 [N, K/16], lin_gdec S_dec [N]); 1 and 2 are decode_layers_stream's (lin_bias: fp32 [N] or 0). */
#define LAYER_ARGS_NUMBER_ARRAYS(X) X(int64_t, act_mode, 4) X(int64_t, lin_kind, 4)

/* X(type, name, n): arrays of addresses. Guidance capture: row 0 of the log's arrays (0: not
   captured); an S_enc address under a static scale gets that scale on every row. */
#define LAYER_ARGS_ADDRESS_ARRAYS(X)                                                              \
    X(const void*, lin_w, 4) X(const void*, lin_scales, 4) X(const float*, lin_gdec, 4)           \
    X(const float*, lin_bias, 4) X(const float*, act_gs, 4)                                       \
    X(void*, cap_data, 4) X(void*, cap_scale, 4) X(void*, cap_gs, 4)                              \
    X(void*, cap_kv, 4)   /* NVFP4 KV: K codes, K scales, V codes, V scales */                    \
    X(void*, cap_kv_gs, 2) /* NVFP4 KV: S_enc of K, of V (0 while the log keeps one static value) */

#define LAYER_ARGS_FIELD(type, name) type name;
#define LAYER_ARGS_ARRAY(type, name, n) type name[n];
typedef struct {
    LAYER_ARGS_NUMBERS(LAYER_ARGS_FIELD)
    LAYER_ARGS_ADDRESSES(LAYER_ARGS_FIELD)
    LAYER_ARGS_NUMBER_ARRAYS(LAYER_ARGS_ARRAY)
    LAYER_ARGS_ADDRESS_ARRAYS(LAYER_ARGS_ARRAY)
} layer_args;
#undef LAYER_ARGS_FIELD
#undef LAYER_ARGS_ARRAY

#endif
