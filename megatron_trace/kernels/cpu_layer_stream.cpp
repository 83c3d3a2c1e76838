// Dense bf16 decoder layers at decode widths, several in one call and one parallel region
// (decode_layers_stream, cpu_fused.h), with the weights read as stored by the decode GEMVs:
//
//   per layer:  add+RMSNorm, prep ─► qkv rows ─► q/k norm, RoPE, K/V into pages ─► attention items
//     ─► prep ─► o rows ─► add+RMSNorm, prep ─► gate_up rows ─► SiLU·up, prep ─► down rows (next residual)
//
// "prep" lays the input out for the linear's GEMV, and for NVFP4 activations quantizes it first
// (into the guidance log's rows when the layer is captured). Every step calls the C function the
// per-kernel path (model.py forward_fused -> EngineLinear.forward_cpu, cpu_fused, cpu_attention)
// calls from Python, on the same inputs: the same bits, for any thread count.
//
// Why one region: the per-kernel path opens an OpenMP region per kernel, ~8 per layer. The engine's
// worker thread has a libgomp pool of its own beside the main thread's, so libgomp sees more threads
// than cores and parks its workers after ~1000 spins; every region then paid a futex wake-up of
// 50-100 us (measured: a 1152x896 GEMV took 60 us on the main thread, 150 us on the engine's),
// ~40% of a Qwen2.5-0.5B decode step. Here each step is a stage of work items (output-row chunks of a
// linear, (row, KV head) items of attention, or one serial item) that the region's threads take
// from a counter; a thread that runs out spins until every item of the stage is done. Any number of
// threads (one included) finishes every stage, so a smaller team than asked cannot deadlock.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_fp4.h"
#include "cpu_fused.h"
#include "cpu_gemv.h"
#include "cpu_quant.h"

