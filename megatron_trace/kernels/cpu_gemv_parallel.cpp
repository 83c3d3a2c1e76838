// Entry points of the weight-streaming linears (cpu_gemv.c), called by the bindings (megatron_trace/kernels/cpu_ops.cpp)
// for megatron_trace/kernels/cpu_gemv.py: the activations are laid out once, then at::parallel_for splits the output
// rows over torch's intra-op threads (torch.get_num_threads(); the same OpenMP pool as torch's own
// ops, so the two never compete with two spinning thread pools).
#include <ATen/Parallel.h>

#include <cstdlib>
#include <vector>

#include "cpu_gemv.h"

namespace {

// Rows per task: enough weights that a task outweighs the cost of handing it out (~64 K weights).
int64_t grain(int64_t K, int64_t N) {
    int64_t g = 65536 / (K > 0 ? K : 1);
    if (g < 4) g = 4;
    return g < N ? g : N;
}

// Lays x out for the fp32 kernels; returns 1 when the buffer could not be allocated.
int prepare(const void* x, int x_bf16, int64_t M, int64_t K, std::vector<float>& xp) {
    try {
        xp.resize(static_cast<size_t>(M * gemv_padded_k(K)));
    } catch (...) {
        return 1;
    }
    gemv_prepare_x(x, x_bf16, M, K, xp.data());
    return 0;
}

}  // namespace

extern "C" {

// Returns 0, or 1 when the scratch buffer for the laid-out activations could not be allocated.
int gemv_nvfp4(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes, const uint8_t* scales,
               const float* gdec, const float* bias, void* y, int y_bf16, int64_t N) {
    std::vector<float> xp;
    std::vector<uint16_t> xb;
    const int direct = x_bf16 && gemv_reads_bf16();
    if (!direct && prepare(x, x_bf16, M, K, xp)) return 1;
    if (direct) {
        try {
            xb.resize(static_cast<size_t>(M * K));
        } catch (...) {
            return 1;
        }
        gemv_prepare_x_bf16(static_cast<const uint16_t*>(x), M, K, xb.data());
    }
    const void* x_in = direct ? static_cast<const void*>(xb.data()) : static_cast<const void*>(xp.data());
    at::parallel_for(0, N, grain(K, N), [&](int64_t n0, int64_t n1) {
        gemv_nvfp4_rows(x_in, direct, M, K, codes, scales, gdec, bias, y, y_bf16, N, n0, n1);
    });
    return 0;
}

int gemv_bf16(const void* x, int x_bf16, int64_t M, int64_t K, const uint16_t* w, const float* bias, void* y,
              int y_bf16, int64_t N) {
    std::vector<float> xp;
    const int direct = x_bf16 && gemv_reads_bf16();
    if (!direct && prepare(x, x_bf16, M, K, xp)) return 1;
    const void* x_in = direct ? x : static_cast<const void*>(xp.data());
    at::parallel_for(0, N, grain(K, N), [&](int64_t n0, int64_t n1) {
        gemv_bf16_rows(x_in, direct, M, K, w, bias, y, y_bf16, N, n0, n1);
    });
    return 0;
}

int gemv_w4a4(const uint8_t* acodes, const uint8_t* ascales, const float* adec, int64_t M, int64_t K,
              const uint8_t* codes, const uint8_t* scales, const float* wdec, const float* bias, void* y, int y_bf16,
              int64_t N) {
    std::vector<uint8_t> ap;
    try {
        ap.resize(static_cast<size_t>(M * gemv_w4a4_row_bytes(K)));
    } catch (...) {
        return 1;
    }
    gemv_w4a4_prepare(acodes, ascales, M, K, ap.data());
    const uint8_t* app = ap.data();
    at::parallel_for(0, N, grain(K, N), [&](int64_t n0, int64_t n1) {
        gemv_w4a4_rows(app, adec, M, K, codes, scales, wdec, bias, y, y_bf16, N, n0, n1);
    });
    return 0;
}

}  // extern "C"
