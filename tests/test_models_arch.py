"""ModelArch: read real transformers configs, round-trip them, list HF parameters exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from megatron_trace.models import ModelArch, make_tiny_checkpoint, tiny_hf_config  # noqa: E402

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4)


def _hf_config(family: str, **kw):
    cls = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    return cls[family](**{**_SMALL, **kw})


def _hf_model(family: str, **kw):
    cls = {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }
    return cls[family](_hf_config(family, **kw))


def _expanded_state_shapes(model) -> dict[str, tuple[int, ...]]:
    """The model's state_dict shapes with transformers-5 fused experts expanded in place, per expert."""
    out: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            pending = {e: (t.shape[1] // 2, t.shape[2]) for e in range(t.shape[0])}
            continue
        if name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, gu in pending.items():
                out[f"{prefix}.{e}.gate_proj.weight"] = gu
                out[f"{prefix}.{e}.up_proj.weight"] = gu
                out[f"{prefix}.{e}.down_proj.weight"] = tuple(t.shape[1:])
            continue
        out[name] = tuple(t.shape)
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def test_fields_from_transformers_configs():
    a = ModelArch.from_hf_config(_hf_config("qwen2", num_key_value_heads=2, rope_theta=1e6).to_dict())
    assert (a.family, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == ("qwen2", 3, 4, 2, 8)
    assert a.qkv_bias and not a.qk_norm and not a.is_moe and a.rope_theta == 1e6

    b = ModelArch.from_hf_config(_hf_config("qwen3", num_key_value_heads=1, head_dim=16, attention_bias=True).to_dict())
    assert (b.head_dim, b.num_kv_heads, b.qkv_bias, b.qk_norm, b.o_bias) == (16, 1, True, True, True)

    c = ModelArch.from_hf_config(
        _hf_config(
            "qwen3_moe",
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
            eos_token_id=[5, 6],
        ).to_dict()
    )
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (6, 2, 16, True)
    assert c.mlp_only_layers == (1,) and c.tie_word_embeddings and c.eos_token_id == [5, 6]
    assert [c.layer_is_moe(i) for i in range(3)] == [True, False, True]


def test_legacy_hub_config_and_directory(tmp_path):
    # A Qwen2.5-style config.json as published on the hub (transformers 4.x spelling).
    legacy = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "rope_scaling": None,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    for source in (legacy, tmp_path, tmp_path / "config.json", str(tmp_path)):
        a = ModelArch.from_hf_config(source)
        assert (a.head_dim, a.rope_theta, a.dtype, a.tie_word_embeddings) == (64, 1e6, "bfloat16", True)
        assert a.rope_scaling is None


def test_yarn_rope_scaling_round_trip():
    cfg = tiny_hf_config("qwen2", rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    a = ModelArch.from_hf_config(cfg)
    assert a.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    assert ModelArch.from_hf_config(a.to_hf_config()) == a


@pytest.mark.parametrize(
    "family,kw",
    [
        ("qwen2", dict(num_key_value_heads=2)),
        ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=True)),
        ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
        ("qwen3", dict(num_key_value_heads=2, head_dim=16, attention_bias=True)),
        (
            "qwen3_moe",
            dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
        ),
        (
            "qwen3_moe",
            dict(
                num_key_value_heads=2,
                head_dim=8,
                num_experts=3,
                num_experts_per_tok=1,
                moe_intermediate_size=8,
                decoder_sparse_step=2,
                mlp_only_layers=[2],
                tie_word_embeddings=True,
            ),
        ),
    ],
)
def test_param_shapes_match_real_model_and_round_trip(family, kw):
    arch = ModelArch.from_hf_config(_hf_config(family, **kw).to_dict())
    shapes = arch.hf_param_shapes()
    expected = _expanded_state_shapes(_hf_model(family, **kw))
    assert list(shapes.items()) == list(expected.items())  # names, shapes and order
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    # transformers builds the same model from our emitted config.
    rebuilt = _hf_model(family, **{k: v for k, v in arch.to_hf_config().items() if k != "model_type"})
    assert list(_expanded_state_shapes(rebuilt).items()) == list(shapes.items())


def test_layer_is_moe_matches_transformers():
    kw = dict(
        num_key_value_heads=2,
        head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        decoder_sparse_step=2,
        mlp_only_layers=[1],
        num_hidden_layers=6,
    )
    arch = ModelArch.from_hf_config(_hf_config("qwen3_moe", **kw).to_dict())
    model = _hf_model("qwen3_moe", **kw)
    truth = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert [arch.layer_is_moe(i) for i in range(6)] == truth == [False, False, False, True, False, True]
    with pytest.raises(IndexError):
        arch.layer_is_moe(6)


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_required_key(key):
    cfg = tiny_hf_config("qwen2")
    del cfg[key]
    with pytest.raises(ValueError, match=key):
        ModelArch.from_hf_config(cfg)


def test_validation_errors():
    with pytest.raises(ValueError, match="model_type must be one of qwen2, qwen3, qwen3_moe; got 'llama'"):
        ModelArch.from_hf_config({**tiny_hf_config("qwen2"), "model_type": "llama"})
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"):
        ModelArch.from_hf_config(tiny_hf_config("qwen2", num_key_value_heads=3))
    cfg = tiny_hf_config("qwen3")
    del cfg["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        ModelArch.from_hf_config(cfg)
    cfg = tiny_hf_config("qwen2")
    del cfg["rope_theta"], cfg["rope_parameters"]
    with pytest.raises(ValueError, match="rope_theta"):
        ModelArch.from_hf_config(cfg)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        cfg = tiny_hf_config("qwen3_moe")
        del cfg[key]
        with pytest.raises(ValueError, match=key):
            ModelArch.from_hf_config(cfg)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelArch.from_hf_config(tiny_hf_config("qwen2", hidden_act="gelu"))
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelArch.from_hf_config(tiny_hf_config("qwen2", use_sliding_window=True))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_kv_heads must be > 0; got 0"):
        ModelArch.from_hf_config(tiny_hf_config("qwen2")).replace(num_kv_heads=0)


def test_num_local_experts_spelling():
    cfg = tiny_hf_config("qwen3_moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert ModelArch.from_hf_config(cfg).num_experts == 4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_tiny_checkpoint(tmp_path, family):
    from safetensors import safe_open

    path = make_tiny_checkpoint(tmp_path / family, family, seed=3)
    arch = ModelArch.from_hf_config(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert on_disk == arch.hf_param_shapes()
    if family == "qwen3":
        assert arch.head_dim * arch.num_heads != arch.hidden_size
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.arange(24)[None] % arch.vocab_size).logits
    assert logits.std() > 0.5  # not the near-uniform logits of HF's default init
    assert logits.softmax(-1).amax(-1).mean() < 0.9


def test_tiny_checkpoint_deterministic(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=7, dtype="bfloat16", tie_word_embeddings=True)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=7, dtype="bfloat16", tie_word_embeddings=True)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    arch = ModelArch.from_hf_config(a)
    assert arch.dtype == "bfloat16" and arch.tie_word_embeddings


def test_import_is_light():
    code = (
        "import sys, megatron_trace.models as m; "
        "bad = sorted({n.split('.')[0] for n in sys.modules} & {'transformers', 'megatron', 'sglang', 'safetensors'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
