"""The Triton quantize kernel's guidance option (TRITON_INTERPRET=1) against nvfp4.quantize and
mantissa_bits(unpack_fp4(codes)), bit for bit."""

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatron_trace.fp4 import guided_quantize, mantissa_bits_packed, unpack_mantissa_bits
from megatron_trace.kernels.dispatch import (
    nvfp4_quantize_with_guidance,
    nvfp4_quantize_with_guidance_reference,
    triton_available,
)

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not importlib.import_module("megatron_trace.kernels.nvfp4_quantize").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _check(x, mode, **kw):
    q, g = nvfp4_quantize_with_guidance(x, mode=mode, backend="triton", **kw)
    qr, gr = nvfp4_quantize_with_guidance_reference(x, mode=mode, **kw)
    assert torch.equal(q.data, qr.data) and torch.equal(q.scale, qr.scale)
    assert q.global_scale.shape == qr.global_scale.shape
    assert torch.equal(q.global_scale.view(torch.int32), qr.global_scale.view(torch.int32))
    assert g.dtype == torch.uint8 and g.shape == gr.shape and torch.equal(g, gr)
    return q, g


SCALES = [{}, {"per_row_global": True}, {"global_scale": torch.tensor(7.5)}, {"global_amax": 3.0}]


@pytest.mark.parametrize("mode", ["full", "mantissa"])
@pytest.mark.parametrize("kw", SCALES, ids=["tensor", "per_row", "static", "amax"])
@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (5, 272), (2, 3, 32)])
def test_bits_match_reference(shape, kw, mode):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    _check(x, mode, **kw)


def test_full_guidance_is_the_code_tensor_and_special_values():
    x = torch.randn(4, 64) * 10
    x[0, :16] = 0.0  # zero block
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = -0.0
    q, g = _check(x, "full")
    assert g is q.data
    _check(x, "mantissa", per_row_global=True)
    _check(x.bfloat16(), "mantissa")


def test_mantissa_guidance_reproduces_the_rollout_rounding():
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    q, bits = _check(x, "mantissa", per_row_global=True)
    assert torch.equal(unpack_mantissa_bits(bits), (q.codes() & 1))
    again = guided_quantize(x, q.scale, q.global_scale, mantissa=bits)
    assert torch.equal(again.data, q.data)


def test_bad_mode():
    with pytest.raises(ValueError):
        nvfp4_quantize_with_guidance(torch.randn(1, 16), mode="half", backend="triton")


def _rows():
    shapes = st.tuples(st.integers(1, 3), st.sampled_from((16, 32, 48)))
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=st.floats(width=32))).map(torch.from_numpy)


@settings(max_examples=25, deadline=None)
@given(_rows(), st.sampled_from(["full", "mantissa"]), st.booleans())
def test_hypothesis_any_floats(x, mode, per_row):
    # NaN, Inf, subnormals and signed zeros included; the packed bits also equal fp4's packer.
    q, g = _check(x, mode, per_row_global=per_row)
    if mode == "mantissa":
        assert torch.equal(g, mantissa_bits_packed(q.data))
