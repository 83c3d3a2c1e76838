"""The embedded engine's CUDA paths reach the Triton kernels through megatron_trace.kernels.dispatch. CUDA is not
needed to check the routing: the interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU
tensors when the backend is forced to 'triton', and each result is held to the torch path."""

import importlib

import pytest
import torch

from megatron_trace.kernels.dispatch import triton_available
from sglang_backend.local import attention as engine_attention
from sglang_backend.local.kv_cache import PagedKVCache
from sglang_backend.local.layers import EngineLinear
from sglang_backend.local.model import ForwardBatch

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="triton is not importable"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's numpy on masked lanes
]


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    if not importlib.import_module("megatron_trace.kernels.triton_fp4_codecs").INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; CPU runs need it")


def _spy(monkeypatch, module: str, name: str) -> list:
    mod = importlib.import_module(module)
    calls, real = [], getattr(mod, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_decode_attention_over_fp4_pages_runs_the_paged_kernel(monkeypatch, fmt):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, lens = 4, 2, 32, [5, 11]
    kv = PagedKVCache(
        num_layers=2, kv_heads=kv_heads, head_dim=d, num_pages=8, page_size=4, kv_dtype=fmt, dtype=torch.float32
    )
    kv.global_scale[1] = torch.tensor([3.0, 0.5])  # per-layer S_enc reaches the kernel (ignored by MXFP4)
    read = []
    for n in lens:
        slots = kv.slots(kv.allocate(kv.pages_needed(n)), 0, n)
        for which in (0, 1):
            kv.write(1, which, slots, torch.randn(n, kv_heads, d, generator=g))
        read.append(slots)
    batch = ForwardBatch(
        torch.zeros(2, dtype=torch.long),
        torch.tensor([n - 1 for n in lens]),
        [(0, 1), (1, 2)],
        torch.cat([s[-1:] for s in read]),
        read,
    )
    q = torch.randn(2, heads, d, generator=g)
    monkeypatch.setattr(engine_attention, "DECODE_ATTENTION_BACKEND", "reference")
    want = engine_attention.decode_attention(q, batch, kv, 1)
    calls = _spy(monkeypatch, "megatron_trace.kernels.fp4_attention", "paged_decode_attention_triton")
    monkeypatch.setattr(engine_attention, "DECODE_ATTENTION_BACKEND", "triton")
    got = engine_attention.decode_attention(q, batch, kv, 1)
    assert calls == ["paged_decode_attention_triton"]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 summation order only


def test_decode_attention_on_cpu_keeps_the_torch_path_under_auto(monkeypatch):
    kv = PagedKVCache(
        num_layers=1, kv_heads=1, head_dim=16, num_pages=2, page_size=4, kv_dtype="nvfp4", dtype=torch.float32
    )
    slots = kv.slots(kv.allocate(1), 0, 3)
    for which in (0, 1):
        kv.write(0, which, slots, torch.randn(3, 1, 16))
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([2]), [(0, 1)], slots[-1:], [slots])
    calls = _spy(monkeypatch, "megatron_trace.kernels.fp4_attention", "paged_decode_attention_triton")
    assert engine_attention.DECODE_ATTENTION_BACKEND == "auto"
    engine_attention.decode_attention(torch.randn(1, 2, 16), batch, kv, 0)
    assert calls == []


def _fp4_linear(act_fmt, static):
    g = torch.Generator().manual_seed(1)
    lin = EngineLinear(
        {"gate": 32, "up": 48},
        64,
        bias=True,
        weight_fmt="nvfp4",
        act_fmt=act_fmt,
        dtype=torch.float32,
        site="model.layers.0.mlp.gate_up_proj",
    )
    for shard, rows in lin.shards.items():
        lin.load_shard(shard, torch.randn(rows, 64, generator=g))
        lin.load_shard(shard, torch.randn(rows, generator=g), "bias")
    lin.finalize()
    if static:
        lin.input_global_scale = torch.tensor(60.0)
    return lin, torch.randn(5, 64, generator=g) * 2


@pytest.mark.parametrize(
    "act_fmt,static",
    [(None, False), ("nvfp4", False), ("nvfp4", True)],
    ids=["w4a16", "w4a4_per_token", "w4a4_static_scale"],
)
def test_fp4_linear_runs_the_triton_gemm_on_its_packed_weight(monkeypatch, act_fmt, static):
    lin, x = _fp4_linear(act_fmt, static)
    captured = {"reference": [], "triton": []}
    out = {}
    kernel = "fp4_linear_w4a4_triton" if act_fmt else "fp4_linear_triton"
    calls = _spy(monkeypatch, "megatron_trace.kernels.fp4_gemm", kernel)
    for backend in ("reference", "triton"):

        def record(site, q, into=captured[backend]):
            into.append((site, q))

        lin.gemm_backend = backend
        out[backend] = lin.forward(x, record)
    assert calls == [kernel]
    torch.testing.assert_close(out["triton"], out["reference"], rtol=1e-5, atol=1e-5)  # fp32 summation order
    # Guidance sees the same quantized input on both routes, bit for bit.
    assert len(captured["triton"]) == len(captured["reference"]) == (1 if act_fmt else 0)
    for (s_t, q_t), (s_r, q_r) in zip(captured["triton"], captured["reference"]):
        assert s_t == s_r and torch.equal(q_t.data, q_r.data) and torch.equal(q_t.scale, q_r.scale)
        assert torch.equal(q_t.global_scale, q_r.global_scale)


def test_fp4_linear_on_cpu_keeps_f_linear_under_auto(monkeypatch):
    lin, x = _fp4_linear("nvfp4", False)
    calls = _spy(monkeypatch, "megatron_trace.kernels.fp4_gemm", "fp4_linear_w4a4_triton")
    assert lin.gemm_backend == "auto"
    lin.forward(x)
    assert calls == []
