"""The Triton NVFP4 kernel (under TRITON_INTERPRET=1) against the torch reference, bit for bit.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton, so the kernel runs
on CPU tensors here. Shapes stay small: the interpreter runs each program in numpy.
"""

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import dispatch
from megatron_trace.kernels.dispatch import nvfp4_quantize, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    # Masked lanes and zero-scale blocks divide by zero in the interpreter's numpy.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernel_module():
    # By import path: `megatron_trace.kernels.nvfp4_quantize` is the submodule, never the dispatcher function.
    return importlib.import_module("megatron_trace.kernels.nvfp4_quantize")


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not triton_available():
        pytest.skip("triton is not importable")
    if not _kernel_module().INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _check(x, **kw):
    """Kernel and reference agree on every byte and on S_enc (value, dtype, shape)."""
    got = nvfp4_quantize(x, backend="triton", **kw)
    want = nvfp4.quantize(x.contiguous(), **kw)
    assert got.scale.dtype == torch.uint8 and got.data.dtype == torch.uint8
    assert got.scale.shape == want.scale.shape and torch.equal(got.scale, want.scale), (
        f"scale bytes differ at {(got.scale != want.scale).nonzero()[:8].tolist()}"
    )
    assert got.data.shape == want.data.shape and torch.equal(got.data, want.data), (
        f"data bytes differ at {(got.data != want.data).nonzero()[:8].tolist()}"
    )
    g, w = got.global_scale, want.global_scale
    assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape
    assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    return got


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# (M, K): K=272 spans two 256-wide tiles with a partial one; M=33 leaves a partial row block.
SHAPES = [(1, 16), (3, 48), (5, 272), (33, 64)]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_normal(shape, per_row):
    _check(torch.randn(shape, generator=_gen(sum(shape))), per_row_global=per_row)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_lognormal_wide_range(seed, per_row):
    # sigma=4 spans ~30 decades: saturated, ordinary and underflowing (0x00) block scales.
    g = _gen(seed)
    x = torch.exp(torch.randn(12, 96, generator=g) * 4.0) * torch.sign(torch.randn(12, 96, generator=g))
    _check(x, per_row_global=per_row)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("per_row", [False, True])
def test_input_dtypes(dtype, per_row):
    x = (torch.randn(7, 80, generator=_gen(1)) * 50).to(dtype)
    _check(x, per_row_global=per_row)


def test_bf16_with_inf_and_nan():
    # Inf rows/tensors: S_enc underflows to 0 and falls back to 1; NaN is ignored by amax.
    x = torch.randn(4, 32, generator=_gen(2)).to(torch.bfloat16)
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    _check(x)
    _check(x, per_row_global=True)


@pytest.mark.parametrize("amax", [1.0, 0.01, 1e6, 448.0, 0.0, -3.0, float("inf"), float("nan"), 1e-40, 3e38])
def test_given_scalar_global_amax(amax):
    # Below-the-data amax saturates E4M3 at 448 and E2M1 at 6; the rest hit S_enc's special cases.
    x = torch.randn(6, 48, generator=_gen(3)) * 4
    _check(x, global_amax=amax)
    _check(x, global_amax=torch.tensor(amax))


def test_given_per_row_global_amax():
    x = torch.randn(2, 3, 32, generator=_gen(4))
    amax = torch.tensor([[1.0, 0.0, 5.0], [float("nan"), 1e-3, 2688.0]])
    _check(x, global_amax=amax, per_row_global=True)


@pytest.mark.parametrize("per_row", [False, True])
def test_leading_batch_dims(per_row):
    q = _check(torch.randn(2, 3, 5, 32, generator=_gen(5)), per_row_global=per_row)
    assert q.data.shape == (2, 3, 5, 16) and q.scale.shape == (2, 3, 5, 2)
    assert q.global_scale.shape == ((2, 3, 5) if per_row else ())


def test_one_dim_and_non_contiguous():
    _check(torch.randn(64, generator=_gen(6)))
    _check(torch.randn(64, generator=_gen(6)), per_row_global=True)
    _check(torch.randn(32, 48, generator=_gen(7)).t())  # [48, 32], row stride 1
    _check(torch.randn(8, 64, generator=_gen(8))[:, ::2])  # last-dim stride 2


