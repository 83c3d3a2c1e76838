"""FP8 E4M3 rows with a per-row fp32 scale (the FP8 KV format) against the scalar reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace import fp4
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


# -- TRACE guidance of FP8 sites -----------------------------------------------------------------
_GRID = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448 ascending


def _value_index(codes: torch.Tensor) -> torch.Tensor:
    """Signed grid position of E4M3FN bytes (both zeros 0), computed from the decoded values."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448 ascending
    v = codes.view(torch.float8_e4m3fn).float()
    pos = torch.searchsorted(grid, v.abs())
    return torch.where(v < 0, -pos, pos)


def _bracket(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed grid positions of the E4M3 values just below and above z (clipped to +-448)."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    signed = torch.cat([-grid.flip(0)[:-1], grid])  # -448 .. 448, zero once, index 126 is 0
    zc = z.clamp(-448, 448)
    hi = torch.searchsorted(signed, zc) - 126
    lo = torch.searchsorted(signed, zc, right=True) - 1 - 126
    return lo, hi


rows_of_32 = st.lists(st.floats(-500, 500, width=32), min_size=32, max_size=32)


@settings(max_examples=150, deadline=None)
@given(st.lists(rows_of_32, min_size=1, max_size=4), st.floats(1e-4, 3e-2), st.integers(0, 2**31 - 1))
def test_guided_fp8_pins_a_nearby_trainer_to_the_rollout_codes(rows, rel, seed):
    """The rollout quantizes x; the trainer sees x perturbed. Full guidance gives the rollout's bytes
    wherever they bracket the trainer's value (and is never further from them than round-to-nearest);
    mantissa guidance gives them wherever the two sides are within one codeword."""
    x = torch.tensor(rows, dtype=torch.float32).view(-1, 2, 16)
    rollout = fp8.quantize(x, dims=2)
    g = torch.Generator().manual_seed(seed)
    y = x * (1 + rel * torch.randn(x.shape, generator=g))
    rtn = fp8.quantize(y, dims=2, amax=x.abs().reshape(x.shape[0], -1).amax(-1))  # the rollout's scale
    full = fp8.guided_quantize(y, rollout.encode, codes=rollout.data)
    mant = fp8.guided_quantize(y, rollout.encode, mantissa=fp4.mantissa_bits(rollout.data))
    r, t = _value_index(rollout.data), _value_index(rtn.data)
    d_full, d_rtn = (_value_index(full.data) - r).abs(), (t - r).abs()
    assert bool((d_full <= d_rtn).all())
    lo, hi = _bracket(y * rollout.encode[:, None, None])
    brackets = (r == lo) | (r == hi)  # the rollout's codeword is one of the two around the trainer's value
    assert bool(brackets.float().mean() > 0.5)  # the property below is about most elements, not a few
    assert bool((d_full[brackets] == 0).all())
    assert bool((_value_index(mant.data)[brackets] == r[brackets]).all())
    assert torch.equal(full.scale, rollout.scale) and torch.equal(full.encode, rollout.encode)


@settings(max_examples=100, deadline=None)
@given(st.lists(rows_of_32, min_size=1, max_size=4), st.floats(1e-4, 1e-2), st.integers(0, 2**31 - 1))
def test_guided_fp8_full_codes_reach_through_noise_sized_by_the_row(rows, sigma, seed):
    """A bf16 rollout and an fp32 trainer differ by noise sized by the row (matmul sums), not by each
    element: near zero that is several E4M3 codewords. Full guidance takes the rollout's byte wherever
    its value lies within GUIDE_REACH of the trainer's scaled value, else the bracket end nearer it;
    the result is never further from the trainer's value than GUIDE_REACH or its own bracket."""
    x = torch.tensor(rows, dtype=torch.float32).view(-1, 2, 16)
    rollout = fp8.quantize(x, dims=2)
    amax = x.abs().reshape(x.shape[0], -1).amax(-1).clamp_min(1e-6)
    g = torch.Generator().manual_seed(seed)
    y = x + sigma * amax[:, None, None] * torch.randn(x.shape, generator=g)
    full = fp8.guided_quantize(y, rollout.encode, codes=rollout.data)
    z = (y * rollout.encode[:, None, None]).clamp(-448, 448)
    reach = (fp8.e4m3_decode(rollout.data) - z).abs() <= fp8.GUIDE_REACH
    assert torch.equal(full.data[reach], rollout.data[reach])
    lo, hi = _bracket(z)
    signed = torch.cat([-_GRID.flip(0)[:-1], _GRID])
    width = signed[hi + 126] - signed[lo + 126]
    moved = (fp8.e4m3_decode(full.data) - z).abs()
    assert bool((moved <= torch.maximum(width, torch.full_like(width, fp8.GUIDE_REACH))).all())
    r, f = _value_index(rollout.data), _value_index(full.data)
    assert bool(((f == r) | (f == lo) | (f == hi)).all())


def test_guided_fp8_full_codes_agree_where_one_bracket_does_not():
    """At a bf16-vs-fp32-sized gap (0.3% of the row's amax) a few percent of elements lie more than
    one codeword from the rollout's; the reach brings every one of them back (the real Qwen's FP8 K:
    ~5% beyond the bracket, none beyond the reach; docs/quality.md)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, 64, generator=g) * torch.rand(512, 1, 1, generator=g) * 10
    rollout = fp8.quantize(x, dims=2)
    amax = x.abs().reshape(512, -1).amax(-1)
    y = x + 0.003 * amax[:, None, None] * torch.randn(x.shape, generator=g)
    z = y * rollout.encode[:, None, None]
    lo, hi = _bracket(z)
    r = _value_index(rollout.data)
    beyond = (r != lo) & (r != hi)
    assert 0.01 < float(beyond.float().mean()) < 0.5
    full = fp8.guided_quantize(y, rollout.encode, codes=rollout.data)
    assert float((full.data == rollout.data).float().mean()) > 0.999


def test_guided_fp8_of_the_rollout_own_values_is_its_bytes_and_keeps_zero_signs_and_nan():
    x = torch.tensor([[0.0, -0.0, 1e-12, -1e-12, 448.0, -1000.0, float("nan"), 3.0]])
    q = fp8.quantize(x, amax=torch.tensor([448.0]))
    for kw in ({"codes": q.data}, {"mantissa": fp4.mantissa_bits(q.data)}):
        out = fp8.guided_quantize(x, q.encode, **kw).data
        assert out[0, 6].item() == 0x7F
        same = _value_index(out) == _value_index(q.data)
        assert bool(same[0, [0, 1, 2, 3, 4, 5, 7]].all())
    assert torch.equal(fp8.guided_quantize(x, q.encode, codes=q.data).data, q.data)


def test_guided_fp8_rejects_bad_guidance():
    x = torch.ones(3, 16)
    q = fp8.quantize(x)
    with pytest.raises(ValueError, match="exactly one"):
        fp8.guided_quantize(x, q.encode)
    with pytest.raises(ValueError, match="must be uint8"):
        fp8.guided_quantize(x, q.encode, codes=q.data[:, :8])
    with pytest.raises(ValueError, match="one per row"):
        fp8.guided_quantize(x, q.encode[:2], codes=q.data)
