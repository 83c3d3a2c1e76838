"""Guided MXFP4 rounding (fp4.guided_quantize_mxfp4) against mxfp4.quantize, the rollout's quantizer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import e2m1_decode, e2m1_encode, guided_quantize_mxfp4, mantissa_bits, mxfp4

params = st.tuples(
    st.integers(0, 10**6),
    st.integers(1, 4),
    st.sampled_from([(32, 32), (64, 32), (32, 16), (48, 16)]),
    st.sampled_from([1e-3, 1e-2, 5e-2, 0.2]),
    st.sampled_from(mxfp4.RULES),
)


def _pair(seed, rows, kb, noise, rule):
    """A rollout activation quantized by the rollout, and the trainer's noisy recomputation."""
    k, block = kb
    g = torch.Generator().manual_seed(seed)
    x_roll = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x_train = x_roll * (1 + noise * torch.randn(rows, k, generator=g))
    return x_roll, x_train, mxfp4.quantize(x_roll, rule=rule, block=block), block


def _z(x, q):
    """x scaled by q's E8M0 block scales: the value the rollout's quantizer rounds."""
    xb = x.reshape(*x.shape[:-1], -1, q.block)
    return torch.ldexp(xb, -(q.scale.to(torch.int32) - 127).unsqueeze(-1)).reshape(x.shape)


@settings(max_examples=60, deadline=None)
@given(params)
def test_identical_input_reproduces_the_rollouts_codes_in_both_modes(p):
    x_roll, _, q, block = _pair(*p)
    full = guided_quantize_mxfp4(x_roll, q.scale, codes=q.data, block=block)
    assert torch.equal(full.data, q.data) and torch.equal(full.scale, q.scale)
    bits = guided_quantize_mxfp4(x_roll, q.scale, mantissa=mantissa_bits(q.codes()), block=block)
    # one bit cannot name a zero's sign; every other code is the rollout's
    assert torch.equal(e2m1_decode(bits.codes()), e2m1_decode(q.codes()))


SIGNED = torch.tensor([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])


@settings(max_examples=60, deadline=None)
@given(params)
def test_full_guidance_never_widens_the_gap_and_closes_it_within_one_codeword(p):
    _, x_train, q, block = _pair(*p)
    z = _z(x_train, q)
    rtn = e2m1_decode(e2m1_encode(z))
    guided = e2m1_decode(guided_quantize_mxfp4(x_train, q.scale, codes=q.data, block=block).codes())
    ref = e2m1_decode(q.codes())
    assert torch.all((guided - ref).abs() <= (rtn - ref).abs())
    # z between the rollout codeword's two neighbours: the rollout's codeword (as for NVFP4, a z
    # past +-6 is clipped to 6 and is not "within" when the rollout's codeword is 4)
    idx = torch.searchsorted(SIGNED, ref.contiguous())
    below, above = SIGNED[(idx - 1).clamp(min=0)], SIGNED[(idx + 1).clamp(max=len(SIGNED) - 1)]
    within = (z >= below) & (z <= above)
    assert torch.equal(guided[within], ref[within])


def test_guided_mxfp4_keeps_the_rollouts_scales_and_checks_shapes():
    g0 = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g0)
    q = mxfp4.quantize(x)
    g = guided_quantize_mxfp4(x * (1 + 0.05 * torch.randn(3, 64, generator=g0)), q.scale, codes=q.data)
    assert isinstance(g, mxfp4.MXFP4Tensor) and g.block == 32 and torch.equal(g.scale, q.scale)
    assert torch.equal(mxfp4.dequantize(g), mxfp4.dequantize(q))  # 5% noise: one codeword at most here
    with pytest.raises(ValueError, match="scale has shape"):
        guided_quantize_mxfp4(x, q.scale[:, :1], codes=q.data)
    with pytest.raises(ValueError, match="exactly one of codes"):
        guided_quantize_mxfp4(x, q.scale)
    with pytest.raises(ValueError, match="MXFP4 blocks are 32"):
        guided_quantize_mxfp4(torch.randn(3, 48), q.scale, codes=q.data)
