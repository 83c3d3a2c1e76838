"""FP4 in the engine: bit-equality with the fp4 reference, determinism, batching, guidance."""

import threading

import pytest
import torch
from safetensors.torch import save_file

from megatron_trace.fp4 import nvfp4, to_modelopt_fused
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from sglang_backend.local import Engine
from sglang_backend.local.kv_cache import PagedKVCache

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), "qwen2", seed=1)


@pytest.fixture(scope="module")
def fp4_engine(ckpt):
    eng = Engine(str(ckpt), quantization="nvfp4", kv_cache_dtype="nvfp4", guidance_mode="full")
    yield eng
    eng.shutdown()


def test_quantized_linear_matches_reference_bit_for_bit(fp4_engine, ckpt):
    from safetensors.torch import load_file

    hf = load_file(str(ckpt / "model.safetensors"))
    lin = fp4_engine.model.layers[1].gate_up
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    ref = nvfp4.quantize(torch.cat([gate, up]))  # one global amax over the fused shards
    assert torch.equal(lin.qweight.data, ref.data) and torch.equal(lin.qweight.scale, ref.scale)
    assert torch.equal(lin.weight, nvfp4.dequantize(ref))
    x = torch.randn(5, lin.in_features)
    seen = {}
    y = lin(x, capture=lambda site, q: seen.setdefault(site, q))
    q = nvfp4.quantize(x, per_row_global=True)
    got = seen["model.layers.1.mlp.gate_up_proj"]
    assert torch.equal(got.data, q.data) and torch.equal(got.scale, q.scale)
    assert torch.equal(y, torch.nn.functional.linear(nvfp4.dequantize(q), lin.weight))
    assert fp4_engine.model.layers[1].qkv.qweight is None  # attention stays BF16 by default policy


def test_kv_pages_hold_reference_codes():
    kv = PagedKVCache(
        num_layers=1, kv_heads=2, head_dim=32, num_pages=4, page_size=4, kv_dtype="nvfp4", dtype=torch.float32
    )
    x = torch.randn(6, 2, 32)
    slots = kv.slots(kv.allocate(2), 0, 6)
    back = kv.write(0, 0, slots, x)
    ref = nvfp4.quantize(x, global_scale=torch.tensor(1.0))
    assert torch.equal(kv.codes[0, 0, slots], ref.data) and torch.equal(kv.scales[0, 0, slots], ref.scale)
    assert torch.equal(back, nvfp4.dequantize(ref)) and torch.equal(kv.read(0, 0, slots), back)
    bf16 = PagedKVCache(
        num_layers=1, kv_heads=2, head_dim=32, num_pages=4, page_size=4, kv_dtype="bf16", dtype=torch.bfloat16
    )
    assert bf16.bytes_per_token() / kv.bytes_per_token() == pytest.approx(16 / 4.5)


def test_kv_scale_floats_follow_every_change_of_the_global_scale():
    kv = PagedKVCache(
        num_layers=2, kv_heads=2, head_dim=32, num_pages=4, page_size=4, kv_dtype="nvfp4", dtype=torch.float32
    )
    dec, enc = kv.scales_as_floats()
    assert enc == [(1.0, 1.0), (1.0, 1.0)] and dec == nvfp4.decode_scale(kv.global_scale).tolist()
    with torch.inference_mode():  # where the engine runs
        kv.global_scale[1, 0] = 4.0
    dec, enc = kv.scales_as_floats()
    assert enc == [(1.0, 1.0), (4.0, 1.0)] and dec == nvfp4.decode_scale(kv.global_scale).tolist()


def test_fp4_greedy_is_deterministic_and_batching_does_not_change_it(fp4_engine):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43]]
    a = fp4_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    b = fp4_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    alone = [fp4_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    assert alone == [o["output_ids"] for o in a]


def test_requests_join_a_running_batch(fp4_engine):
    results = {}

    def run(i, prompt, n_new):
        results[i] = fp4_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": n_new})

    threads = [threading.Thread(target=run, args=(i, [i + 1, i + 2, i + 3], 4 + 4 * i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(results[i]["output_ids"]) for i in range(4)] == [4, 8, 12, 16]


def test_n_samples_share_prefill_and_seeds_are_per_sample(fp4_engine):
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 123}
    many = fp4_engine.generate(input_ids=[5, 6, 7, 8], sampling_params={**params, "n": 3}, return_logprob=True)
    assert len(many) == 3
    for i, out in enumerate(many):
        single = fp4_engine.generate(
            input_ids=[5, 6, 7, 8], sampling_params={**params, "sampling_seed": 123 + i}, return_logprob=True
        )
        assert out["output_ids"] == single["output_ids"]
        # Batch size changes the GEMM blocking, so logprobs agree to fp32 rounding, not bitwise.
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        want = [t[0] for t in single["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)
    assert len({tuple(o["output_ids"]) for o in many}) > 1


def test_guidance_record_covers_prompt_and_response(fp4_engine):
    out = fp4_engine.generate(input_ids=[3, 4, 5, 6], sampling_params=GREEDY, return_guidance=True)
    rec = fp4_engine.fetch_guidance(out["meta_info"]["guidance_handle"])
    assert rec.num_positions == 4 + 8 - 1 and rec.mode == "full"
    layers = {int(s.split(".")[2]) for s in rec.sites}
    assert layers == {2, 3}  # default: the last half of 4 layers
    assert {s.rsplit(".", 1)[1] for s in rec.sites} == {"gate_up_proj", "down_proj", "k_cache", "v_cache"}
    rec.validate()
    # The K codes recorded for the prompt are the ones the cache held.
    k = rec.sites["model.layers.3.self_attn.k_cache"]
    assert k.payload.shape == (11, 2, fp4_engine.arch.head_dim // 2) and k.global_scale.dim() == 0
    with pytest.raises(KeyError):
        fp4_engine.fetch_guidance(out["meta_info"]["guidance_handle"])


def test_modelopt_checkpoint_loads_to_the_same_weights(ckpt, tmp_path, fp4_engine):
    import shutil

    from safetensors.torch import load_file

    hf = load_file(str(ckpt / "model.safetensors"))
    arch = ModelArch.from_hf_config(ckpt)
    policy = QuantPolicy(kv="bf16")
    out = dict(hf)
    for group in sorted(set(policy.fused_groups(arch).values())):
        parent, leaf = group.rsplit(".", 1)
        names = [f"{parent}.gate_proj", f"{parent}.up_proj"] if leaf == "gate_up_proj" else [group]
        for name, t in zip(names, to_modelopt_fused([hf[f"{n}.weight"] for n in names])):
            for k, v in t.items():
                out[f"{name}.{k}"] = v
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4", "group_size": 16}}')
    eng = Engine(str(tmp_path), kv_cache_dtype="nvfp4")
    try:
        for a, b in zip(eng.model.linears(), fp4_engine.model.linears()):
            assert torch.equal(a.weight, b.weight), a.site
        prompt = [7, 7, 8]
        assert (
            eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
            == fp4_engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        )
    finally:
        eng.shutdown()


def test_bad_requests_are_refused(fp4_engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fp4_engine.generate(input_ids=[1, 10**6], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="sampling_seed"):
        fp4_engine.generate(input_ids=[1, 2], sampling_params={"seed": 1})
    ok, msg = fp4_engine.update_weights_from_tensor({"model.norm.weight": torch.full((64,), float("nan"))})
    assert not ok and "NaN" in msg
