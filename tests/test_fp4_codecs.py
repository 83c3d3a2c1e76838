"""Codecs against an independent scalar reference, exhaustively where the space is small."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_encode,
    pack_fp4,
    unpack_fp4,
)
from tests import fp4_scalar_ref as ref

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _around(points, n=6):
    """Each point and its n float32 neighbours on both sides: where rounding decisions live."""
    out = []
    for p in points:
        v = np.float32(p)
        lo = hi = v
        out.append(v)
        for _ in range(n):
            lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
            out += [lo, hi]
    return out


def test_e2m1_matches_reference_at_every_decision_point():
    mids = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7]
    xs = _around(mids + [-m for m in mids])
    got = e2m1_encode(torch.tensor(np.array(xs, dtype=np.float32))).tolist()
    assert got == [ref.e2m1(x) for x in xs]


@settings(max_examples=300, deadline=None)
@given(st.lists(f32, min_size=1, max_size=64))
def test_e2m1_matches_reference_random(xs):
    assert e2m1_encode(torch.tensor(xs, dtype=torch.float32)).tolist() == [ref.e2m1(x) for x in xs]


def test_e2m1_decode_roundtrip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)


def test_e4m3_every_code_roundtrips_and_decodes_like_reference():
    b = torch.arange(256, dtype=torch.uint8)
    finite = (b & 0x7F) != 0x7F
    vals = e4m3_decode(b)
    assert torch.isnan(vals[~finite]).all()
    assert vals[finite].tolist() == [ref.e4m3_value(int(i)) for i in b[finite]]
    assert torch.equal(e4m3_encode(vals[finite]), b[finite])
    assert vals[finite].max().item() == 448.0 and vals[1].item() == 2.0**-9


def test_e4m3_matches_reference_near_every_midpoint():
    vals = sorted(set(ref.e4m3_values()))
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])] + [448.0, 464.0, 480.0, 1e30, 2.0**-10]
    xs = _around(mids, n=2)
    got = e4m3_encode(torch.tensor(np.array(xs, dtype=np.float32))).tolist()
    assert got == [ref.e4m3(x) for x in xs]


def test_e4m3_satfinite_and_nan():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e9, -0.0])
    assert e4m3_encode(x).tolist() == [0x7E, 0xFE, 0x7F, 0x7E, 0x80]


def test_e8m0_floor_ceil_and_specials():
    x = torch.tensor([1.0, 1.5, 2.0, 0.75, 2.0**-127, 2.0**-130, 0.0, -1.0, float("inf"), float("nan"), 2.0**127])
    assert e8m0_encode(x, "floor").tolist() == [127, 127, 128, 126, 0, 0, 0, 0, 0xFE, 0xFF, 254]
    assert e8m0_encode(x, "ceil").tolist() == [127, 128, 128, 127, 0, 0, 0, 0, 0xFE, 0xFF, 254]
    dec = e8m0_decode(torch.tensor([0, 127, 128, 254, 255], dtype=torch.uint8))
    assert dec[:4].tolist() == [2.0**-127, 1.0, 2.0, 2.0**127] and math.isnan(dec[4])
    with pytest.raises(ValueError, match="floor"):
        e8m0_encode(x, "nearest")


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_roundtrip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_fp4(c)
    assert packed.tolist() == [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]
    assert torch.equal(unpack_fp4(packed), c)


def test_bad_inputs_name_the_problem():
    with pytest.raises(TypeError, match="floating"):
        e2m1_encode(torch.arange(4))
    with pytest.raises(TypeError, match="uint8"):
        e2m1_decode(torch.arange(4))
    with pytest.raises(ValueError, match="0..15"):
        e2m1_decode(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    assert e2m1_encode(torch.empty(0)).shape == (0,)
    assert e2m1_encode(torch.tensor([1.0], dtype=torch.bfloat16)).tolist() == [2]
