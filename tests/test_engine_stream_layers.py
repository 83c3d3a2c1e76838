"""Larger bf16 layers at decode widths run as one C call per run of layers (layer_c.run_stream,
megatron_trace/kernels/cpu_layer_stream.cpp) and give the per-kernel path's bits: tokens, logprobs, KV pages and
every guidance site, for BF16, W4A4 and W4A16 linears over BF16 or NVFP4 pages (K de-biased too), per-token or
static activation scales, batches up to the widest a streamed layer takes."""

import pytest
import torch

from megatron_trace.kernels import cpu_gemv
from megatron_trace.models import DEFAULT_TARGETS, ModelArch, QuantPolicy, make_tiny_checkpoint
from sglang_backend.local import Engine, layer_c, run_plan
from tests.helpers import WIDE

pytestmark = [
    pytest.mark.isa_avx2,
    pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv not built: {cpu_gemv.unavailable_reason()}"),
]

# test_engine_streaming's wide layer (gate_up above run_plan.ONE_CALL_MAX_WEIGHTS), twice: a run of two
# layers hands a residual on
WIDE2 = dict(WIDE, num_hidden_layers=2)
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
ALL_LINEARS = (*DEFAULT_TARGETS, "*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj")


@pytest.fixture(scope="module")
def wide2(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wide2"), "qwen2", seed=7, dtype="bfloat16", **WIDE2)


def _generate(path, policy: dict, prompts, stream: bool, monkeypatch):
    """(outputs, decoded guidance records, the K/V pages, rows each run_stream call took)."""
    calls = []
    with monkeypatch.context() as m:
        if stream:
            real = layer_c.run_stream

            def counted(layers, x, *rest):
                calls.append((len(layers), x.shape[0]))
                return real(layers, x, *rest)

            m.setattr(layer_c, "run_stream", counted)
        else:
            m.setattr(run_plan, "_streams", lambda layer, kv: False)
        eng = Engine(
            str(path),
            dtype="bfloat16",
            quant_policy=QuantPolicy.from_dict(policy).resolve(ModelArch.from_hf_config(path)),
            guidance_mode="full",
            guided_layers="all",
            max_total_tokens=1024,
        )
        try:
            # guidance over an FP8 side sends its layers to the per-kernel path (the C quantizers log
            # FP4 only: test_kv_formats checks that capture), so streaming is compared without it there
            guided = bool(eng.policy.guided_site_kinds()) and "fp8" not in eng.kv.side_fmt
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, return_guidance=guided)
            handles = [o["meta_info"]["guidance_handle"] for o in outs] if guided else []
            records = [eng.fetch_guidance(h) for h in handles]
            pages = [t.clone() for t in eng.kv.layer_pages[1] if t is not None]
        finally:
            eng.shutdown()
    return outs, records, pages, calls


