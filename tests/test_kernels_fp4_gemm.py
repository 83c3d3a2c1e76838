"""The Triton FP4 GEMM (W4A16 and W4A4, under TRITON_INTERPRET=1) against F.linear on the
dequantized weights. Summation order differs, so results agree to fp32 accuracy: |err| <=
1e-5 * max|y| + 1e-5 * |y| (observed ~2e-7 relative)."""

import importlib

import pytest
import torch

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.kernels.dispatch import (
    fp4_linear,
    fp4_linear_reference,
    fp4_linear_w4a4,
    fp4_linear_w4a4_reference,
    triton_available,
)

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not importlib.import_module("megatron_trace.kernels.fp4_gemm").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 * float(want.abs().max().clamp_min(1e-30))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tol)


def _weight(n, k, seed, per_row=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q = nvfp4.quantize(w, per_row_global=per_row)
    return q


# (M, N, K): M=1 GEMV, K=16 (one block), N not a multiple of the 64-wide tile, K over two tiles.
SHAPES = [(1, 16, 16), (1, 70, 272), (3, 33, 48), (8, 64, 64), (17, 20, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w4a16_matches_reference(m, n, k, dtype):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
    w = _weight(n, k, n)
    bias = torch.randn(n)
    got = fp4_linear(x, w, bias, out_dtype=torch.float32, backend="triton")
    _close(got, fp4_linear_reference(x, w, bias, out_dtype=torch.float32))


def test_scalar_global_scale_split_k_and_leading_dims():
    x = torch.randn(2, 3, 96)
    w = _weight(40, 96, 1, per_row=False)  # 0-d S_enc
    for split in (1, 2, 3):
        got = fp4_linear(x, w, None, backend="triton", block_k=32, split_k=split)
        assert got.shape == (2, 3, 40)
        _close(got, fp4_linear_reference(x, w))


def test_zero_blocks_and_default_dtype():
    x = torch.randn(4, 64)
    x[:, :16] = 0.0
    wf = torch.randn(24, 64)
    wf[:, 16:48] = 0.0  # zero blocks: scale byte 0
    w = nvfp4.quantize(wf, per_row_global=True)
    got = fp4_linear(x.bfloat16(), w, backend="triton")
    assert got.dtype == torch.bfloat16
    want = fp4_linear_reference(x.bfloat16(), w, out_dtype=torch.float32)
    # Output rounded to bf16: within one bf16 ulp (the interpreter's fp32->bf16 cast truncates).
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)
    zero = fp4_linear(torch.zeros(1, 64), w, backend="triton")
    assert torch.equal(zero, torch.zeros(1, 24))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (5, 33, 272), (16, 48, 64)])
def test_w4a4_matches_reference(m, n, k, static):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 + m)) * 3
    x[0, :16] = 0.0
    w = _weight(n, k, k)
    gs = torch.tensor(50.0) if static else None
    bias = torch.randn(n)
    got = fp4_linear_w4a4(x, w, bias, input_global_scale=gs, backend="triton")
    _close(got, fp4_linear_w4a4_reference(x, w, bias, input_global_scale=gs))


def test_dispatch_auto_uses_reference_on_cpu_and_for_mxfp4():
    x = torch.randn(2, 32)
    w = _weight(8, 32, 0)
    assert torch.equal(fp4_linear(x, w), fp4_linear_reference(x, w))
    mw = mxfp4.quantize(torch.randn(8, 32))
    assert torch.equal(fp4_linear(x, mw), fp4_linear_reference(x, mw))
    with pytest.raises(TypeError):
        fp4_linear(x, mw, backend="triton")
    with pytest.raises(ValueError):
        fp4_linear(torch.randn(2, 48), w, backend="triton")
