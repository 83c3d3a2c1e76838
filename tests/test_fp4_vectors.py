"""The public test vectors (NVIDIA host conversions, TE's NVFP4 sequence, OCP MXFP4), bit for bit."""

import pytest
import torch

from megatron_trace.fp4 import e2m1_encode, mxfp4, nvfp4, pack_fp4, swizzle_scales

INF, NAN = float("inf"), float("nan")
S_ENC_ONE = 2688.0  # global amax that gives S_enc = 1 exactly


def _codes(q):
    return [int(c) for c in q.codes().flatten()]


def test_e2m1_vector_1():
    x = torch.tensor([0.25, 0.25000009, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0000005, 7, INF, -INF, NAN, -0.0, -0.1, -5])
    expect = [0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x7, 0x7, 0xF, 0x7, 0x8, 0x8, 0xE]
    assert e2m1_encode(x).tolist() == expect
    assert e2m1_encode(torch.tensor([-NAN])).tolist() == [0x7]


def test_packing_low_nibble_first():
    assert pack_fp4(e2m1_encode(torch.tensor([1.0, -6.0]))).tolist() == [0xF2]


def test_nvfp4_vector_2_exact_grid():
    x = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, -0.0, -1, -2, -3, -4, -6, -8, -12])
    q = nvfp4.quantize(x, global_amax=S_ENC_ONE)
    assert q.global_scale.item() == 1.0
    assert q.scale.tolist() == [0x40]
    assert q.data.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    deq = nvfp4.dequantize(q)
    assert torch.equal(deq, x) and torch.equal(torch.signbit(deq), torch.signbit(x))


def test_nvfp4_vector_3_midpoints():
    x = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.1])
    q = nvfp4.quantize(x, global_amax=S_ENC_ONE)
    assert q.scale.tolist() == [0x38]
    assert _codes(q) == [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0]


def test_nvfp4_vector_4_inexact_scale():
    x = torch.zeros(16)
    x[:5] = torch.tensor([7, 3, 1, 0.3, -7])
    q = nvfp4.quantize(x, global_amax=S_ENC_ONE)
    assert q.scale.tolist() == [0x39]
    assert _codes(q)[:5] == [7, 5, 2, 1, 0xF]
    assert nvfp4.dequantize(q)[:5].tolist() == [6.75, 3.375, 1.125, 0.5625, -6.75]


def test_nvfp4_vector_5_tensor_scale():
    x = torch.zeros(32)
    x[:4] = torch.tensor([10, -5, 2.5, 1])
    x[16:20] = torch.tensor([1, -0.5, 0.25, 0.1])
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == pytest.approx(268.79999, abs=1e-5)
    assert q.global_scale.item() == torch.tensor(2688.0 / 10.0, dtype=torch.float32).item()
    assert q.scale.tolist() == [0x7E, 0x63]
    assert _codes(q)[:4] == [7, 0xD, 3, 1] and _codes(q)[16:20] == [7, 0xD, 3, 1]
    deq = nvfp4.dequantize(q)
    assert deq[:4].tolist() == pytest.approx([10, -5, 2.5, 0.8333333], abs=1e-6)
    assert deq[16:20].tolist() == pytest.approx([0.982143, -0.491071, 0.245536, 0.0818452], abs=1e-6)


@pytest.mark.parametrize("rule,byte,codes", [("floor", 0x7F, [7, 5, 1, 0xA]), ("ceil", 0x80, [6, 3, 0, 9])])
def test_mxfp4_vector_6(rule, byte, codes):
    x = torch.zeros(32)
    x[:4] = torch.tensor([7, 3, 0.3, -1.2])
    q = mxfp4.quantize(x, rule=rule)
    assert q.scale.tolist() == [byte]
    assert _codes(q)[:4] == codes and _codes(q)[4:] == [0] * 28


@pytest.mark.parametrize(
    "m,k,K,offset",
    [
        (0, 0, 64, 0),
        (1, 0, 64, 16),
        (32, 0, 64, 4),
        (33, 3, 64, 23),
        (127, 3, 64, 511),
        (0, 4, 128, 512),
        (128, 0, 128, 1024),
        (5, 6, 128, 594),
    ],
)
def test_swizzle_vector_7(m, k, K, offset):
    rows = m + 1
    scale = torch.zeros(rows, K // 16, dtype=torch.uint8)
    scale[m, k] = 0xAB
    flat = swizzle_scales(scale).flatten()
    assert flat.numel() == ((rows + 127) // 128 * 128) * ((K // 16 + 3) // 4 * 4)
    assert (flat == 0xAB).nonzero().flatten().tolist() == [offset]
