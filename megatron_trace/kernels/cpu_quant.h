/* NVFP4 quantize / dequantize of the engine on CPU (megatron_trace/kernels/cpu_quant.c), bit-identical to
 * megatron_trace.fp4.nvfp4.quantize / dequantize and fp4.guided.mantissa_bits_packed.
 * Python reaches them through megatron_trace/kernels/cpu_ops.cpp (torch tensors) and megatron_trace.kernels.dispatch.
 */
#ifndef MEGATRON_TRACE_CPU_QUANT_H
#define MEGATRON_TRACE_CPU_QUANT_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Fills the E4M3 and E2M1 decode tables; call once before any function below (the module init does). */
void nvfp4_tables_init(void);
/* E4M3 byte -> fp32 [256] and E2M1 code -> fp32 [16], as torch's float8_e4m3fn and fp4.codecs.e2m1_grid. */
const float* nvfp4_e4m3_lut(void);
const float* nvfp4_e2m1_grid(void);

/* x [R, K] -> data [R, K/2], scale [R, K/16], gs_out [R] (per-row S_enc when gs_in is NULL; with
   gs_in, the one S_enc *gs_in) and optionally xhat [R, K] (the dequantized values, fp32).
   Returns 1 (outputs undefined) when x holds a NaN, else 0. */
int nvfp4_qdq(const float* x, int64_t R, int64_t K, const float* gs_in, uint8_t* data, uint8_t* scale, float* gs_out,
              float* xhat);

/* Rows [r0, r1) of the above, with x fp32 or bf16 (x_bf16) and xhat fp32 or bf16 (xhat_bf16,
   rounded to nearest even as torch's cast): rows are independent, so a split over threads gives
   the same bytes. Returns 1 when those rows hold a NaN, else 0. */
int nvfp4_qdq_rows(const void* x, int x_bf16, int64_t r0, int64_t r1, int64_t K, const float* gs_in, uint8_t* data,
                   uint8_t* scale, float* gs_out, void* xhat, int xhat_bf16);
/* All R rows of nvfp4_qdq_rows split over torch's intra-op threads (megatron_trace/kernels/cpu_quant_parallel.cpp). */
int nvfp4_qdq_parallel(const void* x, int x_bf16, int64_t R, int64_t K, const float* gs_in, uint8_t* data,
                       uint8_t* scale, float* gs_out, void* xhat, int xhat_bf16);

/* Row t of x [T, n] (one S_enc *gs) quantized straight into codes[slots[t]] [*, n/2] and
   scales[slots[t]] [*, n/16] of S slots. Returns 1 on a NaN, 2 for a slot outside [0, S), 3 for
   an S_enc that is not finite and positive; on 2 and 3 nothing was written. */
int nvfp4_quantize_to_slots(const float* x, int64_t T, int64_t n, const float* gs, const int64_t* slots, int64_t S,
                            uint8_t* codes, uint8_t* scales);

/* FP8 E4M3 rows (one fp32 S_dec each, fp4.fp8.quantize(x, dims=2)) of x [T, n] straight into
   codes[slots[t]] [*, n] and sdec[slots[t]] of S slots. Returns 2 (nothing written) for a slot
   outside [0, S), else 0. */
int fp8_quantize_to_slots(const float* x, int64_t T, int64_t n, const int64_t* slots, int64_t S, uint8_t* codes,
                          float* sdec);

/* Mantissa bits of n packed code bytes (n % 4 == 0, low nibble first) -> n/4 bytes, element 8i+j at bit j of byte i. */
void nvfp4_mantissa_bits(const uint8_t* packed, int64_t n, uint8_t* out);

/* out[n] = dequantize(codes[idx[n]], scales[idx[n]]) (fp32) for rows of `row` elements, codes
   rows cstride bytes apart, scale rows sstride bytes apart; sdec the decode global scale. */
void nvfp4_gather_dequant(const uint8_t* codes, const uint8_t* scales, const int64_t* idx, int64_t N, int64_t row,
                          int64_t cstride, int64_t sstride, float sdec, float* out);

/* TRACE guided rounding, dequantized (fp4.guided.guided_quantize then nvfp4.dequantize) of rows
   [r0, r1) of x [R, K] (fp32 or bf16) with the rollout's block scales [R, K/16], S_enc (gs[r] or
   gs[0]) and packed codes [R, K/2] or packed mantissa bits [R, K/8]: rows with mask[r] written to
   out [R, K] (fp32 or bf16), the others untouched. counts[3] (optional) += elements whose code
   differs from rtn's (when set), equal agree_ref's (when set; both zeros one), guided. */
void nvfp4_guided_dq_rows(const void* x, int x_bf16, int64_t r0, int64_t r1, int64_t K, const uint8_t* scale,
                          const float* gs, int gs_per_row, const uint8_t* codes, const uint8_t* mant,
                          const uint8_t* mask, const uint8_t* rtn, const uint8_t* agree_ref, void* out, int out_bf16,
                          int64_t* counts);
/* All R rows of nvfp4_guided_dq_rows over torch's intra-op threads (cpu_quant_parallel.cpp). */
void nvfp4_guided_dq_parallel(const void* x, int x_bf16, int64_t R, int64_t K, const uint8_t* scale, const float* gs,
                              int gs_per_row, const uint8_t* codes, const uint8_t* mant, const uint8_t* mask,
                              const uint8_t* rtn, const uint8_t* agree_ref, void* out, int out_bf16,
                              int64_t* counts);

#ifdef __cplusplus
}
#endif
#endif