namespace {

using bf16 = uint16_t;

enum Kind { kNormPrep, kLinear, kKv, kAttention, kPrep, kSiluPrep };

struct StageDesc {
    Kind kind;
    const layer_args* a;
    int which;  // the linear (0 qkv, 1 o, 2 gate_up, 3 down) a linear or prep stage serves
    int64_t items, rows;  // work items; output rows per item of a linear stage
};

struct Stage {
    std::atomic<int64_t> next{0}, done{0};
};

// Scratch of a call (its layers run one after another), sized for the widest layer.
struct Scratch {
    std::vector<bf16> h, qkv, q, att, kn, vn, o, gu, m, xb;
    std::vector<float> kvf, gs, adec, xp;
    std::vector<uint8_t> codes, scales, ap;
    const void* x_in = nullptr;  // the prepared input of the linear about to run
    int direct = 0;              // x_in is bf16 rows (gemv_reads_bf16), else fp32 rows laid out by gemv_prepare_x
};

int64_t in_features(const layer_args* a, int which) {
    return which == 0 || which == 2 ? a->hidden : which == 1 ? a->heads * a->head_dim : a->inter;
}

int64_t out_features(const layer_args* a, int which) {
    return which == 0 ? a->qkv_n : which == 2 ? 2 * a->inter : a->hidden;
}

// x [T, K] bf16 -> the input linear `which` reads, as EngineLinear.forward_cpu prepares it: NVFP4
// activations quantized (codes/scales/S_enc to the guidance log when captured); W4A4 then its codes
// laid out (gemv_w4a4_prepare) with S_dec = fp32(1 / fp64(S_enc)) per row, a BF16 weight the
// dequantized bf16 values; W4A16 x in the NVFP4 GEMV's order. 1 when the quantizer met NaN.
int prepare(const layer_args* a, int which, const bf16* x, Scratch& s) {
    const int64_t T = a->T, K = in_features(a, which);
    const int w4 = a->lin_kind[which] == 2;
    const bf16* in = x;
    if (a->act_mode[which]) {
        const int64_t r = a->cap_row;
        uint8_t* d = a->cap_data[which] ? static_cast<uint8_t*>(a->cap_data[which]) + r * (K / 2) : s.codes.data();
        uint8_t* sc = a->cap_scale[which] ? static_cast<uint8_t*>(a->cap_scale[which]) + r * (K / 16) : s.scales.data();
        float* g = a->cap_gs[which] ? static_cast<float*>(a->cap_gs[which]) + r : s.gs.data();
        const float* gs = a->act_mode[which] == 2 ? a->act_gs[which] : nullptr;
        if (nvfp4_qdq_rows(x, 1, 0, T, K, gs, d, sc, gs ? nullptr : g, w4 ? nullptr : s.xb.data(), 1)) return 1;
        if (gs && a->cap_gs[which])  // a per-row S_enc log under a static scale: every row gets it
            for (int64_t t = 0; t < T; t++) g[t] = *gs;
        if (w4) {
            for (int64_t t = 0; t < T; t++) s.adec[t] = (float)(1.0 / (double)(gs ? *gs : g[t]));
            gemv_w4a4_prepare(d, sc, T, K, s.ap.data());
            return 0;
        }
        in = s.xb.data();  // the dequantized input, rounded to bf16
    }
    if (!gemv_reads_bf16()) {
        gemv_prepare_x(in, 1, T, K, s.xp.data());
        s.x_in = s.xp.data();
        s.direct = 0;
    } else if (w4) {
        gemv_prepare_x_bf16(in, T, K, s.xb.data());
        s.x_in = s.xb.data();
        s.direct = 1;
    } else {
        s.x_in = in;
        s.direct = 1;
    }
    return 0;
}

// Output rows n0..n1 of linear `which`, bf16, bias added in fp32 (cpu_gemv.c's *_rows).
void linear_rows(const layer_args* a, int which, const Scratch& s, bf16* y, int64_t n0, int64_t n1) {
    const int64_t T = a->T, K = in_features(a, which), N = out_features(a, which);
    const float* bias = a->lin_bias[which];
    if (a->lin_kind[which] == 1) {
        gemv_bf16_rows(s.x_in, s.direct, T, K, static_cast<const uint16_t*>(a->lin_w[which]), bias, y, 1, N, n0, n1);
        return;
    }
    const uint8_t *codes = static_cast<const uint8_t*>(a->lin_w[which]),
                  *scales = static_cast<const uint8_t*>(a->lin_scales[which]);
    if (a->act_mode[which])
        gemv_w4a4_rows(s.ap.data(), s.adec.data(), T, K, codes, scales, a->lin_gdec[which], bias, y, 1, N, n0, n1);
    else
        gemv_nvfp4_rows(s.x_in, s.direct, T, K, codes, scales, a->lin_gdec[which], bias, y, 1, N, n0, n1);
}

// K and V of the step into their pages, q with RoPE; each side as the per-kernel path's PagedKVCache
// .write: the dtype's values, NVFP4 (quantized; captured when logged) or FP8 (a scale per token).
// decode_layer's return codes: 1 NaN, 3 slot, 4 S_enc.
int store_kv(const layer_args* a, Scratch& s) {
    const int64_t T = a->T, H = a->heads, Hkv = a->kv_heads, D = a->head_dim, n = Hkv * D;
    const auto* qn = static_cast<const bf16*>(a->q_norm);
    const auto* kn = static_cast<const bf16*>(a->k_norm);
    if (a->k_fmt == 0 && a->v_fmt == 0) {
        qkv_rope_bf16(s.qkv.data(), T, H, Hkv, D, a->cos, a->sin, a->pos, qn, kn, a->eps, s.q.data(),
                      static_cast<bf16*>(a->kc), static_cast<bf16*>(a->vc), a->write_slots);
        return 0;
    }
    qkv_rope_bf16(s.qkv.data(), T, H, Hkv, D, a->cos, a->sin, a->pos, qn, kn, a->eps, s.q.data(), s.kn.data(),
                  s.vn.data(), nullptr);
    for (int64_t t = 0; t < T; t++)
        if (a->write_slots[t] < 0 || a->write_slots[t] >= a->num_slots) return 3;
    for (int which = 0; which < 2; which++) {
        const int64_t fmt = which ? a->v_fmt : a->k_fmt;
        const bf16* rows = which ? s.vn.data() : s.kn.data();
        void* pd = which ? a->vc : a->kc;
        void* ps = which ? a->vs : a->ks;
        if (fmt == 0) {
            for (int64_t t = 0; t < T; t++)
                std::memcpy(static_cast<bf16*>(pd) + a->write_slots[t] * n, rows + t * n, (size_t)n * sizeof(bf16));
            continue;
        }
        float* xf = s.kvf.data() + which * T * n;
        for (int64_t i = 0; i < T * n; i++) xf[i] = bf16_to_f32(rows[i]);
        if (fmt == 2) {
            fp8_quantize_to_slots(xf, T, n, a->write_slots, a->num_slots, static_cast<uint8_t*>(pd),
                                  static_cast<float*>(ps));
            continue;
        }
        if (const int rc = layer_kv_store_nvfp4(a, which, xf)) return rc;
    }
    return 0;
}

int run_item(const StageDesc& d, int64_t item, Scratch& s) {
    const layer_args* a = d.a;
    switch (d.kind) {
        case kNormPrep: {  // x += residual, RMSNorm into h, prep of qkv (which 0) or gate_up (which 2)
            const bf16* res = static_cast<const bf16*>(d.which == 0 ? a->res_in : s.o.data());
            add_rmsnorm_bf16(static_cast<bf16*>(a->x), res, static_cast<const bf16*>(d.which == 0 ? a->in_norm : a->post_norm),
                             s.h.data(), a->T, a->hidden, a->eps);
            return prepare(a, d.which, s.h.data(), s);
        }
        case kLinear: {
            bf16* y = d.which == 0 ? s.qkv.data() : d.which == 1 ? s.o.data() : d.which == 2 ? s.gu.data()
                                                                                             : static_cast<bf16*>(a->res_out);
            const int64_t n0 = item * d.rows;
            linear_rows(a, d.which, s, y, n0, std::min(n0 + d.rows, out_features(a, d.which)));
            return 0;
        }
        case kKv:
            return store_kv(a, s);
        case kAttention: {
            const kv_side k = {(int)a->k_fmt, a->kc, a->ks, a->sdec_k, a->k_off};
            const kv_side v = {(int)a->v_fmt, a->vc, a->vs, a->sdec_v, nullptr};
            return paged_attention_items_bf16(s.q.data(), &k, &v, a->table, a->ldt, a->row_seq, a->row_len, a->T,
                                              a->heads, a->kv_heads, a->head_dim, a->attn_scale, s.att.data(), item,
                                              item + 1)
                       ? 2
                       : 0;
        }
        case kPrep:
            return prepare(a, d.which, s.att.data(), s);
        case kSiluPrep:
            silu_mul_bf16(s.gu.data(), a->T, a->inter, s.m.data());
            return prepare(a, 3, s.m.data(), s);
    }
    return 0;
}

std::vector<StageDesc> stages_of(const layer_args* const* layers, int64_t n) {
    std::vector<StageDesc> out;
    auto linear = [&](const layer_args* a, int which) {
        const int64_t rows = std::max<int64_t>(4, 65536 / in_features(a, which));  // ~64 K weights an item
        out.push_back({kLinear, a, which, (out_features(a, which) + rows - 1) / rows, rows});
    };
    for (int64_t i = 0; i < n; i++) {
        const layer_args* a = layers[i];
        out.push_back({kNormPrep, a, 0, 1, 0});
        linear(a, 0);
        out.push_back({kKv, a, 0, 1, 0});
        out.push_back({kAttention, a, 0, a->T * a->kv_heads, 0});
        out.push_back({kPrep, a, 1, 1, 0});
        linear(a, 1);
        out.push_back({kNormPrep, a, 2, 1, 0});
        linear(a, 2);
        out.push_back({kSiluPrep, a, 3, 1, 0});
        linear(a, 3);
    }
    return out;
}

void size_scratch(const layer_args* const* layers, int64_t n, Scratch& s) {
    int64_t T = 0, hd = 0, nq = 0, hdq = 0, kvd = 0, f = 0, k = 0;
    for (int64_t i = 0; i < n; i++) {
        const layer_args* a = layers[i];
        T = std::max(T, a->T), hd = std::max(hd, a->hidden), nq = std::max(nq, a->qkv_n);
        hdq = std::max(hdq, a->heads * a->head_dim), kvd = std::max(kvd, a->kv_heads * a->head_dim);
        f = std::max(f, a->inter);
        k = std::max({k, a->hidden, a->heads * a->head_dim, a->inter});
    }
    s.h.resize(T * hd), s.qkv.resize(T * nq), s.q.resize(T * hdq), s.att.resize(T * hdq);
    s.kn.resize(T * kvd), s.vn.resize(T * kvd), s.o.resize(T * hd), s.gu.resize(2 * T * f), s.m.resize(T * f);
    s.xb.resize(T * k), s.kvf.resize(2 * T * kvd), s.gs.resize(T), s.adec.resize(T);
    s.xp.resize(T * gemv_padded_k(k)), s.codes.resize(T * k / 2), s.scales.resize(T * k / 16);
    s.ap.resize(T * gemv_w4a4_row_bytes(k));
}

void spin_until(const std::atomic<int64_t>& done, int64_t total) {
    for (int spins = 0; done.load(std::memory_order_acquire) < total; spins++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins > 4096) std::this_thread::yield();  // the holder may be descheduled: give it the core
    }
}

}  // namespace

extern "C" int decode_layers_stream_bf16(const layer_args* const* layers, int64_t n) {
    if (n <= 0) return 0;
    Scratch s;
    try {
        size_scratch(layers, n, s);
    } catch (...) {
        return 2;
    }
    const std::vector<StageDesc> descs = stages_of(layers, n);
    std::unique_ptr<Stage[]> st(new Stage[descs.size()]);
    std::atomic<int> rc{0};
    auto worker = [&]() {
        for (size_t i = 0; i < descs.size(); i++) {
            for (int64_t it; (it = st[i].next.fetch_add(1, std::memory_order_relaxed)) < descs[i].items;) {
                if (!rc.load(std::memory_order_relaxed)) {  // after a failure the rest only counts items down
                    const int r = run_item(descs[i], it, s);
                    int none = 0;
                    if (r) rc.compare_exchange_strong(none, r);
                }
                st[i].done.fetch_add(1, std::memory_order_release);
            }
            spin_until(st[i].done, descs[i].items);
        }
    };
    const int64_t threads = at::get_num_threads();
    if (threads <= 1)
        worker();
    else  // one task per thread; a thread handed two runs the (then finished) stages twice
        at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
            for (; b < e; b++) worker();
        });
    return rc.load();
}
