"""NVFP4 quantization: TE's sequence against the scalar reference, properties, edge cases, layouts."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from megatron_trace.fp4 import (
    e2m1_decode,
    from_modelopt,
    nvfp4,
    swizzle_scales,
    to_modelopt,
    to_modelopt_fused,
    unswizzle_scales,
)
from megatron_trace.fp4.guided import bracket_indices
from tests import fp4_scalar_ref as ref


def _matrix(max_rows=4, ks=(16, 32, 48), finite=True):
    vals = st.floats(-3e4, 3e4, width=32) if finite else st.floats(width=32)
    shapes = st.tuples(st.integers(1, max_rows), st.sampled_from(ks))
    return shapes.flatmap(lambda s: arrays(np.float32, s, elements=vals)).map(torch.from_numpy)


def _lognormal(shape, seed, sigma=3.0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(shape, generator=g) * sigma)
    return mag * torch.sign(torch.randn(shape, generator=g))


@settings(max_examples=60, deadline=None)
@given(_matrix(finite=False))
def test_matches_scalar_reference_per_tensor(x):
    q = nvfp4.quantize(x)
    amax = max([abs(float(v)) for v in x.flatten() if not np.isnan(v)] or [0.0])
    s_enc = ref.s_enc_from_amax(amax)
    assert q.global_scale.item() == s_enc
    for r in range(x.shape[0]):
        scales, codes = ref.nvfp4_row(x[r].tolist(), s_enc)
        assert q.scale[r].tolist() == scales
        assert q.codes()[r].tolist() == codes


@pytest.mark.parametrize("seed", range(4))
def test_matches_scalar_reference_per_row_wide_range(seed):
    x = _lognormal((6, 64), seed)
    q = nvfp4.quantize(x, per_row_global=True)
    assert q.global_scale.shape == (6,)
    for r in range(6):
        s_enc = ref.s_enc_from_amax(x[r].abs().max().item())
        assert q.global_scale[r].item() == s_enc
        scales, codes = ref.nvfp4_row(x[r].tolist(), s_enc)
        assert q.scale[r].tolist() == scales and q.codes()[r].tolist() == codes


@settings(max_examples=80, deadline=None)
@given(_matrix(), st.booleans())
def test_dequantize_within_half_grid_step(x, per_row):
    q = nvfp4.quantize(x, per_row_global=per_row)
    deq = nvfp4.dequantize(q)
    z = nvfp4.encode_with_scales(x, q.scale, q.global_scale).reshape(x.shape)
    lo, hi, _ = bracket_indices(z)
    signed = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])
    gap = signed[hi.long() + 7] - signed[lo.long() + 7]
    half = torch.where(z.abs() >= 6, torch.ones_like(gap), gap / 2)  # saturated: half of the 4..6 step
    unit = (nvfp4._blocks(torch.ones_like(x)) * ref_units(q)).reshape(x.shape)
    bound = half * unit + 1e-6 * x.abs() + 1e-30
    underflow = unit == 0  # block scale below E4M3's 2^-9: the whole block is tiny, dequantizes to 0
    assert torch.all((deq - x).abs()[~underflow] <= bound[~underflow])
    assert torch.all(deq[underflow] == 0)


def ref_units(q):
    s_dec = nvfp4.decode_scale(q.global_scale)
    s_dec = s_dec if s_dec.dim() == 0 else s_dec.reshape(*s_dec.shape, 1, 1)
    return (q.scale.view(torch.float8_e4m3fn).float().unsqueeze(-1)) * s_dec


def test_zero_tensor_and_underflowed_block():
    q = nvfp4.quantize(torch.zeros(2, 32))
    assert q.global_scale.item() == 1.0 and q.scale.eq(0).all() and q.data.eq(0).all()
    x = torch.zeros(32)
    x[0], x[16] = 1000.0, 1e-6  # second block's scale underflows to 0x00: enc = FLT_MAX
    q = nvfp4.quantize(x)
    assert q.scale.tolist()[1] == 0
    assert q.codes()[16].item() == 7  # saturated code, as TE's kernel writes it
    assert nvfp4.dequantize(q)[16:].eq(0).all()


def test_nan_and_inf_have_defined_results():
    x = torch.ones(16)
    x[1], x[2] = float("nan"), float("inf")
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == 1.0  # amax is Inf -> S_enc underflows to 0 -> 1
    assert q.scale.tolist() == [0x7E] and q.codes()[1].item() == 7 and q.codes()[2].item() == 7
    y = torch.ones(16)
    y[3] = float("nan")
    assert nvfp4.quantize(y).global_scale.item() == 2688.0  # NaN ignored by amax, like fmaxf


def test_shapes_dtypes_and_errors():
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, per_row_global=True)
    assert q.data.shape == (2, 3, 16) and q.scale.shape == (2, 3, 2) and q.global_scale.shape == (2, 3)
    assert torch.equal(nvfp4.quantize(x.float(), per_row_global=True).data, q.data)
    assert nvfp4.dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    empty = nvfp4.quantize(torch.empty(0, 16))
    assert empty.data.shape == (0, 8) and empty.global_scale.item() == 1.0
    with pytest.raises(ValueError, match="K=20 is not a multiple of 16"):
        nvfp4.quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match="0-d"):
        nvfp4.quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating"):
        nvfp4.quantize(torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="global_amax must have shape"):
        nvfp4.quantize(torch.randn(4, 16), global_amax=torch.ones(3))


def test_given_global_amax_is_used():
    x = torch.randn(4, 32)
    q = nvfp4.quantize(x, global_amax=100.0)
    assert q.global_scale.item() == torch.tensor(26.88, dtype=torch.float32).item()


@pytest.mark.parametrize("seed", range(3))
def test_four_over_six_is_standard_nvfp4_and_never_worse(seed):
    x = _lognormal((8, 64), seed, sigma=1.0)
    q46 = nvfp4.quantize(x, four_over_six=True)
    err46 = (nvfp4.dequantize(q46) - x).pow(2).reshape(8, 4, 16).sum(-1)
    # Compare against amax->6 under the same (4-over-6) global scale: per block it is the min.
    base = nvfp4.NVFP4Tensor(*_six_only(x, q46.global_scale))
    err6 = (nvfp4.dequantize(base) - x).pow(2).reshape(8, 4, 16).sum(-1)
    assert torch.all(err46 <= err6)
    # On Gaussian activations (no subnormal block scales) it beats the standard recipe overall.
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))

    def mse(q):
        return (nvfp4.dequantize(q) - g).pow(2).sum()

    assert mse(nvfp4.quantize(g, four_over_six=True)) < 0.9 * mse(nvfp4.quantize(g))


def _six_only(x, s_enc):
    sf = nvfp4._scales_for_blocks(nvfp4._blocks(x), s_enc, 6.0)
    from megatron_trace.fp4 import e2m1_encode, pack_fp4

    return pack_fp4(e2m1_encode(nvfp4.encode_with_scales(x, sf, s_enc)).reshape(x.shape)), sf, s_enc


def test_modelopt_tensors_roundtrip_and_fused_shards_share_scale():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 64, generator=g) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.5)))
    shards = to_modelopt_fused([q, k, v], input_amax=5.0)
    assert len({s["weight_scale_2"].item() for s in shards}) == 1
    assert shards[1]["weight_scale_2"].item() == pytest.approx(k.abs().max().item() / 2688, rel=1e-6)
    assert all(s["input_scale"].item() == pytest.approx(5.0 / 2688, rel=1e-6) for s in shards)
    one = to_modelopt(q)
    assert one["weight"].dtype == torch.uint8 and one["weight"].shape == (64, 32)
    assert one["weight_scale"].dtype == torch.float8_e4m3fn and one["weight_scale"].shape == (64, 4)
    assert "input_scale" not in one
    loaded = from_modelopt(one)
    assert torch.equal(nvfp4.dequantize(loaded), nvfp4.dequantize(nvfp4.quantize(q)))
    # A loader's formula: code * weight_scale * weight_scale_2 gives our values bit for bit.
    loader = (
        e2m1_decode(loaded.codes()).reshape(64, 4, 16)
        * one["weight_scale"].float().unsqueeze(-1)
        * one["weight_scale_2"]
    ).reshape(64, 64)
    assert torch.equal(loader, nvfp4.dequantize(nvfp4.quantize(q)))
    with pytest.raises(KeyError, match="weight_scale_2"):
        from_modelopt({"weight": one["weight"], "weight_scale": one["weight_scale"]})


@given(st.integers(1, 300), st.integers(1, 12), st.integers(0, 2))
@settings(max_examples=25, deadline=None)
def test_swizzle_roundtrip_and_offsets(m, kb, lead):
    s = torch.randint(0, 256, (*([2] * lead), m, kb), dtype=torch.uint8)
    sw = swizzle_scales(s)
    assert sw.shape[-2] % 128 == 0 and sw.shape[-1] % 4 == 0
    assert torch.equal(unswizzle_scales(sw, m, kb), s)
    row, col = m - 1, kb - 1
    kt = (kb + 3) // 4
    off = ((row // 128) * kt + col // 4) * 512 + (row % 32) * 16 + ((row // 32) % 4) * 4 + col % 4
    assert sw.reshape(*sw.shape[:-2], -1)[(..., off)].equal(s[..., row, col])


def test_explicit_global_scale_matches_amax_route():
    x = torch.randn(3, 32)
    via_amax = nvfp4.quantize(x, global_amax=7.5)
    direct = nvfp4.quantize(x, global_scale=via_amax.global_scale)
    assert torch.equal(direct.data, via_amax.data) and torch.equal(direct.scale, via_amax.scale)
    with pytest.raises(ValueError, match="not both"):
        nvfp4.quantize(x, global_amax=1.0, global_scale=1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4.quantize(x, global_scale=0.0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    nans=st.integers(0, 3),
    dim=st.sampled_from([None, -1, 0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_nan_free_amax_is_the_max_over_the_finite_and_inf_values(seed, nans, dim, dtype):
    """The max |x| with NaN left out, in x's dtype (exact there), whole or along a dim; an all-NaN
    row gives 0. (It reduces first and redoes only where the result is NaN.)"""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 48, generator=g) * 100).to(dtype)
    for i in range(nans):
        x[i, (7 * i) % 48] = float("nan")
    if nans == 3:
        x[4] = float("nan")
        x[3, 2] = -float("inf")
    want = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    want = want.amax() if dim is None else want.amax(dim=dim)
    got = nvfp4.nan_free_amax(x) if dim is None else nvfp4.nan_free_amax(x, dim=dim)
    assert got.dtype == dtype and torch.equal(got, want)
