"""K and V pages in separate formats (FP8 K + NVFP4 V and the rest): the cache, the mixed-format
C attention and the engine agree bit for bit with the fp4/ references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import fp8, nvfp4
from megatron_trace.kernels import cpu_attention
from sglang_backend.local.kv_cache import PagedKVCache

FORMATS = ("bf16", "nvfp4", "fp8", "mxfp4")


def _cache(k, v, dtype=torch.float32, **kw):
    return PagedKVCache(
        num_layers=2,
        kv_heads=2,
        head_dim=32,
        num_pages=8,
        page_size=4,
        kv_dtype="auto",
        k_dtype=k,
        v_dtype=v,
        dtype=dtype,
        **kw,
    )


def test_fp8_k_nvfp4_v_pages_hold_the_reference_bytes():
    kv = _cache("fp8", "nvfp4")
    assert kv.fmt == "mixed" and kv.side_fmt == ("fp8", "nvfp4")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 32, generator=g) * 50, torch.randn(6, 2, 32, generator=g)
    slots = torch.tensor([3, 9, 10, 11, 20, 1])
    kv.write(1, 0, slots, k, return_values=False)
    kv.write(1, 1, slots, v, return_values=False)
    qk, qv = fp8.quantize(k, dims=2), nvfp4.quantize(v, global_scale=torch.tensor(1.0))
    kd, ks, vd, vs = kv.layer_pages[1]
    assert torch.equal(kd[slots], qk.data) and torch.equal(ks[slots], qk.scale)
    assert torch.equal(vd[slots], qv.data) and torch.equal(vs[slots], qv.scale)
    assert torch.equal(kv.read(1, 0, slots), fp8.dequantize(qk)) and torch.equal(
        kv.read(1, 1, slots), nvfp4.dequantize(qv)
    )
    kv.copy_slots(slots[:2], torch.tensor([30, 31]))
    assert torch.equal(kv.read(1, 0, torch.tensor([30, 31])), fp8.dequantize(qk)[:2])


@pytest.mark.parametrize(
    "k,v,bits",
    [
        ("bf16", "bf16", 32),
        ("nvfp4", "nvfp4", 9),
        ("fp8", "nvfp4", 8.5 + 4.5),
        ("fp8", "fp8", 2 * 8.5),
        ("mxfp4", "nvfp4", 9),
    ],
)
def test_bytes_per_token_count_scales(k, v, bits):
    kv = _cache(k, v, dtype=torch.bfloat16)  # 2 heads x 32: an fp32 scale per token is 0.5 bit/element
    assert kv.bytes_per_token() == 2 * 2 * 32 * bits / 8


@settings(max_examples=20, deadline=None)
@given(kf=st.sampled_from(FORMATS), vf=st.sampled_from(FORMATS), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_mixed_page_attention_equals_attention_over_the_cache_reads(kf, vf, bf16, seed):
    dtype = torch.bfloat16 if bf16 else torch.float32
    kv = _cache(kf, vf, dtype=dtype)
    kv.global_scale[0] = torch.tensor([0.37, 2.5])
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(kv.num_pages * kv.page_size)
    k, v = torch.randn(len(slots), 2, 32, generator=g) * 20, torch.randn(len(slots), 2, 32, generator=g)
    kv.write(0, 0, slots, k, return_values=False)
    kv.write(0, 1, slots, v, return_values=False)
    table, row_seq, row_len = (
        torch.randint(0, 32, (3, 12), generator=g),
        torch.tensor([0, 2, 2, 1]),
        torch.tensor([1, 12, 5, 9]),
    )
    q = torch.randn(4, 4, 32, generator=g).to(dtype)
    dense = cpu_attention.paged_attention(q, kv.read(0, 0, slots), kv.read(0, 1, slots), table, row_seq, row_len, 0.2)
    sdec = nvfp4.decode_scale(kv.global_scale[0]).tolist()
    pages = kv.layer_pages[0]
    if kv.fmt == "bf16":
        pages = (pages[0], None, pages[1], None)
    mixed = cpu_attention.paged_attention_kv(
        q, kf, pages[:2], sdec[0], vf, pages[2:], sdec[1], table, row_seq, row_len, 0.2
    )
    assert torch.equal(dense, mixed)


def test_kernel_refuses_pages_it_cannot_decode():
    kv = _cache("mxfp4", "fp8")  # every cache format has a decoder now: a name the kernel does not know
    with pytest.raises(ValueError, match="no decoder for K pages in 'int4'"):
        cpu_attention.paged_attention_kv(
            torch.zeros(1, 2, 32),
            "int4",
            kv.layer_pages[0][:2],
            1.0,
            "fp8",
            kv.layer_pages[0][2:],
            1.0,
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
        )


def test_engine_fp8_k_nvfp4_v_fused_equals_torch_path_and_guides_both_sides(tmp_path, monkeypatch):
    from megatron_trace.kernels import cpu_fused
    from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
    from sglang_backend.local import Engine, run_plan

    if not cpu_fused.available():
        pytest.skip("no C compiler here")
    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", seed=3)
    policy = QuantPolicy(kv="auto").resolve(ModelArch.from_hf_config(ckpt))  # qwen2: FP8 K + NVFP4 V
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(run_plan, "fused", lambda model, kv: False)
        eng = Engine(str(ckpt), quant_policy=policy, guidance_mode="full", guided_layers="all")
        try:
            assert eng.kv.side_fmt == ("fp8", "nvfp4") and eng.model.run_plan(eng.kv).fused == fused
            out = eng.generate(
                input_ids=[[1, 2, 3, 4, 5], [9, 8]], sampling_params=sp, return_logprob=True, return_guidance=True
            )
            rec = eng.fetch_guidance(out[0]["meta_info"]["guidance_handle"])
            runs.append(out)
        finally:
            eng.shutdown()
        k_sites = [rec.sites[f"model.layers.{i}.self_attn.k_cache"] for i in range(2)]
        v_sites = [rec.sites[f"model.layers.{i}.self_attn.v_cache"] for i in range(2)]
        n, heads, d = rec.num_positions, eng.arch.num_kv_heads, eng.arch.head_dim
        for k in k_sites:  # FP8 K: its E4M3 bytes and one S_enc per token, no block scales
            assert k.fp8 and k.payload.shape == (n, heads, d) and k.global_scale.shape == (n,)
            assert bool((k.global_scale > 0).all())
        assert not any(v.fp8 for v in v_sites) and v_sites[0].payload.shape == (n, heads, d // 2)
    # The C and torch GEMMs differ at the ulp level, which now and then moves a K/V element across an
    # FP8/FP4 rounding boundary (with seed 3 once, at decode step 2: logprob -1.8073 vs -1.8097), so
    # this compares the engine paths loosely; the kernels are compared bit for bit above.
    for a, b in zip(*runs):
        assert a["output_ids"][:4] == b["output_ids"][:4]
        la, lb = ([t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in (a, b))
        assert max(abs(x - y) for x, y in zip(la[:4], lb[:4])) <= 0.2


@pytest.mark.parametrize("k_fmt,v_fmt", [("fp8", "nvfp4"), ("mxfp4", "fp8")])
def test_trainer_qat_kv_equals_the_engine_pages(k_fmt, v_fmt):
    """QATState.kv on [S, B, heads, D] gives what the engine's pages read back for the same K/V."""
    from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
    from megatron_trace.trainer.qat import QATState

    st = QATState(
        ModelArch.from_hf_config(tiny_hf_config("qwen2")), QuantPolicy(kv="bf16", kv_k=k_fmt, kv_v=v_fmt), "guided"
    )
    kv = _cache(k_fmt, v_fmt)
    g = torch.Generator().manual_seed(1)
    for which, fmt in ((0, k_fmt), (1, v_fmt)):
        t = (torch.randn(4, 2, 2, 32, generator=g) * 30).requires_grad_()  # [S, B, KV heads, D]
        slots = torch.arange(8)
        kv.write(0, which, slots, t.detach().reshape(8, 2, 32), return_values=False)
        got = st.kv(t, "model.layers.0.self_attn." + ("k_cache", "v_cache")[which], fmt)
        assert torch.equal(got.detach().reshape(8, 2, 32), kv.read(0, which, slots))
        got.sum().backward()
        assert torch.equal(t.grad, torch.ones_like(t))  # straight-through


