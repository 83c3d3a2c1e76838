"""The Triton kernel's guided rounding (TRITON_INTERPRET=1) against fp4.guided_quantize, bit for bit:
full and mantissa guidance, scalar and per-row S_enc, any fp32 input (NaN, Inf, zeros, subnormals)."""

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatron_trace.fp4 import guided_quantize, mantissa_bits_packed, nvfp4
from megatron_trace.kernels.dispatch import nvfp4_guided_quantize, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's numpy on masked lanes
]


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not importlib.import_module("megatron_trace.kernels.nvfp4_quantize").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _check(x, q_roll, full):
    """Kernel and reference agree on every code byte; scales and S_enc are the rollout's."""
    kw = {"codes": q_roll.data} if full else {"mantissa": mantissa_bits_packed(q_roll.data)}
    got = nvfp4_guided_quantize(x, q_roll.scale, q_roll.global_scale, backend="triton", **kw)
    want = guided_quantize(x, q_roll.scale, q_roll.global_scale, **kw)
    assert got.data.dtype == torch.uint8 and got.data.shape == want.data.shape
    assert torch.equal(got.data, want.data), f"codes differ at {(got.data != want.data).nonzero()[:8].tolist()}"
    assert torch.equal(got.scale, want.scale) and torch.equal(got.global_scale, want.global_scale)
    return got


@pytest.mark.parametrize("full", [True, False], ids=["full", "mantissa"])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (5, 272), (33, 64), (2, 3, 32)])
def test_trainer_recompute_matches_reference(shape, per_row, full):
    g = torch.Generator().manual_seed(sum(shape))
    x_roll = torch.randn(shape, generator=g) * 3
    x_train = x_roll + 0.05 * torch.randn(shape, generator=g)  # the trainer's slightly different value
    q_roll = nvfp4.quantize(x_roll, per_row_global=per_row)
    got = _check(x_train, q_roll, full)
    # The guidance moves codes (the two inputs differ), so the test is not RTN's identity.
    assert not torch.equal(got.data, nvfp4.quantize(x_train, global_scale=q_roll.global_scale).data)


@pytest.mark.parametrize("full", [True, False], ids=["full", "mantissa"])
def test_specials_and_bf16(full):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 10
    x[0, :16] = 0.0
    x[1, 3], x[1, 4], x[2, 5], x[3, :] = float("nan"), float("-inf"), float("inf"), -0.0
    q_roll = nvfp4.quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(2)), per_row_global=True)
    _check(x, q_roll, full)
    _check(x.bfloat16(), q_roll, full)


def _rows():
    shapes = st.tuples(st.integers(1, 3), st.sampled_from((16, 32, 48)))
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=st.floats(width=32))).map(torch.from_numpy)


@settings(max_examples=30, deadline=None)
@given(_rows(), st.integers(0, 2**16), st.booleans(), st.booleans())
def test_hypothesis_any_floats(x, seed, per_row, full):
    # The rollout's own value: x perturbed, so its scales and codes are near but not x's.
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    x_roll = torch.nan_to_num(x, nan=0.0, posinf=1e30, neginf=-1e30) * (1 + 0.01 * noise)
    _check(x, nvfp4.quantize(x_roll, per_row_global=per_row), full)


def test_checks_are_the_reference_checks():
    x = torch.randn(2, 32)
    q = nvfp4.quantize(x)
    with pytest.raises(ValueError, match="exactly one"):
        nvfp4_guided_quantize(x, q.scale, q.global_scale, backend="triton")
    with pytest.raises(ValueError, match="codes has shape"):
        nvfp4_guided_quantize(x, q.scale, q.global_scale, codes=q.data[:1], backend="triton")
