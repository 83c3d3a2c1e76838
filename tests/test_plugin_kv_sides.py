"""The plugin's per-side KV method (plugin/kv_sides.py) on SGLang 0.5.23's KV quant-method contract:
for every K/V format pair the policy allows, what attention reads back through SGLang's PLAIN access
equals the embedded engine's pages bit for bit, and its bytes per token are the engine's (plus the
one-byte placeholder scale of a BF16 side). No server: the method class SGLang's pool would build.
"""

from __future__ import annotations

import itertools

import pytest
import sglang  # noqa: F401 - the test command installs it
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_backend.local.kv_cache import PagedKVCache
from sglang_backend.plugin import kv_sides

PAIRS = list(itertools.product(kv_sides.SIDE_FORMATS, repeat=2))
HEADS, HEAD_DIM, SLOTS, LAYERS = 2, 32, 64, 2


def _engine_pages(pair):
    """The embedded engine's paged KV cache with K and V in the pair's formats (the reference bits)."""
    return PagedKVCache(
        num_layers=LAYERS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        num_pages=SLOTS // 16,
        page_size=16,
        kv_dtype="auto",
        k_dtype=pair[0],
        v_dtype=pair[1],
        dtype=torch.float32,
    )


def _method(sides):
    m = kv_sides.per_side_method_class(sides)(num_layers=LAYERS, device="cpu", page_size=16)
    m.configure_attention_backends("torch_native", "torch_native")
    return m, m.create_buffers(SLOTS, HEADS, HEAD_DIM, LAYERS, "cpu")


@settings(max_examples=25, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    seed=st.integers(0, 2**31 - 1),
    k_mag=st.sampled_from([1e-3, 1.0, 40.0, 300.0]),
    tokens=st.integers(1, 12),
)
def test_reads_equal_the_engine_pages(pair, seed, k_mag, tokens):
    m, bufs = _method(pair)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, HEADS, HEAD_DIM, generator=g) * k_mag
    k[:, :, 3] += 200.0 * k_mag  # an outlier channel, as Qwen2.5's K has
    v = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    loc = torch.randperm(SLOTS, generator=g)[:tokens]
    layer = 1
    # the pool passes cache_k flat over heads on some paths: the method takes either shape
    m.quantize_and_store(
        bufs["k_buffer"][layer],
        bufs["v_buffer"][layer],
        bufs["k_scale_buffer"][layer],
        bufs["v_scale_buffer"][layer],
        loc,
        k.reshape(tokens, -1),
        v,
        m.k_scales_gpu[layer : layer + 1],
        m.v_scales_gpu[layer : layer + 1],
    )
    got_k = m.dequantize_kv_tensor(bufs["k_buffer"][layer], bufs["k_scale_buffer"][layer], layer)
    got_v = m.dequantize_kv_tensor(bufs["v_buffer"][layer], bufs["v_scale_buffer"][layer], layer)
    kv = _engine_pages(pair)
    kv.write(layer, 0, loc, k, return_values=False)
    kv.write(layer, 1, loc, v, return_values=False)
    assert torch.equal(got_k[loc], kv.read(layer, 0, loc)), pair
    assert torch.equal(got_v[loc], kv.read(layer, 1, loc)), pair


@pytest.mark.parametrize("pair", PAIRS)
def test_cell_size_is_the_engines_bytes_per_token(pair):
    m, _ = _method(pair)
    kv = PagedKVCache(
        num_layers=LAYERS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        num_pages=1,
        page_size=16,
        kv_dtype="auto",
        k_dtype=pair[0],
        v_dtype=pair[1],
        dtype=torch.float32,
    )
    placeholder = LAYERS * pair.count("bf16")  # a BF16 side keeps a one-byte scale row for the pool's lists
    assert m.compute_cell_size(HEADS, HEAD_DIM, LAYERS, 1) == kv.bytes_per_token() + placeholder


def test_other_attention_backends_and_bad_sides_are_refused_by_name(monkeypatch):
    cls = kv_sides.per_side_method_class(("fp8", "nvfp4"))
    with pytest.raises(ValueError, match=r"K cache fp8 \+ V cache nvfp4.*\['flashinfer'\].*torch_native"):
        cls(num_layers=1, device="cpu").configure_attention_backends("flashinfer", "torch_native")
    for raw in ("fp8", "fp8,nvfp5", "fp8,nvfp4,bf16"):
        monkeypatch.setenv(kv_sides.SIDES_ENV, raw)
        with pytest.raises(ValueError, match="TRACE_KV_SIDES must be '<K format>,<V format>'"):
            kv_sides.sides_from_env()


