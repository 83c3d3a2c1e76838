"""QuantPolicy: which HF modules are FP4, fusion groups, validation messages, (de)serialization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.models import DEFAULT_TARGETS, ModelArch, QuantPolicy, tiny_hf_config

DENSE = ModelArch.from_hf_config(tiny_hf_config("qwen3"))
MOE = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", mlp_only_layers=[1]))
L = DENSE.num_layers


def test_defaults_quantize_mlp_only():
    p = QuantPolicy()
    # the config's defaults (config.QuantConfig is generated from this class): KV per model family
    assert (p.format, p.weights, p.activations, p.kv, p.targets) == ("nvfp4", "fp4", "fp4", "auto", DEFAULT_TARGETS)
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        assert p.linear_is_fp4(f"model.layers.0.mlp.{leaf}", L)
        assert p.weight_is_fp4(f"model.layers.0.mlp.{leaf}", L)
        assert p.activation_is_fp4(f"model.layers.0.mlp.{leaf}", L)
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert not p.linear_is_fp4(f"model.layers.0.self_attn.{leaf}", L)
    assert p.linear_is_fp4("model.layers.2.mlp.experts.3.down_proj", L)
    # Parameter names are accepted for convenience.
    assert p.linear_is_fp4("model.layers.0.mlp.up_proj.weight", L)


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens",
        "lm_head",
        "model.norm",
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.self_attn.q_norm",
        "model.layers.0.mlp.gate",  # the MoE router
        "model.layers.0.mlp.experts.1",  # a container, not a linear
    ],
)
def test_never_fp4_even_with_catch_all_targets(name):
    p = QuantPolicy(kv="bf16", targets=("*", "*.mlp.gate*", "lm_head", "model.embed_tokens"))
    assert not p.linear_is_fp4(name, L)


def test_router_never_matches_gate_proj_pattern():
    p = QuantPolicy(kv="bf16")
    names = p.quantized_linears(MOE)
    assert not any(n.endswith(".mlp.gate") for n in names)
    assert "model.layers.0.mlp.experts.0.gate_proj" in names
    assert "model.layers.1.mlp.gate_proj" in names  # the dense layer of the MoE model
    assert len(names) == (L - 1) * MOE.num_experts * 3 + 3


def test_attention_opt_in_and_fused_groups():
    p = QuantPolicy(
        kv="bf16", targets=DEFAULT_TARGETS + ("*.self_attn.*_proj",), bf16_layers_start=1, bf16_layers_end=1
    )
    groups = p.fused_groups(MOE)
    assert set(groups) == set(p.quantized_linears(MOE))
    assert {int(n.split(".")[2]) for n in groups} == {1, 2}
    a = "model.layers.1.self_attn."
    assert {groups[a + x] for x in ("q_proj", "k_proj", "v_proj")} == {a + "qkv_proj"}
    assert groups[a + "o_proj"] == a + "o_proj"
    d = "model.layers.1.mlp."
    assert groups[d + "gate_proj"] == groups[d + "up_proj"] == d + "gate_up_proj"
    assert groups[d + "down_proj"] == d + "down_proj"
    e = "model.layers.2.mlp.experts.3."
    assert groups[e + "gate_proj"] == groups[e + "up_proj"] == e + "gate_up_proj"
    assert groups["model.layers.2.mlp.experts.2.up_proj"] == "model.layers.2.mlp.experts.2.gate_up_proj"


def test_partial_fused_group_is_an_error():
    p = QuantPolicy(kv="bf16", targets=("*.self_attn.q_proj",))
    with pytest.raises(ValueError, match=r"fused group model\.layers\.0\.self_attn\.qkv_proj.*k_proj"):
        p.fused_groups(DENSE)
    with pytest.raises(ValueError, match="gate_up_proj"):
        QuantPolicy(kv="bf16", targets=("*.experts.*.gate_proj",)).quantized_linears(MOE)


def test_bf16_modes():
    assert QuantPolicy(kv="bf16", format="bf16").quantized_linears(DENSE) == []
    assert QuantPolicy(kv="bf16", weights="bf16", activations="bf16").quantized_linears(DENSE) == []
    w4a16 = QuantPolicy(kv="bf16", activations="bf16")
    name = "model.layers.1.mlp.down_proj"
    assert w4a16.linear_is_fp4(name, L) and w4a16.weight_is_fp4(name, L) and not w4a16.activation_is_fp4(name, L)
    assert QuantPolicy(kv="bf16", format="mxfp4").linear_is_fp4(name, L)


def test_kv():
    assert not any(QuantPolicy(kv="bf16").kv_is_fp4(i, L) for i in range(L))
    p = QuantPolicy(kv="nvfp4", bf16_layers_start=1, bf16_layers_end=2)
    assert [p.kv_is_fp4(i, L) for i in range(L)] == [False, True, False, False]
    assert QuantPolicy(format="bf16", kv="mxfp4").kv_is_fp4(0, L)  # KV-only experiment
    with pytest.raises(IndexError):
        p.kv_is_fp4(L, L)


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 5), end=st.integers(0, 5), kv=st.sampled_from(["nvfp4", "mxfp4", "bf16"]))
def test_bf16_layer_band(start, end, kv):
    p = QuantPolicy(bf16_layers_start=start, bf16_layers_end=end, kv=kv)
    layers = {int(n.split(".")[2]) for n in p.quantized_linears(DENSE)}
    fp4 = set(range(start, L - end))
    assert layers == fp4
    assert {i for i in range(L) if p.kv_is_fp4(i, L)} == (fp4 if kv != "bf16" else set())


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(kv="fp4"), "quant.kv must be one of auto, bf16, fp8, nvfp4, mxfp4; got 'fp4'"),
        (dict(kv_v="int8"), "quant.kv_v must be one of , bf16, fp8, nvfp4, mxfp4; got 'int8'"),
        (dict(format="fp8"), "quant.format must be one of nvfp4, mxfp4, bf16; got 'fp8'"),
        (dict(weights="int4"), "quant.weights must be one of fp4, bf16; got 'int4'"),
        (dict(activations="fp8"), "quant.activations must be one of fp4, bf16; got 'fp8'"),
        (
            dict(activation_scale="per_tensor"),
            "quant.activation_scale must be one of per_token, static; got 'per_tensor'",
        ),
        (dict(weights="bf16"), "quant.activations='fp4' requires quant.weights='fp4'"),
        (dict(bf16_layers_start=-1), "quant.bf16_layers_start must be >= 0; got -1"),
        (dict(bf16_layers_end=1.5), "quant.bf16_layers_end must be int; got 1.5"),
        (dict(bf16_layers_end=True), "quant.bf16_layers_end must be int; got True"),
        (dict(targets="*.mlp.*"), "quant.targets must be a list"),
        (dict(targets=("",)), "quant.targets must hold non-empty strings"),
    ],
)
def test_validation_messages(kw, msg):
    with pytest.raises(ValueError) as err:
        QuantPolicy(**kw)
    assert msg in str(err.value)


def test_dict_round_trip():
    p = QuantPolicy(format="mxfp4", activations="bf16", kv="mxfp4", targets=["*.mlp.down_proj"], bf16_layers_end=2)
    assert p.targets == ("*.mlp.down_proj",)
    d = p.to_dict()
    assert d["targets"] == ["*.mlp.down_proj"] and d["format"] == "mxfp4"
    assert QuantPolicy.from_dict(d) == p
    assert QuantPolicy.from_dict(None) == QuantPolicy()
    with pytest.raises(ValueError, match="unknown quant key.*kv_format.*allowed: format, weights"):
        QuantPolicy.from_dict({"kv_format": "nvfp4"})
