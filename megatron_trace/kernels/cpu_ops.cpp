// Python bindings of the engine's CPU kernels (cpu_quant.c, cpu_fused.c, cpu_gemv*.c): functions
// of torch tensors, built with them into one extension by megatron_trace/kernels/cpu_build.py. The Python
// wrappers (megatron_trace/kernels/cpu_*.py, megatron_trace.kernels.dispatch) check shapes and allocate the outputs; these pass
// the tensors' memory to C. The GIL is released around every kernel, so the engine's worker and
// the HTTP server's threads keep running while one computes (what ctypes did before).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "cpu_fp4.h"
#include "cpu_fused.h"
#include "cpu_gemv.h"
#include "cpu_layer.h"
#include "cpu_quant.h"

namespace py = pybind11;
using Opt = c10::optional<at::Tensor>;

namespace {

template <typename T>
T* at_(const at::Tensor& t) {
    return static_cast<T*>(t.data_ptr());
}

template <typename T>
T* at_(const Opt& t) {
    return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

bool bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// An address from Python: an int (tensor.data_ptr(), a guidance-log row), or None for NULL.
uintptr_t address(const py::object& v) { return v.is_none() ? 0 : v.cast<uintptr_t>(); }

// x fp32 or bf16 [..., K], xhat (optional) fp32 or bf16: both read and written in their own dtype,
// so a bf16 model's activations need no conversion passes around the kernel.
int qdq(const at::Tensor& x, const Opt& gs_in, at::Tensor& data, at::Tensor& scale, const Opt& gs_out,
        const Opt& xhat) {
    const int64_t k = x.size(-1);
    return nvfp4_qdq_parallel(x.data_ptr(), bf16(x), k ? x.numel() / k : 0, k, at_<const float>(gs_in),
                              at_<uint8_t>(data), at_<uint8_t>(scale), at_<float>(gs_out),
                              xhat.has_value() ? xhat->data_ptr() : nullptr, xhat.has_value() && bf16(*xhat));
}

int quantize_to_slots(const at::Tensor& x, int64_t n, const at::Tensor& gs, const at::Tensor& slots,
                      at::Tensor& codes, at::Tensor& scales) {
    return nvfp4_quantize_to_slots(at_<float>(x), x.size(0), n, at_<float>(gs), at_<int64_t>(slots), codes.size(0),
                                   at_<uint8_t>(codes), at_<uint8_t>(scales));
}

int fp8_to_slots(const at::Tensor& x, int64_t n, const at::Tensor& slots, at::Tensor& codes, at::Tensor& sdec) {
    return fp8_quantize_to_slots(at_<float>(x), x.size(0), n, at_<int64_t>(slots), codes.size(0), at_<uint8_t>(codes),
                                 at_<float>(sdec));
}

// TRACE guided rounding of x [R, K] into out's rows where mask (uint8 [R]) is set; gs fp32 [R] or
// [1]; exactly one of codes / mant; rtn and agree_ref optional packed codes; counts int64 [3].
void guided_dq(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& gs, const Opt& codes, const Opt& mant,
               const at::Tensor& mask, const Opt& rtn, const Opt& agree_ref, at::Tensor& out, at::Tensor& counts) {
    const int64_t k = x.size(-1);
    nvfp4_guided_dq_parallel(x.data_ptr(), bf16(x), k ? x.numel() / k : 0, k, at_<uint8_t>(scale), at_<float>(gs),
                             gs.numel() > 1, at_<uint8_t>(codes), at_<uint8_t>(mant), at_<uint8_t>(mask),
                             at_<uint8_t>(rtn), at_<uint8_t>(agree_ref), out.data_ptr(), bf16(out),
                             at_<int64_t>(counts));
}

py::tuple decode_tables() {
    auto lut = torch::from_blob(const_cast<float*>(nvfp4_e4m3_lut()), {256}, torch::kFloat32).clone();
    auto grid = torch::from_blob(const_cast<float*>(nvfp4_e2m1_grid()), {16}, torch::kFloat32).clone();
    auto bounds = torch::from_blob(const_cast<float*>(E2M1_BOUNDS), {7}, torch::kFloat32).clone();
    return py::make_tuple(lut, grid, bounds, NVFP4_ONE_SIXTH);
}

// The GEMVs' 2 e2m1 tables (fp32 [16], int8 [16], bf16 bits [32]), for the test that they are fp4's grid.
py::tuple gemv_tables() {
    auto f = torch::from_blob(const_cast<float*>(TWO_E2M1), {16}, torch::kFloat32).clone();
    auto i8 = torch::from_blob(const_cast<int8_t*>(TWO_E2M1_I8), {16}, torch::kInt8).clone();
    auto bf = torch::from_blob(const_cast<uint16_t*>(TWO_E2M1_BF16), {32}, torch::kInt16).clone();
    return py::make_tuple(f, i8, bf);
}

void add_rmsnorm(at::Tensor& x, const Opt& res, const at::Tensor& w, at::Tensor& out, double eps) {
    if (bf16(x))
        add_rmsnorm_bf16(at_<uint16_t>(x), at_<const uint16_t>(res), at_<uint16_t>(w), at_<uint16_t>(out), x.size(0),
                         x.size(1), (float)eps);
    else
        add_rmsnorm_f32(at_<float>(x), at_<const float>(res), at_<float>(w), at_<float>(out), x.size(0), x.size(1),
                        (float)eps);
}

void qkv_rope(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
              const at::Tensor& sin, const Opt& pos, const Opt& q_norm, const Opt& k_norm, double eps, at::Tensor& q,
              at::Tensor& k_dst, at::Tensor& v_dst, const Opt& slots) {
    if (bf16(qkv))
        qkv_rope_bf16(at_<uint16_t>(qkv), qkv.size(0), heads, kv_heads, head_dim, at_<float>(cos), at_<float>(sin),
                      at_<const int64_t>(pos), at_<const uint16_t>(q_norm), at_<const uint16_t>(k_norm), (float)eps,
                      at_<uint16_t>(q), at_<uint16_t>(k_dst), at_<uint16_t>(v_dst), at_<const int64_t>(slots));
    else
        qkv_rope_f32(at_<float>(qkv), qkv.size(0), heads, kv_heads, head_dim, at_<float>(cos), at_<float>(sin),
                     at_<const int64_t>(pos), at_<const float>(q_norm), at_<const float>(k_norm), (float)eps,
                     at_<float>(q), at_<float>(k_dst), at_<float>(v_dst), at_<const int64_t>(slots));
}

void silu_mul(const at::Tensor& gu, at::Tensor& out) {
    if (bf16(gu))
        silu_mul_bf16(at_<uint16_t>(gu), gu.size(0), gu.size(1) / 2, at_<uint16_t>(out));
    else
        silu_mul_f32(at_<float>(gu), gu.size(0), gu.size(1) / 2, at_<float>(out));
}

int paged_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                    const at::Tensor& row_seq, const at::Tensor& row_len, double scale, at::Tensor& out) {
    const int64_t t = q.size(0), h = q.size(1), d = q.size(2), hkv = kc.size(-2), ldt = table.stride(0);
    if (bf16(q))
        return paged_attention_bf16(at_<uint16_t>(q), at_<uint16_t>(kc), at_<uint16_t>(vc), at_<int64_t>(table), ldt,
                                    at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, hkv, d, (float)scale,
                                    at_<uint16_t>(out));
    return paged_attention_f32(at_<float>(q), at_<float>(kc), at_<float>(vc), at_<int64_t>(table), ldt,
                               at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, hkv, d, (float)scale,
                               at_<float>(out));
}

int paged_attention_nvfp4(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& vc,
                          const at::Tensor& vs, double sdec_k, double sdec_v, const at::Tensor& table,
                          const at::Tensor& row_seq, const at::Tensor& row_len, double scale, at::Tensor& out) {
    const int64_t t = q.size(0), h = q.size(1), d = q.size(2), hkv = kc.size(-2), ldt = table.stride(0);
    if (bf16(q))
        return paged_attention_nvfp4_bf16(at_<uint16_t>(q), at_<uint8_t>(kc), at_<uint8_t>(ks), at_<uint8_t>(vc),
                                          at_<uint8_t>(vs), (float)sdec_k, (float)sdec_v, at_<int64_t>(table), ldt,
                                          at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, hkv, d, (float)scale,
                                          at_<uint16_t>(out));
    return paged_attention_nvfp4_f32(at_<float>(q), at_<uint8_t>(kc), at_<uint8_t>(ks), at_<uint8_t>(vc),
                                     at_<uint8_t>(vs), (float)sdec_k, (float)sdec_v, at_<int64_t>(table), ldt,
                                     at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, hkv, d, (float)scale,
                                     at_<float>(out));
}

int paged_attention_kv(const at::Tensor& q, int64_t k_fmt, const at::Tensor& kd, const Opt& ks, double sdec_k,
                       const Opt& k_add, int64_t v_fmt, const at::Tensor& vd, const Opt& vs, double sdec_v,
                       const at::Tensor& table, const at::Tensor& row_seq, const at::Tensor& row_len, int64_t kv_heads,
                       double scale, at::Tensor& out) {
    const int64_t t = q.size(0), h = q.size(1), d = q.size(2), ldt = table.stride(0);
    const float* add = k_add.has_value() ? k_add->data_ptr<float>() : nullptr;
    if (bf16(q))
        return paged_attention_kv_bf16(at_<uint16_t>(q), (int)k_fmt, kd.data_ptr(), at_<void>(ks), (float)sdec_k, add,
                                       (int)v_fmt, vd.data_ptr(), at_<void>(vs), (float)sdec_v, at_<int64_t>(table),
                                       ldt, at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, kv_heads, d,
                                       (float)scale, at_<uint16_t>(out));
    return paged_attention_kv_f32(at_<float>(q), (int)k_fmt, kd.data_ptr(), at_<void>(ks), (float)sdec_k, add,
                                  (int)v_fmt, vd.data_ptr(), at_<void>(vs), (float)sdec_v, at_<int64_t>(table), ldt,
                                  at_<int64_t>(row_seq), at_<int64_t>(row_len), t, h, kv_heads, d, (float)scale,
                                  at_<float>(out));
}

int gemv_nvfp4_t(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& gdec,
                 const Opt& bias, at::Tensor& y) {
    return gemv_nvfp4(x.data_ptr(), bf16(x), x.size(0), x.size(1), at_<uint8_t>(codes), at_<uint8_t>(scales),
                      at_<float>(gdec), at_<const float>(bias), y.data_ptr(), bf16(y), y.size(1));
}

int gemv_bf16_t(const at::Tensor& x, const at::Tensor& w, const Opt& bias, at::Tensor& y) {
    return gemv_bf16(x.data_ptr(), bf16(x), x.size(0), x.size(1), static_cast<const uint16_t*>(w.data_ptr()),
                     at_<const float>(bias), y.data_ptr(), bf16(y), y.size(1));
}

int gemv_w4a4_t(const at::Tensor& act_codes, const at::Tensor& act_scales, const at::Tensor& adec,
                const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& wdec, const Opt& bias,
                at::Tensor& y) {
    return gemv_w4a4(at_<uint8_t>(act_codes), at_<uint8_t>(act_scales), at_<float>(adec), act_codes.size(0),
                     2 * codes.size(1), at_<uint8_t>(codes), at_<uint8_t>(scales), at_<float>(wdec),
                     at_<const float>(bias), y.data_ptr(), bf16(y), y.size(1));
}

// The layer's arguments as a Python class, generated from the field lists of cpu_layer.h. Array
// fields read back as tuples, so `args.act_mode[i] = v` fails loudly instead of changing a copy.
void bind_layer_args(py::module_& m) {
    py::class_<layer_args> cls(m, "LayerArgs", py::module_local());  // native and portable builds load side by side
    cls.def(py::init([]() {
        layer_args a;
        std::memset(&a, 0, sizeof a);
        return a;
    }));
#define NUMBER(type, name) cls.def_readwrite(#name, &layer_args::name);
#define ADDRESS(type, name)                                                                          \
    cls.def_property(                                                                                \
        #name, [](const layer_args& a) { return reinterpret_cast<uintptr_t>(a.name); },            \
        [](layer_args& a, const py::object& v) { a.name = reinterpret_cast<type>(address(v)); });
#define ARRAY(type, name, n, get, set)                                                              \
    cls.def_property(                                                                                \
        #name,                                                                                       \
        [](const layer_args& a) {                                                                    \
            py::tuple out(n);                                                                        \
            for (int i = 0; i < n; i++) out[i] = get(a.name[i]);                                     \
            return out;                                                                              \
        },                                                                                           \
        [](layer_args& a, const py::sequence& v) {                                                   \
            if (py::len(v) != n) throw py::value_error(#name " takes exactly " #n " values");        \
            for (int i = 0; i < n; i++) a.name[i] = set(type, v[i]);                                 \
        });
#define AS_NUMBER(x) x
#define AS_ADDRESS(x) reinterpret_cast<uintptr_t>(x)
#define SET_NUMBER(type, v) v.cast<type>()
#define SET_ADDRESS(type, v) reinterpret_cast<type>(address(v))
#define NUMBER_ARRAY(type, name, n) ARRAY(type, name, n, AS_NUMBER, SET_NUMBER)
#define ADDRESS_ARRAY(type, name, n) ARRAY(type, name, n, AS_ADDRESS, SET_ADDRESS)
    LAYER_ARGS_NUMBERS(NUMBER)
    LAYER_ARGS_ADDRESSES(ADDRESS)
    LAYER_ARGS_NUMBER_ARRAYS(NUMBER_ARRAY)
    LAYER_ARGS_ADDRESS_ARRAYS(ADDRESS_ARRAY)
}

}  // namespace

// glibc: serve allocations below mmap_threshold from the heap and keep up to trim_threshold of freed
// heap, so a large temporary reuses memory instead of being page-faulted in anew (megatron_trace/kernels/cpu_alloc.py).
// Returns "" when set, else why not.
std::string keep_freed_memory(int64_t mmap_threshold, int64_t trim_threshold) {
#if defined(__GLIBC__)
    if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) return "mallopt(M_MMAP_THRESHOLD) refused";
    if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) != 1) return "mallopt(M_TRIM_THRESHOLD) refused";
    return "";
