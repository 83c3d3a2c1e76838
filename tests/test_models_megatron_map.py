"""HF <-> Megatron-Core layout maps: bit-exact TP x PP x EP round trips on real tiny checkpoints."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megatron_trace.models import (  # noqa: E402
    ModelArch,
    hf_to_megatron,
    make_tiny_checkpoint,
    megatron_param_to_hf,
    megatron_to_hf,
    padded_vocab_size,
    pp_layer_range,
    tp_split_dim,
)
from megatron_trace.models.megatron_map import interleave_qkv, split_qkv  # noqa: E402

CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2_tied_bf16": ("qwen2", {"tie_word_embeddings": True, "dtype": "bfloat16"}),
    "qwen3": ("qwen3", {}),
    "qwen3_bias": ("qwen3", {"attention_bias": True}),
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [1]}),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cache: dict[str, tuple[ModelArch, dict, object]] = {}

    def get(case: str):
        if case not in cache:
            family, kw = CASES[case]
            path = make_tiny_checkpoint(tmp_path_factory.mktemp(case), family, seed=len(cache), **kw)
            cache[case] = (ModelArch.from_hf_config(path), load_file(str(path / "model.safetensors")), path)
        return cache[case]

    return get


def _all_shards(hf, arch, tp, pp, ep, **kw):
    return {
        (p, t, e): hf_to_megatron(hf, arch, tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=p, ep_size=ep, ep_rank=e, **kw)
        for p, t, e in itertools.product(range(pp), range(tp), range(ep))
    }


def _assert_same(got: dict, want: dict, arch: ModelArch):
    assert list(got) == list(arch.hf_param_shapes())
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), k  # bit patterns, not float equality


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _layouts(case):
    eps = (1, 2) if "moe" in case else (1,)
    return [(case, tp, pp, ep) for tp in (1, 2) for pp in (1, 2) for ep in eps]


@pytest.mark.parametrize("case,tp,pp,ep", [x for c in CASES for x in _layouts(c)])
def test_round_trip(ckpt, case, tp, pp, ep):
    arch, hf, _ = ckpt(case)
    shards = _all_shards(hf, arch, tp, pp, ep)
    _assert_same(megatron_to_hf(shards, arch, tp_size=tp, pp_size=pp, ep_size=ep), hf, arch)

    # Streaming path: gather one parameter across TP, convert it alone.
    streamed = {}
    per_ep = arch.num_experts // ep
    for p in range(pp):
        start, end = pp_layer_range(arch.num_layers, pp, p)
        for e in range(ep):
            for name in shards[(p, 0, e)]:
                dim = tp_split_dim(name)
                parts = [shards[(p, t, e)][name] for t in range(tp)]
                full = parts[0] if dim is None else torch.cat(parts, dim)
                n = tp if dim is not None else 1
                streamed.update(megatron_param_to_hf(name, full, arch, start, expert_offset=e * per_ep, tp_size=n))
    assert set(streamed) == set(hf)
    assert all(torch.equal(streamed[k], hf[k]) for k in hf)


@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe"])
def test_shard_shapes_and_placement(ckpt, case):
    arch, hf, _ = ckpt(case)
    tp, pp, ep = 2, 2, (2 if arch.is_moe else 1)
    shards = _all_shards(hf, arch, tp, pp, ep)
    hd, q_per = arch.head_dim, arch.num_heads // arch.num_kv_heads
    for (p, t, e), sd in shards.items():
        assert ("embedding.word_embeddings.weight" in sd) == (p == 0)
        assert ("decoder.final_layernorm.weight" in sd) == ("output_layer.weight" in sd) == (p == pp - 1)
        assert {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")} == {0, 1}
        qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == (arch.num_kv_heads // tp * (q_per + 2) * hd, arch.hidden_size)
        assert sd["decoder.layers.0.self_attention.linear_proj.weight"].shape == (arch.hidden_size, arch.q_size // tp)
        if p == 0:
            assert sd["embedding.word_embeddings.weight"].shape == (arch.vocab_size // tp, arch.hidden_size)
        if arch.is_moe:
            experts = {int(k.split(".")[6]) for k in sd if ".local_experts." in k}
            assert experts == {0, 1}
            g = 2 * p  # global index of local layer 0 (MoE on this stage's first layer for p=0 and p=1)
            if arch.layer_is_moe(g):
                pre = f"model.layers.{g}.mlp.experts.{e * 2 + 1}."
                fc2 = sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
                assert torch.equal(fc2, hf[pre + "down_proj.weight"].chunk(tp, 1)[t])
                assert torch.equal(sd["decoder.layers.0.mlp.router.weight"], hf[f"model.layers.{g}.mlp.gate.weight"])
    # PP stage 1 numbers its layers from 0: its local layer 1 is global layer 3.
    stage1 = shards[(1, 0, 0)]
    assert torch.equal(stage1["decoder.layers.1.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])


def test_qkv_interleave_explicit_layout(ckpt):
    arch, hf, _ = ckpt("qwen2")  # 4 heads, 2 KV groups, head_dim 16 -> 2 q heads per group
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    qb, kb, vb = (hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
    expected = torch.cat([q[0:32], k[0:16], v[0:16], q[32:64], k[16:32], v[16:32]])
    expected_bias = torch.cat([qb[0:32], kb[0:16], vb[0:16], qb[32:64], kb[16:32], vb[16:32]])
    one = hf_to_megatron(hf, arch)
    assert torch.equal(one["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    assert torch.equal(one["decoder.layers.0.self_attention.linear_qkv.bias"], expected_bias)
    # TP=2: each rank holds exactly one whole KV group.
    for r in range(2):
        sd = hf_to_megatron(hf, arch, tp_size=2, tp_rank=r)
        assert torch.equal(sd["decoder.layers.0.self_attention.linear_qkv.weight"], expected[r * 64 : (r + 1) * 64])
        gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
        rows = slice(r * 64, (r + 1) * 64)  # intermediate 128 / TP 2
        assert torch.equal(sd["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[rows], up[rows]]))
        down = hf["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(sd["decoder.layers.0.mlp.linear_fc2.weight"], down[:, rows])


@settings(max_examples=50, deadline=None)
@given(
    groups_log=st.integers(0, 3),
    q_per=st.integers(1, 4),
    hd=st.sampled_from([2, 4, 8]),
    tp_log=st.integers(0, 3),
    bias=st.booleans(),
)
def test_interleave_property(groups_log, q_per, hd, tp_log, bias):
    g, tp = 2**groups_log, 2 ** min(tp_log, groups_log)
    tail = () if bias else (3,)
    n = (g * q_per + 2 * g) * hd
    flat = torch.arange(n * (3 if tail else 1), dtype=torch.float32).reshape(n, *tail)
    q, k, v = flat.split([g * q_per * hd, g * hd, g * hd])
    qkv = interleave_qkv(q, k, v, g)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, g * q_per, g, hd), (q, k, v)))
    # A contiguous TP slice is the interleave of that rank's own groups.
    for r, shard in enumerate(qkv.chunk(tp)):

        def sl(t):
            return t.chunk(tp)[r]

        assert torch.equal(shard, interleave_qkv(sl(q), sl(k), sl(v), g // tp))


def test_tied_embeddings_and_pp(ckpt):
    arch, hf, _ = ckpt("qwen2_tied_bf16")
    assert arch.tie_word_embeddings and "lm_head.weight" not in hf
    assert "output_layer.weight" not in hf_to_megatron(hf, arch)
    last = hf_to_megatron(hf, arch, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"].chunk(2)[1])
    assert megatron_param_to_hf("output_layer.weight", last["output_layer.weight"], arch) == []


def test_padded_vocab(ckpt):
    arch, hf, _ = ckpt("qwen3")
    vocab = padded_vocab_size(arch.vocab_size, tp_size=2)
    assert (arch.vocab_size, vocab, padded_vocab_size(151936, 8)) == (320, 512, 152576)
    shards = _all_shards(hf, arch, 2, 2, 1, padded_vocab_size=vocab)
    emb1 = shards[(0, 1, 0)]["embedding.word_embeddings.weight"]
    assert emb1.shape == (256, arch.hidden_size)
    assert torch.equal(emb1[: 320 - 256], hf["model.embed_tokens.weight"][256:]) and not emb1[64:].any()
    assert shards[(1, 1, 0)]["output_layer.weight"].shape == (256, arch.hidden_size)
    _assert_same(megatron_to_hf(shards, arch, tp_size=2, pp_size=2), hf, arch)


def test_transformers_in_memory_fused_experts(ckpt):
    import transformers

    arch, hf, path = ckpt("qwen3_moe")
    model_sd = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in model_sd)
    a = hf_to_megatron(model_sd, arch, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    b = hf_to_megatron(hf, arch, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_tp_split_dims():
    assert tp_split_dim("embedding.word_embeddings.weight") == 0
    assert tp_split_dim("output_layer.weight") == 0
    assert tp_split_dim("decoder.final_layernorm.weight") is None
    p = "decoder.layers.7."
    assert tp_split_dim(p + "self_attention.linear_qkv.weight") == 0
    assert tp_split_dim(p + "self_attention.linear_qkv.bias") == 0
    assert tp_split_dim(p + "self_attention.linear_proj.weight") == 1
    assert tp_split_dim(p + "self_attention.linear_proj.bias") is None
    assert tp_split_dim(p + "mlp.linear_fc1.weight") == 0
    assert tp_split_dim(p + "mlp.linear_fc2.weight") == 1
    assert tp_split_dim(p + "mlp.experts.local_experts.3.linear_fc1.weight") == 0
    assert tp_split_dim(p + "mlp.experts.local_experts.3.linear_fc2.weight") == 1
    for n in ("input_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.router.weight"):
        assert tp_split_dim(p + n) is None
    assert tp_split_dim(p + "self_attention.q_layernorm.weight") is None
    assert tp_split_dim(p + "self_attention.k_layernorm.weight") is None
    with pytest.raises(ValueError, match="unknown Megatron parameter"):
        tp_split_dim(p + "mlp.linear_fc3.weight")


def test_pp_layer_range():
    assert [pp_layer_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match=r"num_layers \(4\) must be divisible by pp_size \(3\)"):
        pp_layer_range(4, 3, 0)
    with pytest.raises(ValueError, match="pp_rank"):
        pp_layer_range(4, 2, 2)


def test_errors(ckpt):
    arch, hf, _ = ckpt("qwen3_moe")
    with pytest.raises(ValueError, match=r"tp_size \(4\) must divide num_kv_heads \(2\)"):
        hf_to_megatron(hf, arch, tp_size=4)
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be divisible by ep_size \(3\)"):
        hf_to_megatron(hf, arch, ep_size=3)
    with pytest.raises(ValueError, match="ep_size must be 1 for dense"):
        hf_to_megatron(ckpt("qwen2")[1], ckpt("qwen2")[0], ep_size=2)
    with pytest.raises(ValueError, match=r"vocab size \(321\) must be divisible by tp_size \(2\); pass padded_vocab"):
        hf_to_megatron(hf, arch.replace(vocab_size=321), tp_size=2)
    with pytest.raises(ValueError, match=r"padded_vocab_size \(256\) is smaller than vocab_size \(320\)"):
        hf_to_megatron(hf, arch, padded_vocab_size=256)
    broken = {k: v for k, v in hf.items() if k != "model.layers.2.mlp.experts.1.up_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.2.mlp.experts.1.up_proj.weight"):
        hf_to_megatron(broken, arch)
    shards = _all_shards(hf, arch, 2, 1, 1)
    del shards[(0, 1, 0)]
    with pytest.raises(KeyError, match="tp_rank=1"):
        megatron_to_hf(shards, arch, tp_size=2)
