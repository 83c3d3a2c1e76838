// The activation quantizer's rows over torch's intra-op threads (at::parallel_for, the same OpenMP
// pool as the GEMVs and torch's own ops): a decode step quantizes every NVFP4-activation linear's
// input, and on one thread that was W4A4's main cost over BF16 at batch 32. Quantization is per
// row (per-row S_enc or one static S_enc), so every split gives the same bytes.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "cpu_quant.h"

extern "C" int nvfp4_qdq_parallel(const void* x, int x_bf16, int64_t R, int64_t K, const float* gs_in, uint8_t* data,
                                  uint8_t* scale, float* gs_out, void* xhat, int xhat_bf16) {
    // Rows per task: ~16 K elements (a few microseconds) outweigh handing the task to a thread.
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
    std::atomic<int> nan{0};
    at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
        if (nvfp4_qdq_rows(x, x_bf16, r0, r1, K, gs_in, data, scale, gs_out, xhat, xhat_bf16)) nan.store(1);
    });
    return nan.load();
}

// The trainer's guided QAT sites: a micro-batch's activation rows, split the same way (each row is
// rounded alone), the counts summed over the tasks.
extern "C" void nvfp4_guided_dq_parallel(const void* x, int x_bf16, int64_t R, int64_t K, const uint8_t* scale,
                                         const float* gs, int gs_per_row, const uint8_t* codes, const uint8_t* mant,
                                         const uint8_t* mask, const uint8_t* rtn, const uint8_t* agree_ref, void* out,
                                         int out_bf16, int64_t* counts) {
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
    std::atomic<int64_t> changed{0}, agree{0}, guided{0};
    at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
        int64_t c[3] = {0, 0, 0};
        nvfp4_guided_dq_rows(x, x_bf16, r0, r1, K, scale, gs, gs_per_row, codes, mant, mask, rtn, agree_ref, out,
                             out_bf16, c);
        changed += c[0];
        agree += c[1];
        guided += c[2];
    });
    if (counts) {
        counts[0] += changed.load();
        counts[1] += agree.load();
        counts[2] += guided.load();
    }
}
