"""K and V cache formats in the one quant policy: kv as the shorthand, kv_k / kv_v per side, auto."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_trace.config import Config
from megatron_trace.models import QuantPolicy
from megatron_trace.models.arch import ModelArch
from megatron_trace.models.quant_policy import KV_FORMATS
from megatron_trace.models.tiny import tiny_hf_config

side = st.sampled_from(("", *KV_FORMATS))


@given(kv=st.sampled_from(KV_FORMATS), k=side, v=side)
def test_a_side_follows_kv_unless_set(kv, k, v):
    p = QuantPolicy(kv=kv, kv_k=k, kv_v=v)
    assert (p.k_format, p.v_format) == (k or kv, v or kv)
    assert QuantPolicy.from_dict(p.to_dict()) == p
    assert p.kv_is_fp4(0, 4) == ((k or kv) != "bf16" or (v or kv) != "bf16")


def test_bf16_band_keeps_both_sides_bf16():
    p = QuantPolicy(kv="nvfp4", kv_k="fp8", bf16_layers_end=1)
    assert [p.kv_format(i, 3, "k") for i in range(3)] == ["fp8", "fp8", "bf16"]
    assert [p.kv_format(i, 3, "v") for i in range(3)] == ["nvfp4", "nvfp4", "bf16"]
    with pytest.raises(ValueError, match="KV side must be 'k' or 'v'"):
        p.kv_format(0, 3, "q")


@pytest.mark.parametrize(
    "family,want", [("qwen2", ("fp8", "nvfp4")), ("qwen3", ("nvfp4", "nvfp4")), ("qwen3_moe", ("nvfp4", "nvfp4"))]
)
def test_auto_resolves_per_family(family, want):
    arch = ModelArch.from_hf_config(tiny_hf_config(family))
    p = QuantPolicy(kv="auto")
    with pytest.raises(ValueError, match=r"quant.kv='auto'.*resolve"):
        _ = p.k_format
    with pytest.raises(ValueError, match=r"quant.kv='auto' reached a part that quantizes unresolved"):
        p.check_resolved(arch)
    r = p.resolve(arch)
    assert (r.k_format, r.v_format) == want and (r.kv_k, r.kv_v, r.kv) == (*want, want[1])  # "auto" is gone
    # K de-biased where it has a k_proj bias (Qwen2/2.5); an explicit kv_k keeps kv_k_debias as set
    assert r.kv_k_debias == (family == "qwen2") and r.resolve(arch) == r
    assert not QuantPolicy(kv="auto", kv_k="fp8").resolve(arch).kv_k_debias
    assert QuantPolicy(kv="auto", kv_v="bf16").resolve(arch).v_format == "bf16"  # explicit side wins
    assert QuantPolicy(kv="nvfp4").resolve(arch) == QuantPolicy(kv="nvfp4")  # explicit kv: no family rule


def test_config_default_is_auto_and_explicit_kv_is_both():
    assert Config.load(None, []).quant.spec().kv == "auto"
    p = Config.load(None, ["quant.kv=nvfp4"]).quant.spec()
    assert (p.k_format, p.v_format) == ("nvfp4", "nvfp4")
    p = Config.load(None, ["quant.kv=nvfp4", "quant.kv_k=fp8"]).quant.spec()
    assert (p.k_format, p.v_format) == ("fp8", "nvfp4")


@pytest.mark.parametrize(
    "k,v,algo",
    [
        ("bf16", "bf16", None),
        ("fp8", "fp8", "FP8"),
        ("fp8", "nvfp4", "FP8"),
        ("nvfp4", "nvfp4", "NVFP4"),
        ("mxfp4", "mxfp4", "MXFP4"),
        ("mxfp4", "nvfp4", "NVFP4"),
        ("nvfp4", "bf16", None),
    ],
)
def test_export_kv_algo_names_the_finer_side(k, v, algo):
    assert QuantPolicy(kv="bf16", kv_k=k, kv_v=v).kv_cache_quant_algo() == algo


def test_export_names_the_policy_kv_algo(tmp_path):
    from megatron_trace.models import make_tiny_checkpoint
    from megatron_trace.transfer.export import export_checkpoint, load_hf_dir

    src = make_tiny_checkpoint(tmp_path / "src", "qwen2", seed=0)
    arch, sd, cfg = load_hf_dir(src)
    amax = {m: 4.0 for m in QuantPolicy(kv="bf16").quantized_linears(arch)}
    out = export_checkpoint(
        sd, arch, tmp_path / "out", policy=QuantPolicy(kv="auto").resolve(arch), input_amax=amax, hf_config=cfg
    )
    import json

    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"  # qwen2 auto: FP8 K + NVFP4 V, the finer side
