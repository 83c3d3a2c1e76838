"""The embedded engine with FP4 off against HF transformers (the model reference), fp32."""

import pytest
import torch

from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.local import Engine

pytestmark = pytest.mark.isa_avx2

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13], [200, 17, 5, 9, 31]]
NEW = 10


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "qwen3_moe"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def _hf_greedy(path, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    return ids, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]


def test_greedy_tokens_and_logprobs_match_hf(ckpt):
    eng = Engine(str(ckpt))
    try:
        outs = eng.generate(
            input_ids=PROMPTS,
            sampling_params={"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
            return_logprob=True,
        )
    finally:
        eng.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        ids, lps = _hf_greedy(ckpt, prompt)
        assert out["output_ids"] == ids
        mine = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert [t[1] for t in out["meta_info"]["output_token_logprobs"]] == ids
        assert max(abs(a - b) for a, b in zip(mine, lps)) <= 1e-4
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}


@pytest.mark.parametrize("kv, quant", [("auto", None), ("nvfp4", "nvfp4"), ("mxfp4", None)])
def test_fused_cpu_path_equals_the_torch_reference_path(ckpt, kv, quant, monkeypatch):
    """The C-kernel forward (the CPU default) against the model's torch ops (CUDA and fallback)."""
    from megatron_trace.kernels import cpu_fused
    from sglang_backend.local import run_plan

    if not cpu_fused.available():
        pytest.skip("no C compiler here")
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(run_plan, "fused", lambda model, kv: False)
        eng = Engine(str(ckpt), kv_cache_dtype=kv, quantization=quant)
        try:
            assert eng.model.run_plan(eng.kv).fused == fused
            runs.append(eng.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True))
        finally:
            eng.shutdown()
    for a, b in zip(*runs):
        assert a["output_ids"] == b["output_ids"]
        la, lb = ([t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in (a, b))
        assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-4


@pytest.mark.parametrize("mode", ["full", "mantissa"])
def test_guidance_from_the_c_layer_equals_the_torch_path(ckpt, mode, monkeypatch):
    """Records written by the C layer straight into the guidance log against the torch path's
    quantizer outputs: same sites, positions and scales; codes agree but for rounding-boundary ties."""
    from megatron_trace.kernels import cpu_fused
    from sglang_backend.local import run_plan

    if not cpu_fused.available():
        pytest.skip("no C compiler here")
    recs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(run_plan, "fused", lambda model, kv: False)
        eng = Engine(str(ckpt), quantization="nvfp4", kv_cache_dtype="nvfp4", guidance_mode=mode, guided_layers="all")
        try:
            outs = eng.generate(
                input_ids=PROMPTS,
                sampling_params={"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                return_guidance=True,
            )
            recs.append([eng.fetch_guidance(o["meta_info"]["guidance_handle"]) for o in outs])
        finally:
            eng.shutdown()
    same = total = 0
    for a, b in zip(*recs):
        assert a.num_positions == b.num_positions and a.sites.keys() == b.sites.keys()
        for site in a.sites:
            x, y = a.sites[site], b.sites[site]
            assert x.payload.shape == y.payload.shape and x.global_scale.shape == y.global_scale.shape
            torch.testing.assert_close(x.global_scale, y.global_scale, rtol=1e-5, atol=0)
            same += int((x.payload == y.payload).sum()) + int((x.scale == y.scale).sum())
            total += x.payload.numel() + x.scale.numel()
    assert same / total >= 0.999, f"only {same}/{total} guidance bytes agree"


@pytest.mark.parametrize("static_act", [False, True], ids=["per-token-act", "static-act"])
def test_c_layer_guidance_through_log_growth_and_per_row_scales(ckpt, static_act, monkeypatch):
    """The C layer caches the log's row-0 addresses and offsets by the step's row: records stay
    equal to the torch path's while the log grows from 4 rows, and when a site under a static
    scale (KV; activations with static input scales) holds one S_enc per row (here: it was first
    opened under another scale) the C layer fills those rows with the scale."""
    from megatron_trace.kernels import cpu_fused
    from sglang_backend.local import run_plan
    from sglang_backend.local.guidance_log import GuidanceLog

    if not cpu_fused.available():
        pytest.skip("no C compiler here")
    recs, static_sites = [], set()
    for fused in (True, False):
        eng = Engine(str(ckpt), quantization="nvfp4", kv_cache_dtype="nvfp4", guidance_mode="full", guided_layers="all")
        try:
            if not fused:
                monkeypatch.setattr(run_plan, "fused", lambda model, kv: False)
            log = eng.scheduler.log = GuidanceLog("full", capacity=4)
            a, wrong = eng.arch, torch.tensor(-1.0)
            for layer in eng.model.layers:
                for site in layer.kv_sites:
                    log.pointers(
                        site, (a.num_kv_heads, a.head_dim // 2), (a.num_kv_heads, a.head_dim // 16), (), static_gs=wrong
                    )
                for name in ("qkv", "o_proj", "gate_up", "down") if static_act and not layer.moe else ():
                    lin = getattr(layer, name)
                    if lin.act_fmt != "nvfp4":  # (the default policy keeps attention inputs unquantized)
                        continue
                    lin.input_global_scale = torch.tensor(600.0)
                    static_sites.add(lin.site)
                    log.pointers(lin.site, (lin.in_features // 2,), (lin.in_features // 16,), (), static_gs=wrong)
            outs = eng.generate(
                input_ids=PROMPTS,
                sampling_params={"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                return_guidance=True,
            )
            recs.append([eng.fetch_guidance(o["meta_info"]["guidance_handle"]) for o in outs])
            kv_scales = eng.kv.global_scale.clone()
            grew = eng.scheduler.log.capacity > 4
        finally:
            eng.shutdown()
        assert grew
    same = total = 0
    for a, b in zip(*recs):
        for site in a.sites:
            x, y = a.sites[site], b.sites[site]
            torch.testing.assert_close(x.global_scale, y.global_scale, rtol=1e-5, atol=0)
            if site.endswith(("k_cache", "v_cache")):
                layer, which = int(site.split(".")[2]), int(site.endswith("v_cache"))
                assert x.global_scale.shape == (a.num_positions,)
                assert torch.all(x.global_scale == kv_scales[layer, which]), site
            elif site in static_sites:
                assert x.global_scale.shape == (a.num_positions,) and torch.all(x.global_scale == 600.0), site
            same += int((x.payload == y.payload).sum()) + int((x.scale == y.scale).sum())
            total += x.payload.numel() + x.scale.numel()
    assert same / total >= 0.999, f"only {same}/{total} guidance bytes agree"
