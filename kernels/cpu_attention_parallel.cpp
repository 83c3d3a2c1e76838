// Paged attention on torch's intra-op threads: the work items of cpu_attention_typed.h, (row t, KV
// head), split over at::parallel_for (the OpenMP pool torch's own ops use, as cpu_gemv_parallel.cpp
// does). An item's arithmetic does not depend on which thread runs it, so results are the same bits
// for every thread count.
#include <ATen/Parallel.h>

#include <atomic>

#include "cpu_fused.h"

namespace {

// Multiply-adds below which a call stays on the calling thread: handing out tasks costs a few
// microseconds, as much as attending a short context (the engine's tiny test model, early decode).
constexpr int64_t kSerialWork = 1 << 17;

template <typename Elem, typename Items>
int run(Items items, const Elem* q, const kv_side* k, const kv_side* v, const int64_t* table, int64_t ldt,
        const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H, int64_t Hkv, int64_t D, float scale,
        Elem* out) {
    const int64_t n = T * Hkv;
    int64_t positions = 0;
    for (int64_t t = 0; t < T; t++) positions += row_len[t];
    const int64_t grain = positions * H * D < kSerialWork ? (n > 0 ? n : 1) : 1;
    std::atomic<int> rc{0};
    at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
        if (items(q, k, v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out, i0, i1)) rc = 1;
    });
    return rc.load();
}

}  // namespace

extern "C" {

int paged_attention_threaded_f32(const float* q, const kv_side* k, const kv_side* v, const int64_t* table,
                                 int64_t ldt, const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H,
                                 int64_t Hkv, int64_t D, float scale, float* out) {
    return run(paged_attention_items_f32, q, k, v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out);
}

int paged_attention_threaded_bf16(const uint16_t* q, const kv_side* k, const kv_side* v, const int64_t* table,
                                  int64_t ldt, const int64_t* row_seq, const int64_t* row_len, int64_t T, int64_t H,
                                  int64_t Hkv, int64_t D, float scale, uint16_t* out) {
    return run(paged_attention_items_bf16, q, k, v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out);
}

}  // extern "C"
