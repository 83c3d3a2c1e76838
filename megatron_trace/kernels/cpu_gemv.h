/* Weight-streaming linears for the embedded engine's decode on CPU (megatron_trace/kernels/cpu_gemv.c).
 *
 * y[M, N] = x[M, K] . W[N, K]^T (+ bias), fp32 accumulation, W read as stored:
 *   NVFP4 (ModelOpt layout): codes uint8 [N, K/2] (element 2i in the low nibble), E4M3 block
 *   scales uint8 [N, K/16], fp32 decode-direction global scale per output row [N];
 *   BF16: uint16 [N, K].
 * The activations are first laid out once per call (`gemv_prepare_x`: fp32, padded to a multiple
 * of 32 columns, each 32-column chunk as its 16 even then its 16 odd columns), which is the order
 * the 16-lane kernels consume the weights in.
 */
#ifndef MEGATRON_TRACE_CPU_GEMV_H
#define MEGATRON_TRACE_CPU_GEMV_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Columns of one prepared activation row: K rounded up to 32. */
int64_t gemv_padded_k(int64_t K);

/* x [M, K] (fp32, or bf16 when x_bf16) -> xp [M, gemv_padded_k(K)] in the kernels' order. */
void gemv_prepare_x(const void* x, int x_bf16, int64_t M, int64_t K, float* xp);

/* bf16 x [M, K] -> xb [M, K] in the order the NVFP4 kernel's bf16 path reads (gemv_nvfp4_rows with
 * x_bf16 takes xb, not x; the BF16-weight kernel reads x as is). */
void gemv_prepare_x_bf16(const uint16_t* x, int64_t M, int64_t K, uint16_t* xb);

/* Output rows n0..n1 of y (fp32, or bf16 rounded to nearest even when y_bf16), row stride N.
 * x: bf16 rows [M, K] when x_bf16 (only where gemv_reads_bf16(); NVFP4: laid out by
 * gemv_prepare_x_bf16, BF16: as they are), else fp32 rows laid out by gemv_prepare_x.
 * bias: fp32 [N] or NULL. K: a multiple of 16 (NVFP4) or of 2 (BF16). */
void gemv_nvfp4_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
                     const float* gdec, const float* bias, void* y, int y_bf16, int64_t N, int64_t n0, int64_t n1);
void gemv_bf16_rows(const void* x, int x_bf16, int64_t M, int64_t K, const uint16_t* w, const float* bias, void* y,
                    int y_bf16, int64_t N, int64_t n0, int64_t n1);

/* 1 when bf16 activations are read in place (AVX512-BF16 dot products), 0 when they are widened. */
int gemv_reads_bf16(void);

/* W4A4 (megatron_trace/kernels/cpu_gemv_w4a4.c): the activations as NVFP4 too (codes [M, K/2], scales [M, K/16],
 * decode global scale adec [M]), laid out once by gemv_w4a4_prepare into M * gemv_w4a4_row_bytes(K)
 * bytes (the layout is the build's path's); exact block products. */
int64_t gemv_w4a4_chunks(int64_t K);
int64_t gemv_w4a4_row_bytes(int64_t K);
void gemv_w4a4_prepare(const uint8_t* codes, const uint8_t* scales, int64_t M, int64_t K, uint8_t* out);
void gemv_w4a4_rows(const uint8_t* ap, const float* adec, int64_t M, int64_t K, const uint8_t* codes,
                    const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16, int64_t N,
                    int64_t n0, int64_t n1);
const char* gemv_w4a4_isa(void);

/* The whole linears, output rows split over torch's threads (cpu_gemv_parallel.cpp): 0, or 1 when
 * the scratch buffer for the laid-out activations could not be allocated. */
int gemv_nvfp4(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
               const float* gdec, const float* bias, void* y, int y_bf16, int64_t N);
int gemv_bf16(const void* x, int x_bf16, int64_t M, int64_t K, const uint16_t* w, const float* bias, void* y,
              int y_bf16, int64_t N);
int gemv_w4a4(const uint8_t* acodes, const uint8_t* ascales, const float* adec, int64_t M, int64_t K,
              const uint8_t* codes, const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16,
              int64_t N);

/* Which code path this build selected: "avx512+bf16", "avx512", or the portable vectors "vec8-avx2",
 * "vec8-neon", "vec8" (SSE at the x86-64 baseline). */
const char* gemv_isa(void);

#ifdef __cplusplus
}
#endif
#endif