#else
    (void)mmap_threshold, (void)trim_threshold;
    return "not glibc";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    nvfp4_tables_init();
    bind_layer_args(m);
    using release = py::call_guard<py::gil_scoped_release>;
    m.def("nvfp4_qdq", &qdq, release());
    m.def("nvfp4_guided_dq", &guided_dq, release());
    m.def("nvfp4_quantize_to_slots", &quantize_to_slots, release());
    m.def("fp8_quantize_to_slots", &fp8_to_slots, release());
    m.def("nvfp4_mantissa_bits", [](const at::Tensor& packed, at::Tensor& out) {
        nvfp4_mantissa_bits(at_<uint8_t>(packed), packed.numel(), at_<uint8_t>(out));
    }, release());
    m.def("nvfp4_gather_dequant", [](const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& idx,
                                     int64_t row, double sdec, at::Tensor& out) {
        nvfp4_gather_dequant(at_<uint8_t>(codes), at_<uint8_t>(scales), at_<int64_t>(idx), idx.numel(), row, row / 2,
                             row / 16, (float)sdec, at_<float>(out));
    }, release());
    m.def("decode_tables", &decode_tables, "(E4M3 lut [256], E2M1 grid [16], bounds [7], fp32(1/6)) of the C code");
    m.def("gemv_tables", &gemv_tables);
    m.def("add_rmsnorm", &add_rmsnorm, release());
    m.def("qkv_rope", &qkv_rope, release());
    m.def("silu_mul", &silu_mul, release());
    m.def("greedy_logprob", [](const at::Tensor& x, at::Tensor& tok, at::Tensor& lp) {
        return greedy_logprob_parallel(at_<float>(x), x.size(0), x.size(1), at_<int64_t>(tok), at_<float>(lp));
    }, release());
    m.def("paged_attention", &paged_attention, release());
    m.def("paged_attention_nvfp4", &paged_attention_nvfp4, release());
    m.def("paged_attention_kv", &paged_attention_kv, release());
    m.def("decode_layer", [](const layer_args& a, bool is_bf16) {
        return is_bf16 ? decode_layer_bf16(&a) : decode_layer_f32(&a);
    }, release());
    m.def("decode_layers_stream", [](const std::vector<const layer_args*>& layers) {
        py::gil_scoped_release unlocked;
        return decode_layers_stream_bf16(layers.data(), static_cast<int64_t>(layers.size()));
    });
    m.def("gemv_nvfp4", &gemv_nvfp4_t, release());
    m.def("gemv_bf16", &gemv_bf16_t, release());
    m.def("gemv_w4a4", &gemv_w4a4_t, release());
    m.def("keep_freed_memory", &keep_freed_memory);
    m.def("gemv_isa", []() { return std::string(gemv_isa()); });
    m.def("gemv_w4a4_isa", []() { return std::string(gemv_w4a4_isa()); });
}
