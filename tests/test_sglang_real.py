"""A real SGLang 0.5.23 server with our plugin against the embedded engine, through our client.

One real server for the module, started the way a user starts it (`python -m
sglang_backend.launch --backend sglang`: SGLang's CPU engine, online NVFP4 W4A4 of a tiny fp32
checkpoint by the plugin, full-code guidance of the last half of the layers, radix cache on),
and one embedded server over the same checkpoint and flags. The test command installs SGLang
(scripts/sglang_cpu/install.sh), so a missing SGLang fails this module instead of skipping it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import sgl_kernel  # the real CUDA build, or on CPU the stand-in from scripts/sglang_cpu
import sglang  # noqa: F401 - the test command installs it: no import, no pass
import torch

from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.api import GUIDANCE_KEY, GenerateRequest, SamplingParams
from sglang_backend.client import RolloutClient, RolloutError
from sglang_backend.local import Engine
from sglang_backend.local.server import serve
from tests.sglang_server import PREFIX, PROMPTS, check_agreement, greedy, guidance_agreement, start_sglang


def _post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def sglang_url(ckpt, tmp_path_factory):
    yield from start_sglang(ckpt, tmp_path_factory, "--quantization", "nvfp4", "--guidance-mode", "full")


@pytest.fixture(scope="module")
def embedded_url(ckpt):
    engine = Engine(ckpt, quantization="nvfp4", guidance_mode="full", guided_layers="last_half")
    srv = serve(engine)
    yield srv.url
    srv.shutdown()
    engine.shutdown()


@pytest.fixture(scope="module")
def clients(sglang_url, embedded_url):
    pair = RolloutClient(sglang_url, retries=0), RolloutClient(embedded_url, retries=0)
    yield pair
    for c in pair:
        c.close()


def test_greedy_tokens_and_logprobs_match_the_embedded_engine(clients):
    sg, emb = clients
    reqs = [GenerateRequest(p, greedy(), rid=f"g{i}") for i, p in enumerate(PROMPTS)]
    a, b = sg.generate(reqs), emb.generate(reqs)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.output_logprobs, rb.output_logprobs))
    assert worst <= 1e-5, worst
    assert all(len(r.output_logprobs) == 8 and r.finish_reason["type"] == "length" for r in a)
    assert [r.rid for r in a] == ["g0", "g1", "g2"] and all(r.prompt_tokens == len(p) for r, p in zip(a, PROMPTS))


def test_client_contract_on_real_sglang(clients, sglang_url):
    sg, emb = clients
    assert sg.weight_versions() == {sglang_url: "0"} and set(emb.weight_versions().values()) == {"0"}
    res = sg.generate([GenerateRequest([9, 9, 9], greedy(max_new_tokens=2))])[0]
    assert res.weight_version == "0" and isinstance(res.weight_version, str)
    info = sg.model_info()
    assert info["weight_version"] == "0" and "paused" not in info  # none of the embedded extras
    sg.pause()
    sg.resume()
    sg.flush_cache()
    assert sg.health()
    again = sg.generate([GenerateRequest([9, 9, 9], greedy(max_new_tokens=2))])[0]
    assert again.output_ids == res.output_ids


def test_top_p_logprobs_are_the_sampled_distributions_on_both_stacks(clients, sglang_url):
    """Under top-p the client records the logprob of the filtered distribution the token was drawn
    from (SGLang: return_sampling_mask's "selected" logprob; the engine: api.support_logprob). With a
    nucleus of one token both stacks must sample the greedy token with logprob exactly 0."""
    sg, emb = clients
    # top_k too: SGLang returns filtered logprobs only for top_k <= --sampling-mask-max-tokens (4096)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.01, top_k=50, sampling_seed=3, ignore_eos=True)
    a = sg.generate([GenerateRequest(p, sp, rid=f"tp{i}") for i, p in enumerate(PROMPTS)])
    b = emb.generate([GenerateRequest(p, sp, rid=f"tp{i}") for i, p in enumerate(PROMPTS)])
    g = emb.generate([GenerateRequest(p, greedy(max_new_tokens=6)) for p in PROMPTS])
    assert [r.output_ids for r in a] == [r.output_ids for r in b] == [r.output_ids for r in g]
    assert all(abs(lp) <= 1e-6 for r in a + b for lp in r.output_logprobs)
    # SGLang's plain output_token_logprobs are the unfiltered softmax: not what the sample was drawn from
    status, body = _post(
        sglang_url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": sp.to_dict(), "return_logprob": True}
    )
    assert status == 200 and max(t[0] for t in json.loads(body)["meta_info"]["output_token_logprobs"]) < -1e-3


def test_guidance_records_match_the_embedded_engine(clients, sglang_url):
    """n = 1 and n = 2, a prompt whose prefix the radix cache already holds: every sample's record
    has the embedded engine's sites, positions and layout, and its codes, E4M3 scales and per-token
    S_enc agree with the engine's (>= 99.9% equal bytes, S_enc within 1e-5 relative)."""
    sg, emb = clients
    # warm the radix cache with the shared prefix, then ask for guidance of prompts that reuse it
    sg.generate([GenerateRequest(PREFIX + [99], greedy(max_new_tokens=1))])
    status, body = _post(
        sglang_url,
        "/generate",
        {
            "input_ids": PREFIX + [60, 61],
            "rid": "radix-1",
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": {GUIDANCE_KEY: True},
            },
        },
    )
    assert status == 200, body
    assert json.loads(body)["meta_info"]["cached_tokens"] >= len(PREFIX)  # the prefix came from the radix cache
    want = emb.generate(
        [GenerateRequest(PREFIX + [60, 61], greedy(max_new_tokens=6), rid="radix-1", return_guidance=True)]
    )[0]
    ref = emb.fetch_guidance(want.guidance_handle)
    got = sg.fetch_guidance("radix-1")
    assert ref.num_positions == len(PREFIX) + 2 + 6 - 1
    check_agreement(guidance_agreement(got, ref))

    reqs = [
        GenerateRequest(PROMPTS[0], greedy(n=2, max_new_tokens=5), rid="multi", return_guidance=True),
        GenerateRequest(PROMPTS[2], greedy(max_new_tokens=5), rid="single", return_guidance=True),
    ]
    a, b = sg.generate(reqs), emb.generate(reqs)
    assert len(a) == len(b) == 3 and [r.output_ids for r in a] == [r.output_ids for r in b]
    for ra, rb in zip(a, b):
        mine, theirs = sg.fetch_guidance(ra.guidance_handle), emb.fetch_guidance(rb.guidance_handle)
        rec = mine
        assert set(rec.sites) == {f"model.layers.{i}.mlp.{s}" for i in (2, 3) for s in ("gate_up_proj", "down_proj")}
        assert rec.sample_id == ra.rid  # SGLang names n > 1 samples with fresh uuids, the engine "<rid>-<i>"
        check_agreement(guidance_agreement(mine, theirs))