def test_registration_serves_the_asked_sides_or_stops_the_pool(monkeypatch):
    """TRACE_KV_SIDES picks the registry's nvfp4 entry; with TRACE_FP4_KV=0 a per-side request stops the
    server when it builds its pool instead of becoming SGLang's NVFP4 for both sides."""
    from sglang_backend.plugin import register
    from sglang_backend.plugin.kv_capture import sglang_nvfp4_base

    _, mod = sglang_nvfp4_base()
    saved = dict(mod.KV_CACHE_QUANT_REGISTRY)
    try:
        monkeypatch.setenv(kv_sides.SIDES_ENV, "fp8,nvfp4")
        assert register.register_kv_method()
        assert mod.KV_CACHE_QUANT_REGISTRY["nvfp4"].side_formats == ("fp8", "nvfp4")
        monkeypatch.setenv("TRACE_KV_K_DEBIAS", "1")
        assert register.register_kv_method() and mod.KV_CACHE_QUANT_REGISTRY["nvfp4"].k_debias
        monkeypatch.delenv(kv_sides.SIDES_ENV)  # de-biasing without the per-side method: refused, not dropped
        assert not register.register_kv_method()
        with pytest.raises(RuntimeError, match="TRACE_KV_K_DEBIAS=1 needs TRACE_KV_SIDES"):
            mod.get_kv_cache_quant_method("nvfp4", num_layers=1, device="cpu", page_size=16)
        monkeypatch.delenv("TRACE_KV_K_DEBIAS")
        monkeypatch.setenv(kv_sides.SIDES_ENV, "fp8,nvfp4")
        monkeypatch.setenv("TRACE_FP4_KV", "0")
        assert not register.register_kv_method()
        with pytest.raises(RuntimeError, match="TRACE_FP4_KV=0 keeps SGLang's nvfp4 method"):
            mod.get_kv_cache_quant_method("nvfp4", num_layers=1, device="cpu", page_size=16)
    finally:
        mod.KV_CACHE_QUANT_REGISTRY.clear()
        mod.KV_CACHE_QUANT_REGISTRY.update(saved)