@pytest.mark.parametrize("per_row", [False, True])
def test_specials(per_row):
    x = torch.randn(6, 32, generator=_gen(9))
    x[0] = 0.0  # all-zero row: S_enc 1 per row, scale 0x00
    x[1, :16] = -0.0  # -0 -> code 8
    x[2, 0], x[2, 17] = float("nan"), float("inf")
    x[3, 4], x[3, 20] = float("-inf"), -0.0
    x[4] = float("nan")  # all-NaN row: amax 0
    x[5, 1::2] = float("inf")
    q = _check(x, per_row_global=per_row)
    assert (q.codes()[1, :16] == 8).all()


def test_all_zero_and_all_nan_tensors():
    for fill in (0.0, -0.0, float("nan"), float("inf")):
        for per_row in (False, True):
            _check(torch.full((3, 32), fill), per_row_global=per_row)


def test_e2m1_midpoints_round_to_even_codes():
    # global_amax 2688 -> S_enc 1 and block amax 6 -> SF 1.0, so x * enc is x itself.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = torch.tensor(mids + [-m for m in mids] + [6.0, -6.0], dtype=torch.float32)
    q = _check(row[None], global_amax=2688.0)
    assert q.scale[0, 0].item() == 0x38 and q.global_scale.item() == 1.0
    want = [0, 2, 2, 4, 4, 6, 6] + [8, 10, 10, 12, 12, 14, 14] + [7, 15]
    assert q.codes()[0].tolist() == want
    # Just above/below each midpoint rounds away from the tie.
    up = torch.nextafter(row, torch.full_like(row, 100.0))
    down = torch.nextafter(row, torch.zeros_like(row))
    _check(torch.stack([up, down]), global_amax=2688.0)


def test_e4m3_ties_and_saturation():
    # global_amax 448 -> S_enc 6 and S_enc*fp32(1/6) == 1, so each block's SF input is its amax.
    amaxes = [
        1.0625,
        1.1875,
        17.0,
        19.0,
        432.0,
        440.0,
        447.9,
        448.0,
        464.0,
        1e30,
        float("inf"),
        2.0**-10,
        3 * 2.0**-10,
        5 * 2.0**-10,
        7.5 * 2.0**-9,
        2.0**-6,
        1e-30,
        0.0,
    ]
    x = torch.zeros(len(amaxes), 32)
    for i, a in enumerate(amaxes):
        x[i, 0] = a
        x[i, 1:16] = torch.linspace(-a if a < 1e38 else -1e38, 0, 15) * 0.5
        x[i, 16:] = torch.randn(16, generator=_gen(i)) * 0.1
    q = _check(x, global_amax=448.0)
    # Spot checks: ties to even in normal and subnormal range, and satfinite.
    assert q.scale[0:4, 0].tolist() == [0x38, 0x3A, 0x58, 0x5A]
    assert q.scale[4:9, 0].tolist() == [0x7E] * 5  # 432 ties up to 448 (even); >= 448 saturates
    assert q.scale[9:11, 0].tolist() == [0x7E, 0x7E]
    assert q.scale[11:16, 0].tolist() == [0x00, 0x02, 0x02, 0x08, 0x08]


def test_underflowing_block_scale_uses_flt_max():
    # Tiny blocks next to a large amax get SF 0x00, enc = FLT_MAX, and saturate to +-6.
    x = torch.randn(4, 64, generator=_gen(10)) * 1e-7
    x[0, 0] = 1e4
    x[1, 16:32] = 0.0
    q = _check(x)
    assert (q.scale[1:] == 0).all()
    _check(x, per_row_global=True)


def test_subnormal_inputs():
    x = torch.randn(4, 32, generator=_gen(11)) * 1e-39  # fp32 subnormals; S_enc hits FLT_MAX
    x[0, 0] = 1e-45
    x[3] = torch.randn(32, generator=_gen(12)) * 1e-36
    _check(x)
    _check(x, per_row_global=True)


def test_empty_tensors():
    for shape in [(0, 32), (3, 0), (2, 0, 16)]:
        for per_row in (False, True):
            _check(torch.zeros(shape), per_row_global=per_row)


def _rows(finite):
    vals = st.floats(-1e6, 1e6, width=32) if finite else st.floats(width=32)
    shapes = st.tuples(st.integers(1, 3), st.sampled_from((16, 32, 48)))
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=vals)).map(torch.from_numpy)


