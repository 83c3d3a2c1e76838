// Paged attention on torch's intra-op threads: the work items of cpu_attention_typed.h, (row t, KV
// head), handed out by a counter to the threads of one at::parallel_for (the OpenMP pool torch's own
// ops use, as cpu_gemv_parallel.cpp does). An item's arithmetic does not depend on which thread runs
// it, so results are the same bits for every thread count.
#include <ATen/Parallel.h>

#include <algorithm>
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
    if (n <= 1 || positions * H * D < kSerialWork || at::get_num_threads() < 2)
        return items(q, k, v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out, 0, n);
    // Items are taken from a shared counter, not split in equal ranges: on a shared box one thread
    // is often descheduled, and a static split then waits for it (2 threads ran 2-3x slower than 1).
    const int64_t threads = at::get_num_threads(), chunk = std::max<int64_t>(1, n / (4 * threads));
    std::atomic<int64_t> next{0};
    std::atomic<int> rc{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t i0; (i0 = next.fetch_add(chunk)) < n;)
            if (items(q, k, v, table, ldt, row_seq, row_len, T, H, Hkv, D, scale, out, i0, std::min(i0 + chunk, n)))
                rc = 1;
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