@pytest.mark.parametrize("pair", [("mxfp4", "mxfp4"), ("fp8", "mxfp4"), ("mxfp4", "nvfp4")])
def test_quantized_sides_are_recorded_for_guidance_with_the_engine_page_bytes(pair):
    """Inside a server's capture every quantized side records its page bytes (MXFP4: codes and E8M0 per
    16, ceil rule, S_enc 1.0; NVFP4: codes, E4M3 and the layer's S_enc; FP8: E4M3 bytes and S_enc per
    token) as the engine's pages hold them and its guidance log records them."""
    from megatron_trace.guidance import GuidanceRecord
    from sglang_backend.plugin import capture, slot_capture

    m, bufs = _method(pair)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(5, HEADS, HEAD_DIM, generator=g) * 7, torch.randn(5, HEADS, HEAD_DIM, generator=g)
    loc, layer = torch.tensor([9, 2, 40, 7, 11]), 1
    cap = slot_capture.SlotCapture(SLOTS, "full", guided_layers=[layer])
    with capture.capture_batch(loc, loc, buffer=cap):
        m.quantize_and_store(
            *(bufs[b][layer] for b in ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")),
            loc,
            k,
            v,
            m.k_scales_gpu[layer : layer + 1],
            m.v_scales_gpu[layer : layer + 1],
        )
    rec = GuidanceRecord.from_bytes(cap.record("r", loc[[1, 0, 3]]))
    kv = _engine_pages(pair)
    assert set(rec.sites) == {f"model.layers.{layer}.self_attn.{side}" for side in ("k_cache", "v_cache")}
    for which, side in enumerate(("k_cache", "v_cache")):
        want = kv.quantize(layer, which, (k, v)[which][[1, 0, 3]])
        got = rec.sites[f"model.layers.{layer}.self_attn.{side}"]
        assert torch.equal(got.payload, want.data), (pair, side)
        if pair[which] == "fp8":
            assert got.fp8 and torch.equal(got.global_scale, want.encode), (pair, side)
            continue
        assert torch.equal(got.scale, want.scale), (pair, side)
        want_gs = getattr(want, "global_scale", torch.tensor(1.0))  # MXFP4 pages have no global scale
        assert got.global_scale.dim() == 0 and float(got.global_scale) == float(want_gs), (pair, side)


def _debiased_method(k_fmt: str, bias: torch.Tensor, theta: float = 10000.0):
    """A de-biasing per-side method whose layers' k_proj bias is `bias` [HEADS, HEAD_DIM] (what the
    plugin's forward hook binds from SGLang's Qwen2 attention: qkv_proj.bias, q_size, kv_size)."""
    from types import SimpleNamespace

    from sglang_backend.plugin import kv_debias

    m = kv_sides.per_side_method_class((k_fmt, "nvfp4"), k_debias=True)(num_layers=LAYERS, device="cpu", page_size=16)
    m.configure_attention_backends("torch_native", "torch_native")
    bufs = m.create_buffers(SLOTS, HEADS, HEAD_DIM, LAYERS, "cpu")
    q = torch.zeros(8 * HEAD_DIM)  # q's part of the fused bias: the K slice starts after it
    attn = SimpleNamespace(
        qkv_proj=SimpleNamespace(bias=torch.cat([q, bias.reshape(-1), torch.zeros(bias.numel())])),
        q_size=q.numel(),
        kv_size=bias.numel(),
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    m.k_biases = {i: kv_debias.LayerKBias(attn, theta) for i in range(LAYERS)}
    return m, bufs


@pytest.mark.parametrize("k_fmt", ["nvfp4", "fp8"])
def test_debiased_k_reads_equal_the_engines_debiased_pages(k_fmt):
    """quant.kv_k_debias in SGLang: the store takes RoPE(x W_k) (qkv_proj holds b out) and records the
    batch's positions (set by the forward hook), the read adds RoPE_slotpos(b) back in fp32, and both
    the stored bytes (the guidance site) and the values attention reads equal the embedded engine's
    de-biased pages (sglang_backend/local/model.py: k.float(); read(...).float() + k_bias_at)."""
    from megatron_trace.models.rope import rotated_bias
    from sglang_backend.plugin import kv_debias

    g = torch.Generator().manual_seed(5)
    bias = torch.randn(HEADS, HEAD_DIM, generator=g) * 30  # Qwen2.5-sized: K's outliers come from it
    m, bufs = _debiased_method(k_fmt, bias.to(torch.bfloat16).float())
    tokens, layer = 7, 1
    positions = torch.tensor([0, 1, 2, 3, 17, 18, 250])
    k = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)  # RoPE(x W_k): the bias never went in
    v = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    loc = torch.randperm(SLOTS, generator=g)[:tokens]
    args = [bufs[b][layer] for b in ("k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer")]
    scales = (m.k_scales_gpu[layer : layer + 1], m.v_scales_gpu[layer : layer + 1])
    with pytest.raises(RuntimeError, match="outside ModelRunner.forward"):
        m.quantize_and_store(*args, loc, k, v, *scales)
    token = kv_debias._POSITIONS.set(positions)
    try:
        m.quantize_and_store(*args, loc, k, v, *scales)
    finally:
        kv_debias._POSITIONS.reset(token)
    offset = rotated_bias(bias.to(torch.bfloat16), positions, 10000.0)
    kv = _engine_pages((k_fmt, "nvfp4"))
    kv.write(layer, 0, loc, k.float(), return_values=False)
    want_store = kv.quantize(layer, 0, k.float())
    assert torch.equal(bufs["k_buffer"][layer][loc], want_store.data)
    got = m.dequantize_kv_tensor(bufs["k_buffer"][layer], bufs["k_scale_buffer"][layer], layer)
    assert torch.equal(got[loc], (kv.read(layer, 0, loc).float() + offset).to(got.dtype))
    # the read holds the bias: the biased K up to the remainder's quantization error
    biased = k + rotated_bias(bias, positions, 10000.0)
    assert (got[loc] - biased).abs().max() < 0.3 * k.abs().max() < 0.1 * biased.abs().max()
    with pytest.raises(NotImplementedError, match="positions are unknown"):
        m.dequantize_prev_kv(*args[:1], args[2], args[1], args[3], layer)


def test_held_out_k_bias_leaves_b_out_of_k_only():
    """kv_debias.hold_out_k_bias: qkv_proj's K rows come out as x W_k (one linear call, no bf16 add
    and subtract of b), its Q and V rows keep their bias, a later bias load reaches the next call, and
    the module's own bias parameter is back in place after each forward (weight loaders write there)."""
    from types import SimpleNamespace

    from sglang_backend.plugin import kv_debias

    class Qkv(torch.nn.Module):  # SGLang's QKVParallelLinear: forward returns (output, output_bias)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(12, 5, dtype=torch.bfloat16), requires_grad=False)
            self.bias = torch.nn.Parameter(torch.randn(12, dtype=torch.bfloat16) * 40, requires_grad=False)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias), None

    qkv = Qkv()
    attn = SimpleNamespace(qkv_proj=qkv, q_size=4, kv_size=4)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    kv_debias.hold_out_k_bias(attn)
    kv_debias.hold_out_k_bias(attn)  # binding twice is one hold-out
    real = qkv.bias
    masked = real.detach().clone()
    masked[4:8] = 0
    assert torch.equal(qkv(x)[0], torch.nn.functional.linear(x, qkv.weight, masked))
    assert qkv.bias is real
    real.data[4:8] += 1.0  # a weight update of k_proj.bias: the K rows still hold it out
    real.data[0] += 1.0  # ... and of q_proj.bias: the Q rows take it
    masked = real.detach().clone()
    masked[4:8] = 0
    assert torch.equal(qkv(x)[0], torch.nn.functional.linear(x, qkv.weight, masked))
