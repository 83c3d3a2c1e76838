"""FP4/FP8 KV through a real SGLang 0.5.23 server on CPU: the plugin's KV methods write the pages
with the project's quantizers and serve SGLang's torch_native attention through plain dequantized
reads (plugin/kv_read.py; K and V in their own formats: plugin/kv_sides.py). One real server per
KV setting, all three started at once (NVFP4 W4A4 weights, fp32, full-code guidance of the last
half), each compared with the embedded engine on the same checkpoint and policy. SGLang must be
installed (the test command installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang  # noqa: F401 - a missing SGLang fails this module, it is not skipped

from megatron_trace.models import QuantPolicy, make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine
from sglang_backend.local.quant_flags import policy_for
from tests.sglang_server import PROMPTS, check_agreement, guidance_agreement, start_sglang_servers

# (launcher KV flags, K format, V format, K de-biased)
SETTINGS = {
    "nvfp4": (("--kv-cache-dtype", "nvfp4"), "nvfp4", "nvfp4", False),
    "fp8k_nvfp4v": (("--kv-k", "fp8", "--kv-v", "nvfp4"), "fp8", "nvfp4", False),
    # K - RoPE_pos(k_proj bias) in the cache: the plugin's slot positions (plugin/kv_debias.py)
    "debiased_nvfp4": (("--kv-cache-dtype", "nvfp4", "--kv-k-debias"), "nvfp4", "nvfp4", True),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("q2kv"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """One real server per setting, all started at once."""
    yield from start_sglang_servers(
        ckpt,
        tmp_path_factory,
        {
            name: ("--quantization", "nvfp4", "--guidance-mode", "full", *flags)
            for name, (flags, *_) in SETTINGS.items()
        },
    )


@pytest.fixture(scope="module", params=list(SETTINGS))
def setting(request, ckpt, servers):
    _, k_fmt, v_fmt, debias = SETTINGS[request.param]
    url = servers[request.param]
    base = policy_for("nvfp4", "bf16", Path(ckpt)).to_dict()
    engine = Engine(
        ckpt,
        quant_policy=QuantPolicy.from_dict({**base, "kv_k": k_fmt, "kv_v": v_fmt, "kv_k_debias": debias}),
        guidance_mode="full",
    )
    try:
        yield url, engine, (k_fmt, v_fmt)
    finally:
        engine.shutdown()


def test_greedy_matches_the_embedded_engine_and_differs_from_bf16_pages(ckpt, setting):
    url, engine, sides = setting
    client = RolloutClient(url, retries=0)
    served = client.trace_policy(url)
    assert served["kv_k_debias"] == engine.policy.kv_k_debias and served["guided_layers"] == [2, 3], served
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    got = client.generate([GenerateRequest(p, params, rid=f"kv{i}") for i, p in enumerate(PROMPTS)])
    bf16_kv = Engine(ckpt, quantization="nvfp4")
    try:
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        want = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
        plain = bf16_kv.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
    finally:
        bf16_kv.shutdown()
    assert engine.kv.side_fmt == sides
    assert [r.output_ids for r in got] == [w["output_ids"] for w in want]
    diffs = sorted(
        abs(r.output_logprobs[j] - w["meta_info"]["output_token_logprobs"][j][0])
        for r, w in zip(got, want)
        for j in range(8)
    )
    # The stacks' fp32 sums (SGLang's torch kernels, the engine's C kernels: integer W4A4 decode) agree
    # to ulps; a value at a rounding boundary of its FP4/FP8 grid may still flip, which moves that one
    # position's logprob by ~1e-4 (seen once in 24 positions with FP8 K). Everything else is within 1e-5.
    print("logprob differences", sides, diffs[-3:])
    assert diffs[-2] <= 1e-5 and diffs[-1] <= 1e-3, (sides, diffs[-3:])
    # the pages really are quantized: BF16 pages give other logprobs
    gap = max(
        abs(r.output_logprobs[j] - p["meta_info"]["output_token_logprobs"][j][0])
        for r, p in zip(got, plain)
        for j in range(8)
    )
    assert gap > 1e-3, (sides, gap)


def test_guidance_records_carry_the_quantized_kv_sites_as_the_engine_does(setting):
    """The record of a real-SGLang sample has the engine's sites, K/V included for each quantized side
    (FP8 too; a BF16 side records nothing on either stack), with >= 99.9% equal bytes."""
    url, engine, sides = setting
    client = RolloutClient(url, retries=0)
    req = GenerateRequest(
        PROMPTS[2],
        SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
        rid=f"kvg-{'-'.join(sides)}",
        return_guidance=True,
    )
    res = client.generate([req])[0]
    mine = client.fetch_guidance(res.guidance_handle)
    out = engine.wait(engine.submit(req))[0]
    assert out.output_ids == res.output_ids
    theirs = engine.fetch_guidance(req.rid)
    kv_sites = {s for s in mine.sites if s.endswith(("k_cache", "v_cache"))}
    assert kv_sites == {
        f"model.layers.{i}.self_attn.{n}_cache" for i in (2, 3) for n, f in zip("kv", sides) if f != "bf16"
    }
    check_agreement(guidance_agreement(mine, theirs))