@settings(max_examples=30, deadline=None)
@given(_rows(finite=False), st.booleans(), st.none() | st.floats(width=32))
def test_hypothesis_any_floats(x, per_row, amax):
    if per_row and amax is not None:
        amax = torch.full(x.shape[:-1], amax)
    _check(x, per_row_global=per_row, global_amax=amax)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("tiles_per_prog", [1, 2])
def test_other_launch_shapes(monkeypatch, per_row, tiles_per_prog):
    # The defaults leave some paths unused at test sizes: several rows per fused program,
    # several K tiles per non-fused program, partial row blocks in the fused mode.
    def small(m, k, fused):
        tiles = -(-k // 32)
        if fused:
            return 4, 32, 1, tiles
        return 2, 32, -(-tiles // tiles_per_prog), tiles_per_prog

    monkeypatch.setattr(_kernel_module(), "_launch_shape", small)
    x = torch.exp(torch.randn(7, 144, generator=_gen(15)) * 3.0)
    x[1, 5], x[6, 100] = float("nan"), float("-inf")
    _check(x, per_row_global=per_row)


# ---- dispatcher ----


def test_auto_on_cpu_uses_reference(monkeypatch):
    mod = _kernel_module()

    def boom(*a, **k):
        raise AssertionError("auto must not run the kernel for CPU tensors")

    monkeypatch.setattr(mod, "quantize_triton", boom)
    x = torch.randn(4, 32, generator=_gen(13))
    got, want = nvfp4_quantize(x), nvfp4.quantize(x)
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    got = nvfp4_quantize(x, backend="reference", per_row_global=True)
    assert torch.equal(got.scale, nvfp4.quantize(x, per_row_global=True).scale)


def test_bad_backend():
    with pytest.raises(ValueError, match="'auto', 'triton', 'reference'"):
        nvfp4_quantize(torch.zeros(2, 16), backend="cuda")


@pytest.mark.parametrize("backend", ["triton", "reference", "auto"])
def test_k_not_multiple_of_16(backend):
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.zeros(2, 24), backend=backend)


def test_non_float_input_rejected():
    with pytest.raises(TypeError, match="floating"):
        nvfp4_quantize(torch.zeros(2, 16, dtype=torch.int32), backend="triton")


def test_global_amax_shape_checked():
    with pytest.raises(ValueError, match="one per row"):
        nvfp4_quantize(torch.zeros(2, 16), global_amax=1.0, per_row_global=True, backend="triton")


def test_four_over_six():
    x = torch.randn(3, 32, generator=_gen(14))
    got = nvfp4_quantize(x, four_over_six=True)
    assert torch.equal(got.data, nvfp4.quantize(x, four_over_six=True).data)
    with pytest.raises(ValueError, match="four_over_six"):
        nvfp4_quantize(x, four_over_six=True, backend="triton")


def test_triton_on_cpu_without_interpreter_errors(monkeypatch):
    mod = _kernel_module()
    monkeypatch.setattr(mod, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        nvfp4_quantize(torch.zeros(2, 16), backend="triton")


def test_package_imports_without_triton():
    # Importing the dispatcher must not import triton; and on a CPU install without triton,
    # importing kernels must not need it and auto falls back (one interpreter for both checks).
    code = (
        "import sys, megatron_trace.kernels.dispatch\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "sys.modules['triton'] = None\n"
        "import torch, megatron_trace.kernels\n"
        "from megatron_trace.kernels.dispatch import nvfp4_quantize, triton_available\n"
        "assert not triton_available()\n"
        "nvfp4_quantize(torch.ones(2, 16))\n"
        "try:\n"
        "    nvfp4_quantize(torch.ones(2, 16), backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'not importable' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('backend=triton without triton did not raise')\n"
        "assert 'megatron_trace.kernels.nvfp4_quantize' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert dispatch.BACKENDS == ("auto", "triton", "reference")


@pytest.mark.parametrize("per_row", [False, True])
def test_given_global_scale_matches_reference(per_row):
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(7)) * 3
    gs = torch.rand(5) * 50 + 1 if per_row else torch.tensor(37.5)
    ref = nvfp4.quantize(x, global_scale=gs)
    got = nvfp4_quantize(x, global_scale=gs, backend="triton")
    assert torch.equal(got.data, ref.data) and torch.equal(got.scale, ref.scale)
    assert torch.equal(got.global_scale, ref.global_scale)