def test_get_guidance_unknown_or_fetched_rid_is_404_json(clients, sglang_url, embedded_url):
    sg, _ = clients
    r = sg.generate([GenerateRequest([4, 4, 2], greedy(max_new_tokens=2), rid="once", return_guidance=True)])[0]
    assert r.guidance_handle == "once" and sg.fetch_guidance("once").num_positions == 3 + 2 - 1
    for url in (sglang_url, embedded_url):
        for rid in ("once" if url == sglang_url else "never-was", "no-such-rid"):
            status, body = _post(url, "/get_guidance", {"rid": rid})
            assert status == 404 and "error" in json.loads(body), (url, rid, body)
    with pytest.raises(RolloutError) as e:
        sg.fetch_guidance("once")
    assert e.value.status == 404


@pytest.mark.skipif(not getattr(sgl_kernel, "STAND_IN", False), reason="the real (CUDA) sgl_kernel is installed here")
def test_sgl_kernel_stand_in_has_one_kernel_and_raises_on_the_rest():
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 0]),
        torch.tensor([4, 2]),
        torch.tensor([10, 11, 12, 20, 21]),
        8,
    )
    assert req_to_token[2, 1:4].tolist() == [10, 11, 12] and req_to_token[0, :2].tolist() == [20, 21]
    assert int(req_to_token.count_nonzero()) == 5
    with pytest.raises(NotImplementedError, match="rmsnorm_cpu is a CUDA kernel"):
        sgl_kernel.rmsnorm_cpu(torch.ones(2, 4), torch.ones(4), 1e-6)