def test_plugin_kv_writes_equal_the_engine_pages_and_trainer_qat():
    """FP8 K + NVFP4 V: the SGLang plugin's quantizers, the engine's pages and the trainer's QAT
    hold the same bits for the same K and V."""
    from megatron_trace.kernels import kv_codec
    from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
    from megatron_trace.trainer.qat import QATState
    from sglang_backend.plugin.kv_capture import quantize_kv

    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(8, 2, 32, generator=g) * 40, torch.randn(8, 2, 32, generator=g)
    kv = _cache("fp8", "nvfp4")
    slots = torch.arange(8)
    kv.write(0, 0, slots, k, return_values=False)
    kv.write(0, 1, slots, v, return_values=False)
    kd, ks, vd, vs = kv.layer_pages[0]
    pk, pv = kv_codec.quantize("fp8", k), quantize_kv(v, 1.0)  # SGLang's v_scale 1.0 = the engine's S_enc 1.0
    assert torch.equal(pk.data, kd[slots]) and torch.equal(pk.scale, ks[slots])
    assert torch.equal(pv.data, vd[slots]) and torch.equal(pv.scale, vs[slots])
    st = QATState(
        ModelArch.from_hf_config(tiny_hf_config("qwen2")), QuantPolicy(kv="bf16", kv_k="fp8", kv_v="nvfp4"), "rtn"
    )
    assert torch.equal(st.kv(k.reshape(4, 2, 2, 32), "k", "fp8").reshape(8, 2, 32), fp8.dequantize(pk))
    assert torch.equal(st.kv(v.reshape(4, 2, 2, 32), "v", "nvfp4").reshape(8, 2, 32), nvfp4.dequantize(pv))


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_trainer_qat_follows_the_engine_fp8_k_record(mode):
    """FP8 K is a guided site: the engine's record of its K (E4M3 bytes or their low bits and S_enc per
    token, through the record's bytes) pins the trainer's K, which differs from the rollout's by
    noise, to the engine's pages; round-to-nearest on the same K flips codes."""
    from megatron_trace.guidance import GuidanceRecord, make_site, quantized_parts
    from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
    from megatron_trace.trainer.batching import MicroBatchGuidance
    from megatron_trace.trainer.qat import QATState

    site = "model.layers.0.self_attn.k_cache"
    S, B = 6, 2
    g = torch.Generator().manual_seed(3)
    k = torch.randn(S, B, 2, 32, generator=g) * torch.tensor([40.0, 1.0])[:, None]  # an outlier head
    kv, records = _cache("fp8", "nvfp4"), []
    for j in range(B):  # sample j sits in batch column j; its record covers positions 0..S-1
        q = kv.quantize(0, 0, k[:, j])
        kv.write(0, 0, torch.arange(j * 8, j * 8 + S), k[:, j], q, return_values=False)
        rec = GuidanceRecord(f"s{j}", mode, S, {site: make_site(*quantized_parts(q), mode)})
        records.append(GuidanceRecord.from_bytes(rec.to_bytes()))
    assert records[0].sites[site].fp8
    pages = torch.stack([kv.read(0, 0, torch.arange(j * 8, j * 8 + S)) for j in range(B)], dim=1)
    trainer_k = k * (1 + 3e-3 * torch.randn(k.shape, generator=g))
    arch = ModelArch.from_hf_config(tiny_hf_config("qwen2"))
    for qat_mode in ("guided", "rtn"):
        st = QATState(arch, QuantPolicy(kv="bf16", kv_k="fp8", kv_v="nvfp4"), qat_mode)
        st.set_micro_batch(MicroBatchGuidance.padded(records, S), None)
        got = st.kv(trainer_k, site, "fp8").detach()
        assert torch.equal(got, pages) == (qat_mode == "guided")
    if mode == "full":
        assert st.agreement()[site] < 0.99  # rtn's codes, counted against the record's
