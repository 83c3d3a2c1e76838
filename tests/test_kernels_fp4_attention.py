"""Triton paged decode attention over NVFP4 / MXFP4 / BF16 pages (TRITON_INTERPRET=1) against
gather + fp4 dequantize + fp32 torch softmax attention: |err| <= 1e-5 (fp32 q), bf16 rounding
of the output for bf16 q."""

import importlib

import pytest
import torch

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.kernels.dispatch import paged_decode_attention, paged_decode_attention_reference, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not importlib.import_module("megatron_trace.kernels.fp4_attention").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _pages(fmt, slots, kvh, d, gs, gen, zero_slots=()):
    x = torch.randn(slots, kvh, d, generator=gen) * 2
    for s in zero_slots:
        x[s] = 0.0
    if fmt == "nvfp4":
        q = nvfp4.quantize(x, global_scale=gs)
        return q.data, q.scale
    if fmt == "mxfp4":  # the KV cache's MXFP4: block 16, ceil rule
        q = mxfp4.quantize(x, rule="ceil", block=16)
        return q.data, q.scale
    return x.bfloat16(), None


def _run(fmt, b, h, kvh, d, lens, qdtype=torch.float32, seed=0, table_dtype=torch.int32, **cfg):
    gen = torch.Generator().manual_seed(seed)
    slots = 4 * max(lens) + 8  # page_size 4
    gk, gv = torch.tensor(150.0), torch.tensor(0.8)
    kc, ks = _pages(fmt, slots, kvh, d, gk, gen, zero_slots=(1,))
    vc, vs = _pages(fmt, slots, kvh, d, gv, gen)
    q = torch.randn(b, h, d, generator=gen).to(qdtype)
    table = torch.stack([torch.randperm(slots, generator=gen)[: max(lens)] for _ in range(b)]).to(table_dtype)
    lens_t = torch.tensor(lens)
    args = (q, kc, ks, vc, vs, gk, gv, table, lens_t, fmt)
    got = paged_decode_attention(*args, backend="triton", **cfg)
    want = paged_decode_attention_reference(*args)
    assert got.shape == (b, h, d) and got.dtype == qdtype
    if qdtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    return got


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "bf16"])
@pytest.mark.parametrize(
    "b,h,kvh,d,lens",
    [
        (1, 2, 2, 16, [1]),  # one token, MHA
        (2, 8, 2, 32, [37, 5]),  # GQA group 4, partial tiles
        (3, 6, 2, 16, [20, 1, 33]),  # group 3 (not a power of two)
    ],
)
def test_matches_reference(fmt, b, h, kvh, d, lens):
    _run(fmt, b, h, kvh, d, lens)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_split_kv_merge(fmt):
    # 3 and 5 splits: some splits are empty for the short sequence.
    _run(fmt, 2, 4, 1, 32, [70, 9], splits=3, table_dtype=torch.int64)
    _run(fmt, 1, 8, 1, 64, [50], splits=5, seed=1)


def test_bf16_queries_and_empty_sequence():
    _run("nvfp4", 2, 4, 2, 32, [25, 3], qdtype=torch.bfloat16)
    out = _run("mxfp4", 2, 2, 1, 16, [0, 4])
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_bad_arguments():
    q = torch.randn(1, 3, 16)
    kc = torch.zeros(8, 2, 8, dtype=torch.uint8)
    ks = torch.zeros(8, 2, 1, dtype=torch.uint8)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2])
    with pytest.raises(ValueError):
        paged_decode_attention(q, kc, ks, kc, ks, 1.0, 1.0, table, lens, "nvfp4", backend="triton")
    with pytest.raises(ValueError):
        paged_decode_attention(q, kc, ks, kc, ks, 1.0, 1.0, table, lens, "fp8", backend="reference")
