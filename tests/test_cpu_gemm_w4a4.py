"""kernels/cpu_gemm_w4a4.c, the W4A4 panel GEMM of batches wider than decode's row tiles.

Its sums against the fp64 reference are covered by test_cpu_gemv's W4A4 property (rows up to 40);
here what the GEMM adds: the AVX-512 build gives the scalar build's bits, and a row's output does
not depend on how many rows share the call, where it sits among them, or the thread count.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_gemv
from megatron_trace.fp4 import nvfp4

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv not built: {cpu_gemv.unavailable_reason()}")
GEMM_ROWS = cpu_gemv.W4A4_GEMV_MAX_ROWS + 1  # the fewest rows that take the GEMM


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8
    return nvfp4.quantize(x, per_row_global=True), nvfp4.quantize(w), torch.randn(n, generator=g)


def _run(qa, qw, bias, lib=None, out_dtype=torch.float32):
    return cpu_gemv.w4a4_linear(
        qa.data,
        qa.scale,
        nvfp4.decode_scale(qa.global_scale),
        qw.data,
        qw.scale,
        nvfp4.decode_scale(qw.global_scale),
        bias,
        out_dtype=out_dtype,
        lib=lib,
    )


def _rows(q: nvfp4.NVFP4Tensor, idx: torch.Tensor) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(q.data[idx], q.scale[idx], q.global_scale.reshape(-1)[idx])


@pytest.mark.skipif(not cpu_gemv.w4a4_gemm_vectorized(), reason=f"no AVX-512 VNNI GEMM in this build: {cpu_gemv.isa()}")
@settings(max_examples=12, deadline=None)
@given(
    shape=st.tuples(st.integers(GEMM_ROWS, 70), st.integers(1, 130), st.integers(1, 40).map(lambda b: 16 * b)),
    seed=st.integers(0, 2**31 - 1),
    out_bf16=st.booleans(),
)
def test_the_vectorized_gemm_gives_the_scalar_builds_bits(shape, seed, out_bf16):
    """Panels cut at 48 rows, tails of 16-row lanes, fewer than 4 blocks (K < 64): same bits."""
    qa, qw, bias = _operands(*shape, seed)
    dtype = torch.bfloat16 if out_bf16 else torch.float32
    native = _run(qa, qw, bias, out_dtype=dtype)
    assert torch.equal(native, _run(qa, qw, bias, lib=cpu_gemv.portable_library(), out_dtype=dtype))


@settings(max_examples=8, deadline=None)
@given(m=st.integers(GEMM_ROWS, 60), seed=st.integers(0, 2**31 - 1))
def test_a_rows_result_does_not_depend_on_its_batch(m, seed):
    """The same activation row alone (padded to GEMM width with copies), first or last of a batch:
    the same output bits, so a prefilled token and a batch-decoded one agree exactly."""
    qa, qw, bias = _operands(m, 97, 320, seed)
    full = _run(qa, qw, bias)
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(_run(_rows(qa, perm), qw, bias), full[perm])
    for i in (0, m - 1):
        alone = _run(_rows(qa, torch.full((GEMM_ROWS,), i)), qw, bias)
        assert torch.equal(alone[0], full[i])


def test_threads_split_panels_without_changing_results():
    qa, qw, bias = _operands(37, 1000, 896, 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(qa, qw, bias, out_dtype=torch.bfloat16)
        torch.set_num_threads(2)
        two = _run(qa, qw, bias, out_dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_build_says_which_gemm_runs():
    assert "w4a4-gemm:" in cpu_gemv.isa()
    assert cpu_gemv.portable_library().gemm_w4a4_isa() == "scalar"
    assert not cpu_gemv.w4a4_gemm_vectorized(cpu_gemv.portable_library())