POLICIES = {
    "bf16": dict(format="bf16", weights="bf16", activations="bf16", kv="bf16"),
    "w4a4+nvfp4kv": dict(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4"),
    "w4a4+fp8k+nvfp4v": dict(format="nvfp4", weights="fp4", activations="fp4", kv_k="fp8", kv_v="nvfp4"),
    "bf16+fp8kv": dict(format="bf16", weights="bf16", activations="bf16", kv="fp8"),
    # de-biased K: the stream subtracts RoPE_pos(b) before the store and adds it to the K it attends over
    "w4a4+debiased nvfp4kv": dict(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4", kv_k_debias=True),
    "w4a4+debiased fp8k+nvfp4v": dict(
        format="nvfp4", weights="fp4", activations="fp4", kv_k="fp8", kv_v="nvfp4", kv_k_debias=True
    ),
    "w4a16": dict(format="nvfp4", weights="fp4", activations="bf16", kv="bf16"),
    "w4a4 all linears": dict(format="nvfp4", weights="fp4", activations="fp4", kv="bf16", targets=list(ALL_LINEARS)),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_streamed_layers_equal_the_per_kernel_path(wide2, name, monkeypatch):
    policy = POLICIES[name]
    widest = 8 if name == "w4a4 all linears" else 4  # W4A4 tiles serve 8 rows, BF16 and W4A16 4
    prompts = [[3 + 5 * i, 7, 11 + i] for i in range(widest)]
    got, rec_got, pages_got, calls = _generate(wide2, policy, prompts, True, monkeypatch)
    want, rec_want, pages_want, _ = _generate(wide2, policy, prompts, False, monkeypatch)
    # every decode step of the batch (widest rows, then fewer as none finish early: all) ran both
    # layers in one call; prefill (3 rows) streams too where it fits
    assert (2, widest) in calls and all(n == 2 for n, _ in calls), calls
    for a, b in zip(got, want):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert len(pages_got) == len(pages_want) >= 2
    for a, b in zip(pages_got, pages_want):
        assert torch.equal(a, b)
    sides = (policy.get("kv_k") or policy.get("kv"), policy.get("kv_v") or policy.get("kv"))
    guided = "fp8" not in sides and (policy["activations"] == "fp4" or any(f != "bf16" for f in sides))
    assert len(rec_got) == len(rec_want) == (widest if guided else 0)
    for ra, rb in zip(rec_got, rec_want):
        assert sorted(ra.sites) == sorted(rb.sites) and ra.sites
        for site, sa in ra.sites.items():
            sb = rb.sites[site]
            for field in ("scale", "global_scale", "payload"):
                assert torch.equal(getattr(sa, field), getattr(sb, field)), (site, field)


def test_model_info_says_how_each_layer_runs(wide2):
    """A layout the one-call paths do not take (MXFP4 pages) is visible, not silent."""
    for kv, want in (("nvfp4", "2 streamed (<= 4 rows; wider: per kernel)"), ("mxfp4", "2 per kernel")):
        eng = Engine(str(wide2), dtype="bfloat16", quantization="nvfp4", kv_cache_dtype=kv, max_total_tokens=256)
        try:
            assert eng.get_model_info()["cpu_layers"] == want
        finally:
            eng.shutdown()


def test_wider_batches_take_the_per_kernel_path(wide2, monkeypatch):
    """Five rows: above the BF16 attention linears' streaming width, so no streamed call."""
    prompts = [[3 + i] for i in range(5)]
    got, _, _, calls = _generate(wide2, POLICIES["w4a4+nvfp4kv"], prompts, True, monkeypatch)
    assert calls == [] and all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in got)


def test_static_activation_scales_stream_and_log_every_row(wide2, monkeypatch):
    """A static S_enc (one per linear) quantizes each row with that scale; the log gets it per row."""
    policy = dict(POLICIES["w4a4+nvfp4kv"], activation_scale="static")

    def with_scales(stream):
        from sglang_backend.local import engine as engine_mod

        real_init = engine_mod.Engine.__init__

        def init(self, *a, **k):
            real_init(self, *a, **k)
            for i, lin in enumerate(self.model.linears()):
                if lin.act_fmt == "nvfp4":
                    lin.input_global_scale = torch.tensor(448.0 * 6 / (2.0 + i), dtype=torch.float32)

        with monkeypatch.context() as m:
            m.setattr(engine_mod.Engine, "__init__", init)
            return _generate(wide2, policy, [[5, 6, 7], [9, 10]], stream, monkeypatch)

    got, rec_got, _, calls = with_scales(True)
    want, rec_want, _, _ = with_scales(False)
    assert calls
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for ra, rb in zip(rec_got, rec_want):
        for site, sa in ra.sites.items():
            for field in ("scale", "global_scale", "payload"):
                assert torch.equal(getattr(sa, field), getattr(rb.sites[site], field)), (site, field)


@pytest.mark.parametrize("mode", ["stream", "one_call"])
def test_a_shut_down_engine_frees_its_layers(wide2, tmp_path, mode):
    """layer_c caches each layer's C arguments in a WeakKeyDictionary; a plan that held its layer
    strongly kept every engine ever built alive (the quality gate's BF16 and FP4 engines: 5 GB of
    weights and KV pages under the 0.5B trainer). Once shut down and dropped, nothing keeps a layer."""
    import gc
    import weakref

    # one_call: a layer small enough for the single-threaded GEMM (the wide one streams)
    path = wide2 if mode == "stream" else make_tiny_checkpoint(tmp_path, "qwen2", seed=3, dtype="bfloat16")
    eng = Engine(str(path), dtype="bfloat16", quant_policy=QuantPolicy.from_dict(POLICIES["w4a4+nvfp4kv"]))
    eng.generate(input_ids=[[1, 2, 3]], sampling_params=GREEDY)
    assert eng.model.run_plan(eng.kv).modes(1, [None] * len(eng.model.layers))[0] == mode
    planned = [layer for layer in eng.model.layers if layer in layer_c._C_ARGS]
    assert len(planned) == len(eng.model.layers)  # the C path ran and cached every layer's plan
    refs = [weakref.ref(layer) for layer in planned] + [weakref.ref(eng.kv)]
    eng.shutdown()
    del eng, planned
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
