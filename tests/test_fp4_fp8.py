"""FP8 E4M3 rows with a per-row fp32 scale (the FP8 KV format) against the scalar reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import fp8
from tests import fp4_scalar_ref as ref

finite = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(finite, min_size=4, max_size=4), min_size=1, max_size=6))
def test_rows_match_scalar_reference(rows):
    q = fp8.quantize(torch.tensor(rows, dtype=torch.float32))
    for r, row in enumerate(rows):
        codes, s_dec = ref.fp8_row(row)
        assert q.data[r].tolist() == codes
        assert q.scale[r].item() == s_dec
    want = [
        [ref.e4m3_value(c) * np.float32(s) for c in ref.fp8_row(row)[0]]
        for row, s in ((row, ref.fp8_row(row)[1]) for row in rows)
    ]
    assert fp8.dequantize(q).tolist() == np.array(want, dtype=np.float32).tolist()


def test_row_amax_maps_to_448_and_outliers_stay_in_their_row():
    x = torch.tensor([[216.0, 1.0, -0.5, 0.0], [0.3, -0.2, 0.1, 0.0]])
    q = fp8.quantize(x)
    assert q.data[0, 0].item() == 0x7E and q.data[1, 0].item() == 0x7E  # 448 = 0x7E
    assert q.scale.tolist() == [
        np.float32(1 / np.float64(np.float32(448 / np.float32(216.0)))),
        np.float32(1 / np.float64(np.float32(448 / np.float32(0.3)))),
    ]
    rel = (fp8.dequantize(q) - x).abs() / x.abs().clamp_min(1e-30)
    assert rel[x != 0].max() <= 2.0**-4  # 3 mantissa bits: half an ulp of relative error


def test_special_rows():
    q = fp8.quantize(torch.tensor([[0.0, -0.0], [math.inf, 1.0], [math.nan, 2.0]]))
    assert q.scale.tolist() == [1.0, 1.0, np.float32(1 / np.float64(np.float32(224.0)))]
    assert q.data[0].tolist() == [0x00, 0x80] and q.data[1].tolist() == [0x7E, 0x38]
    assert q.data[2, 0].item() == 0x7F and q.data[2, 1].item() == 0x7E


def test_zero_dim_is_an_error():
    with pytest.raises(ValueError, match="needs at least that many; got a 0-d tensor"):
        fp8.quantize(torch.tensor(1.0))


@settings(max_examples=50, deadline=None)
@given(st.lists(finite, min_size=12, max_size=12))
def test_two_dim_rows_are_flattened_rows(xs):
    """dims=2 (the KV cache: one scale per token over its heads) is the 1-d rule on the flattened row;
    a given amax (TP's MAX over ranks) replaces the row's own."""
    x = torch.tensor(xs, dtype=torch.float32).reshape(2, 3, 2)
    q, flat = fp8.quantize(x, dims=2), fp8.quantize(x.reshape(2, 6))
    assert torch.equal(q.data.reshape(2, 6), flat.data) and torch.equal(q.scale, flat.scale)
    assert torch.equal(fp8.dequantize(q).reshape(2, 6), fp8.dequantize(flat))
    amax = x.abs().reshape(2, -1).amax(-1) * 2
    assert torch.equal(fp8.quantize(x, dims=2, amax=amax).scale, fp8.decode_scale(fp8.encode_scale(amax)))
