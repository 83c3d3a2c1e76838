"""Routed experts from a real SGLang 0.5.23 server (CPU engine, through our launcher with
--enable-return-routed-experts; the plugin unpins the host buffer SGLang would cudaHostRegister)
against the embedded engine and HF transformers' router, through our client. One server start
(~1 min on 2 cores): the only place the real capture path (RoutedExpertsCapturer -> detokenizer
base64 -> meta_info.routed_experts) runs."""
from __future__ import annotations

import pytest
import torch

import sglang  # noqa: F401 - the test command installs it: no import, no pass
from megatron_trace.guidance import decode_routed_experts
from megatron_trace.models import ModelArch, make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine, InProcessBackend
from tests.sglang_server import start_sglang
from tests.test_routing_rollout import _hf_topk

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 3, 99]]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3))


@pytest.fixture(scope="module")
def sglang_url(moe_ckpt, tmp_path_factory):
    yield from start_sglang(moe_ckpt, tmp_path_factory, "--enable-return-routed-experts")


def test_real_sglang_routed_experts_equal_the_engine_and_hf(moe_ckpt, sglang_url):
    arch = ModelArch.from_hf_config(moe_ckpt)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
                            return_routed_experts=True) for p in PROMPTS]
    real = RolloutClient([sglang_url]).generate(reqs)
    eng = Engine(moe_ckpt)
    try:
        ours = InProcessBackend(eng).generate(reqs)
    finally:
        eng.shutdown()
    for p, r, o in zip(PROMPTS, real, ours):
        assert r.output_ids == o.output_ids  # the same greedy tokens on both stacks
        tokens = p + r.output_ids
        ids = decode_routed_experts(r.routed_experts, len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok,
                                    arch.num_experts)
        mine = decode_routed_experts(o.routed_experts, len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok)
        ref = _hf_topk(moe_ckpt, tokens[:-1], arch.num_experts_per_tok).to(torch.int32)
        assert torch.equal(ids, ref) and torch.equal(mine, ref)  # same experts, same top-k order
    plain = RolloutClient([sglang_url]).generate([GenerateRequest(PROMPTS[0], reqs[0].sampling_params)])[0]
    assert plain.routed_experts is None  # only when asked
