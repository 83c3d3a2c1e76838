"""Routed expert ids from the rollout (routing replay's input), in SGLang's one format.

The embedded engine's ids are checked against HF transformers' router (the model reference) at
every prompt and response position; the wire form against SGLang 0.5.23's own encoder and decoder
(`DetokenizerManager._b64_encode_per_request`, `extract_routed_experts_from_meta_info`); a real
SGLang server's ids: tests/test_sglang_real_routing.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.guidance import decode_routed_experts, encode_routed_experts
from megatron_trace.models import ModelArch, make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, GenerateResult, SamplingParams
from sglang_backend.local import Engine
from tests.helpers import hf_topk

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13]]
NEW = 6


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3)


@pytest.fixture(scope="module")
def engine(moe_ckpt):
    eng = Engine(str(moe_ckpt))
    yield eng
    eng.shutdown()


def test_engine_routed_experts_are_hf_router_topk_at_every_position(moe_ckpt, engine):
    arch = ModelArch.from_hf_config(moe_ckpt)
    params = {"temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True, "n": 2, "sampling_seed": 5}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, return_routed_experts=True)
    assert len(outs) == 4
    for i, out in enumerate(outs):
        tokens = PROMPTS[i // 2] + out["output_ids"]
        ids = decode_routed_experts(
            out["meta_info"]["routed_experts"],
            len(tokens) - 1,
            arch.num_layers,
            arch.num_experts_per_tok,
            arch.num_experts,
        )
        ref = hf_topk(moe_ckpt, tokens[:-1], arch.num_experts_per_tok)  # [T, layers, k]
        # same experts in the same top-k order (slot order names the down_proj guidance slot)
        assert torch.equal(ids, ref.to(torch.int32))


def test_routed_experts_through_http_equal_in_process(moe_ckpt, engine):
    from sglang_backend.client import RolloutClient
    from sglang_backend.local import InProcessBackend
    from sglang_backend.local.server import serve

    req = GenerateRequest(
        PROMPTS[0], SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True), return_routed_experts=True
    )
    local = InProcessBackend(engine).generate([req])[0]
    srv = serve(engine)
    try:
        remote = RolloutClient([srv.url]).generate([req])[0]
    finally:
        srv.shutdown()
    # in process: the engine's [T, layers, top_k] tensor; over HTTP: the same ids, decoded flat by the client
    assert local.routed_experts.shape == (
        len(PROMPTS[0]) + NEW - 1,
        engine.arch.num_layers,
        engine.arch.num_experts_per_tok,
    )
    assert remote.routed_experts is not None and torch.equal(remote.routed_experts, local.routed_experts.reshape(-1))
    plain = InProcessBackend(engine).generate([GenerateRequest(PROMPTS[0], req.sampling_params)])[0]
    assert plain.routed_experts is None  # only when asked, as SGLang


def test_dense_model_refuses_routed_experts(tmp_path):
    eng = Engine(str(make_tiny_checkpoint(tmp_path, "qwen2", seed=0)))
    try:
        with pytest.raises(ValueError, match="return_routed_experts needs an MoE model"):
            eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, return_routed_experts=True)
    finally:
        eng.shutdown()


def test_sglang_encoder_and_decoder_agree_with_ours(moe_ckpt, engine):
    """SGLang's detokenizer encodes get_topk's int32 [seqlen - 1, layers, top_k] tensor; its
    `extract_routed_experts_from_meta_info` decodes a response. Both against our format."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    arch = ModelArch.from_hf_config(moe_ckpt)
    ids = torch.randint(0, arch.num_experts, (9, arch.num_layers, arch.num_experts_per_tok), dtype=torch.int32)
    (wire,) = DetokenizerManager._b64_encode_per_request([ids])
    meta = {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 5, "routed_experts": wire}
    res = GenerateResult.from_sglang({"output_ids": [1, 2, 3, 4, 5], "meta_info": meta})
    got = decode_routed_experts(res.routed_experts, 9, arch.num_layers, arch.num_experts_per_tok, arch.num_experts)
    assert torch.equal(got, ids)
    out = engine.generate(
        input_ids=PROMPTS[1], sampling_params={"max_new_tokens": NEW, "ignore_eos": True}, return_routed_experts=True
    )
    flat = extract_routed_experts_from_meta_info(out)
    ours = decode_routed_experts(
        out["meta_info"]["routed_experts"], len(PROMPTS[1]) + NEW - 1, arch.num_layers, arch.num_experts_per_tok
    )
    assert torch.equal(torch.from_numpy(flat.copy()), ours.reshape(-1))


@settings(max_examples=30, deadline=None)
@given(t=st.integers(0, 12), layers=st.integers(1, 5), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_encode_decode_round_trip(t, layers, k, seed):
    ids = torch.randint(0, 64, (t, layers, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    assert torch.equal(decode_routed_experts(encode_routed_experts(ids), t, layers, k, 64), ids)


def test_decode_names_what_is_wrong():
    ids = torch.tensor([[[0, 3]], [[1, 2]]], dtype=torch.int32)
    wire = encode_routed_experts(ids)
    with pytest.raises(ValueError, match=r"holds 4 int32 ids; the sample needs 3 positions x 1 layers x top-2 = 6"):
        decode_routed_experts(wire, 3, 1, 2, sample="s7")
    with pytest.raises(ValueError, match=r"ids span \[0, 3\]; the model has experts 0..2"):
        decode_routed_experts(wire, 2, 1, 2, num_experts=3)
    with pytest.raises(ValueError, match="not valid base64"):
        decode_routed_experts("@@@", 2, 1, 2)
    with pytest.raises(ValueError, match=r"must be \[positions, layers, top_k\]"):
        encode_routed_experts(ids[0])
