"""The compiled NVFP4 fast paths are the reference (`fp4.nvfp4`) bit for bit, or step aside."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import fast, nvfp4

pytestmark = pytest.mark.skipif(not fast.available(), reason="no C compiler here")


def _same(q, r):
    assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    assert torch.equal(q.global_scale, r.global_scale)


def _inputs(seed, rows, blocks, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * torch.logspace(-spread, spread, 16 * blocks)
    x[0, :16] = 0.0  # an all-zero block
    if rows > 1:
        x[1, 3] = -0.0
    return x


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), blocks=st.integers(1, 5), spread=st.sampled_from([0, 3, 12]),
       static=st.booleans(), bf16=st.booleans())
def test_quantize_dequantize_is_the_reference(seed, rows, blocks, spread, static, bf16):
    x = _inputs(seed, rows, blocks, spread)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = x.to(dtype)
    kw = dict(global_scale=torch.tensor(0.731)) if static else dict(per_row_global=True)
    q, xhat = fast.quantize_dequantize(x, dequant_dtype=dtype, **kw)
    r = nvfp4.quantize(x, **kw)
    _same(q, r)
    assert torch.equal(xhat, nvfp4.dequantize(r, dtype))


def test_nan_and_huge_inputs_fall_back_to_the_reference():
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    q, _ = fast.quantize_dequantize(x, per_row_global=True)
    _same(q, nvfp4.quantize(x, per_row_global=True))
    big = torch.full((1, 16), 3.0e38)
    _same(fast.quantize_dequantize(big, per_row_global=True)[0], nvfp4.quantize(big, per_row_global=True))


@pytest.mark.parametrize("gs", [1.0, 0.0625, 448.0 * 6.0])
def test_quantize_to_slots_writes_reference_codes_and_nothing_else(gs):
    x = _inputs(3, 5, 4, 3).reshape(5, 2, 32)
    codes, scales = torch.full((9, 2, 16), 0xAA, dtype=torch.uint8), torch.full((9, 2, 2), 0x55, dtype=torch.uint8)
    slots = torch.tensor([8, 0, 4, 2, 6])
    assert fast.quantize_to_slots(x, torch.tensor(gs), codes, scales, slots)
    r = nvfp4.quantize(x, global_scale=torch.tensor(gs))
    assert torch.equal(codes[slots], r.data) and torch.equal(scales[slots], r.scale)
    rest = torch.tensor([1, 3, 5, 7])
    assert (codes[rest] == 0xAA).all() and (scales[rest] == 0x55).all()


def test_quantize_to_slots_refuses_what_it_cannot_do():
    x, codes, scales = torch.randn(2, 32), torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(IndexError, match="slot out of range"):
        fast.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 4]))
    assert not codes.any()
    assert not fast.quantize_to_slots(x, torch.tensor(0.0), codes, scales, torch.tensor([0, 1]))  # unusable S_enc
    assert not fast.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 1], dtype=torch.int32))
    x[0, 0] = float("nan")
    assert not fast.quantize_to_slots(x, torch.tensor(1.0), codes, scales, torch.tensor([0, 1]))


def test_dequantize_rows_is_gather_then_dequantize():
    q = nvfp4.quantize(_inputs(4, 6, 2, 3).reshape(6, 1, 32), global_scale=torch.tensor(0.5))
    idx = torch.tensor([5, 0, 0, 3])
    want = nvfp4.dequantize(nvfp4.NVFP4Tensor(q.data[idx], q.scale[idx], q.global_scale), torch.bfloat16)
    assert torch.equal(fast.dequantize_rows(q.data, q.scale, idx, q.global_scale, torch.bfloat16), want)