@pytest.mark.parametrize("linear", [True, False])
def test_kv_quantize_and_store_takes_sglang_0523_scale_layouts(linear):
    """The plugin's NVFP4 KV write with 0.5.23's arguments: linear scales, or SM100's native layout
    (no linear buffers) whose V interleave is checked against SGLang's own reference indices."""
    from sglang.srt.layers.quantization.nvfp4_kv_cache import nvfp4_v_scale_swizzle_indices

    from sglang_backend.plugin.kv_capture import TraceNVFP4KVMethod, quantize_kv

    pages, page_size, heads, d = 3, 8, 2, 64
    method = TraceNVFP4KVMethod(num_layers=1)
    method.page_size = page_size
    bufs = method.create_buffers(pages * page_size, heads, d, 1, "cpu")
    native = [torch.zeros(pages, heads, page_size, d // 16, dtype=torch.uint8) for _ in range(2)]
    k, v = torch.randn(5, heads, d), torch.randn(5, heads, d) * 3
    loc = torch.tensor([1, 6, 9, 15, 20])
    scales = (bufs["k_scale_buffer"][0], bufs["v_scale_buffer"][0]) if linear else (None, None)
    method.quantize_and_store(
        bufs["k_buffer"][0],
        bufs["v_buffer"][0],
        *scales,
        loc,
        k,
        v,
        native_k_scale_buffer=native[0],
        native_v_scale_buffer=native[1],
    )
    qk, qv = quantize_kv(k, None), quantize_kv(v, None)
    assert torch.equal(bufs["k_buffer"][0][loc], qk.data) and torch.equal(bufs["v_buffer"][0][loc], qv.data)
    if linear:
        assert torch.equal(scales[0][loc], qk.scale) and torch.equal(scales[1][loc], qv.scale)
    page, tok = loc // page_size, loc % page_size
    assert torch.equal(native[0][page, :, tok], qk.scale)
    cols = torch.arange(d // 16)
    for t in range(loc.numel()):
        row, pos = nvfp4_v_scale_swizzle_indices(tok[t].expand(d // 16), cols, d // 16)
        assert torch.equal(native[1][int(page[t])][:, row, pos], qv.scale[t]), t  # [heads, D/16]
    with pytest.raises(ValueError, match="given together"):
        method.quantize_and_store(bufs["k_buffer"][0], bufs["v_buffer"][0], bufs["k_scale_buffer"][0], None, loc, k, v)


def test_trainer_update_in_modelopt_layout_into_the_online_server(clients, sglang_url, embedded_url, tmp_path):
    """Last in the module (it changes the served weights): the trainer's weight sync sends ModelOpt
    tensors (packed codes, E4M3 scales, weight_scale_2) quantized on its side; the online trace_nvfp4
    server takes them over the distributed transport and then serves those bits: its greedy tokens
    and logprobs equal the embedded server's after the same push."""
    sg, emb = clients
    before = sg.generate([GenerateRequest(PROMPTS[0], greedy())])[0]
    _push_next_weights(sglang_url, emb, tmp_path, version=7)
    reqs = [GenerateRequest(p, greedy(), rid=f"u{i}") for i, p in enumerate(PROMPTS)]
    a, b = sg.generate(reqs), emb.generate(reqs)
    assert {r.weight_version for r in a + b} == {"7"}
    assert [r.output_ids for r in a] == [r.output_ids for r in b] and a[0].output_ids != before.output_ids
    worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.output_logprobs, rb.output_logprobs))
    assert worst <= 1e-5, worst


def test_release_and_resume_memory_occupation_on_both_stacks(clients, sglang_url, tmp_path):
    """SGLang's own endpoints, what rollout.colocated=on calls around a train phase: release the KV cache
    and weights, resume, refill by a weight push (as the run's sync does), and both stacks serve what
    they served before. SGLang's CPU server keeps its memory (its memory saver is the no-op adapter:
    torch_memory_saver is CUDA-only); the embedded engine frees it (tests/test_engine_sleep.py)."""
    sg, emb = clients
    reqs = [GenerateRequest(p, greedy(), rid=f"m{i}") for i, p in enumerate(PROMPTS)]
    before = [[r.output_ids for r in c.generate(reqs)] for c in clients]
    assert before[0] == before[1]
    for c in clients:
        c.release_memory_occupation(["kv_cache", "weights"])
    with pytest.raises(RolloutError, match="memory is released"):
        emb.generate(reqs[:1])
    for c in clients:
        c.resume_memory_occupation(["weights", "kv_cache"])
    _push_next_weights(sglang_url, emb, tmp_path, version=8)  # what the last push left, again: a refill
    after = [c.generate(reqs) for c in clients]
    assert [[r.output_ids for r in a] for a in after] == before
    assert {r.weight_version for a in after for r in a} == {"8"}


def _push_next_weights(sglang_url: str, emb: RolloutClient, tmp_path, version: int) -> None:
    """Another checkpoint's weights, as the trainer's sync sends them (ModelOpt NVFP4 quantized on the
    sending side), to the SGLang server over the distributed transport and to the embedded one over HTTP."""
    from megatron_trace.transfer.export import load_hf_dir
    from megatron_trace.transfer.pipeline import push_hf_state_dict
    from megatron_trace.transfer.transports import DistributedTransport, HttpTransport
    from sglang_backend.local.quant_flags import policy_for
    from tests.ports import free_port

    arch, sd, _ = load_hf_dir(make_tiny_checkpoint(tmp_path / "next", "qwen2", seed=4))
    policy = policy_for("nvfp4", "auto", tmp_path / "next")
    dist = DistributedTransport([sglang_url], master_port=free_port(), timeout_s=120)
    try:
        push_hf_state_dict(sd, arch, policy, dist, version=version)
    finally:
        dist.close()
    push_hf_state_dict(sd, arch, policy, HttpTransport(emb), version=version)
