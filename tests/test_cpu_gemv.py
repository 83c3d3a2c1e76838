"""megatron_trace/kernels/cpu_gemv (weight-streaming NVFP4 and BF16 linears) against fp4's dequantize + an fp64 matmul.

Tolerance: the kernels accumulate in fp32 in another order than a reference matmul (per 16-column
NVFP4 block, with the block scale and the global scale applied after the sums), so each output may
differ from the exact value by the rounding of a K-term fp32 sum: |error| <= K * 2^-23 * sum_k |x_k w_k|
(the standard bound for recursive summation, K * eps per term's magnitude, with eps = 2^-24 doubled
for the product and scale roundings), plus the roundings of the global scale and bias applied to
the sum (2^-23 of |y| and |bias|). Outputs rounded to bf16 add half a bf16 ulp of the value.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import cpu_gemv

pytestmark = [
    pytest.mark.isa_avx2,
    pytest.mark.isa_baseline,
    pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv not built: {cpu_gemv.unavailable_reason()}"),
]
# the build the engine runs (MEGATRON_TRACE_CPU_ISA), and the portable vectors every compiler builds
BUILDS = ["engine", "baseline"]


def _lib(build):
    return cpu_gemv.baseline_library() if build == "baseline" else None


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    return k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None):
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    tol = _bound(x, w) + 2.0**-23 * (ref.abs() + (0 if bias is None else bias.double().abs()))  # + the final roundings
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), f"error {float(err.flatten()[worst])} > {float(tol.flatten()[worst])} allowed"


shapes = st.tuples(
    st.integers(1, 40), st.integers(1, 67).map(lambda n: n | 1), st.integers(1, 24).map(lambda b: 16 * b)
)


@pytest.mark.parametrize("build", BUILDS)
@settings(max_examples=15, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), x_bf16=st.booleans(), bias=st.booleans(), per_row=st.booleans())
def test_nvfp4_linear_equals_dequantize_then_matmul(build, shape, seed, x_bf16, bias, per_row):
    m, n, k = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    q = nvfp4.quantize(w, per_row_global=per_row)
    x = torch.randn(m, k, generator=g)
    x = x.bfloat16() if x_bf16 else x
    b = torch.randn(n, generator=g) if bias else None
    y = cpu_gemv.nvfp4_linear(
        x, q.data, q.scale, nvfp4.decode_scale(q.global_scale), b, out_dtype=torch.float32, lib=_lib(build)
    )
    _check(y, x.float(), nvfp4.dequantize(q), b)


@pytest.mark.parametrize("build", BUILDS)
@settings(max_examples=15, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), static=st.booleans(), out_bf16=st.booleans())
def test_w4a4_linear_equals_both_dequantized_then_matmul(build, shape, seed, static, out_bf16):
    """Activations quantized by fp4 (per token or under one static scale) times an NVFP4 weight."""
    m, n, k = shape
    g = torch.Generator().manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8
    qa = nvfp4.quantize(x, global_scale=torch.tensor(0.5)) if static else nvfp4.quantize(x, per_row_global=True)
    y = cpu_gemv.w4a4_linear(
        qa.data,
        qa.scale,
        nvfp4.decode_scale(qa.global_scale),
        q.data,
        q.scale,
        nvfp4.decode_scale(q.global_scale),
        out_dtype=torch.bfloat16 if out_bf16 else torch.float32,
        lib=_lib(build),
    )
    _check(y, nvfp4.dequantize(qa), nvfp4.dequantize(q))


@pytest.mark.parametrize("build", BUILDS)
@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), x_bf16=st.booleans(), out_bf16=st.booleans())
def test_bf16_linear_equals_fp64_matmul(build, shape, seed, x_bf16, out_bf16):
    m, n, k = shape
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k + 2 * (seed % 3), generator=g).bfloat16()  # K need only be even here
    x = torch.randn(m, w.shape[1], generator=g)
    x = x.bfloat16() if x_bf16 else x
    y = cpu_gemv.bf16_linear(x, w, out_dtype=torch.bfloat16 if out_bf16 else torch.float32, lib=_lib(build))
    _check(y, x.float(), w.float())


@pytest.mark.parametrize("build", BUILDS)
def test_nvfp4_linear_reads_the_modelopt_layout_exactly(build):
    """fp4.md's test vector 2 as one weight row: codes 10 32 54 76 98 BA DC FE, SF 0x40 (2.0), S_enc 1."""
    codes = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8)
    scale = torch.tensor([[0x40]], dtype=torch.uint8)
    x = torch.eye(16)
    y = cpu_gemv.nvfp4_linear(x, codes, scale, torch.tensor(1.0), lib=_lib(build))
    want = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, -0.0, -1, -2, -3, -4, -6, -8, -12])
    assert torch.equal(y[:, 0], want)
    qa = nvfp4.quantize(torch.eye(16), per_row_global=True)  # W4A4: unit activations pick the same row out
    y4 = cpu_gemv.w4a4_linear(
        qa.data, qa.scale, nvfp4.decode_scale(qa.global_scale), codes, scale, torch.tensor(1.0), lib=_lib(build)
    )
    torch.testing.assert_close(y4[:, 0], want, rtol=2**-22, atol=0)  # S_dec = fp32(1/2688) rounds


def test_the_baseline_build_is_the_portable_vector_code():
    lib = cpu_gemv.baseline_library()
    assert lib.gemv_isa().startswith("vec8") and lib.gemv_w4a4_isa() == lib.gemv_isa()


def test_bad_shapes_are_refused_with_what_is_allowed():
    codes, scale = torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        cpu_gemv.nvfp4_linear(torch.zeros(2, 32), codes, scale, torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_gemv.nvfp4_linear(torch.zeros(2, 14), torch.zeros(3, 7, dtype=torch.uint8), scale, torch.tensor(1.0))
    with pytest.raises(ValueError, match="w4a4_linear"):
        cpu_gemv.w4a4_linear(codes[:2, :4], scale[:2], torch.tensor(1.0), codes, scale, torch.tensor(1.0))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemv.bf16_linear(torch.zeros(2, 4), torch.zeros(3, 4))


def test_threads_split_rows_without_changing_results():
    g = torch.Generator().manual_seed(0)
    q = nvfp4.quantize(torch.randn(301, 912, generator=g))
    x = torch.randn(3, 912, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.nvfp4_linear(x, q.data, q.scale, nvfp4.decode_scale(q.global_scale))
        torch.set_num_threads(2)
        two = cpu_gemv.nvfp4_linear(x, q.data, q.scale, nvfp4.decode_scale(q.global_scale))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output row is one task's sum, whichever thread runs it
