"""Exports that stock engines load: ModelOpt 0.47's config forms read by real SGLang 0.5.23's own
config parsing (ModelConfig -> ModelOptFp4Config -> get_quant_method), calibrated W4A4
input_scales, the refusal without calibration, and the chat template travelling with the export.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatron_trace.fp4.modelopt import input_scale_from_amax
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.transfer.export import main

WORDS = [
    "<pad>",
    "<eos>",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "assistant",
    "\n",
    "hello",
    "world",
    "two",
    "plus",
    "three",
    "is",
    "five",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
MSGS = [{"role": "user", "content": "two plus three is"}]
PROMPTS = [[7, 8, 9, 10, 11], {"input_ids": [2, 4, 9, 10, 11, 12, 3, 2, 5]}]


def _tokenizer_into(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_forms")
    src = make_tiny_checkpoint(root / "src", "qwen2", seed=0)
    _tokenizer_into(src)  # (transformers 5 serves it from there as a Qwen2Tokenizer: ids prompts here)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps(p) for p in PROMPTS] + [""]))
    out = root / "out"
    # layer 3 stays BF16 (a BF16 band): its MLP must be excluded too
    assert main(["--load", str(src), "--out", str(out), "--calib-prompts", str(prompts), "--bf16-layers-end", "1"]) == 0
    return src, out, prompts


def test_config_forms_are_modelopt_047(exported):
    _, out, _ = exported
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(qc) == ["config_groups", "ignore", "producer", "quant_algo", "quant_method"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["producer"]["name"] == "modelopt"
    fmt = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["config_groups"] == {"group_0": {"input_activations": fmt, "weights": fmt, "targets": ["Linear"]}}
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt"
    q = hq["quantization"]
    assert (q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"]) == ("NVFP4", 16, None)
    assert q["exclude_modules"] == qc["ignore"] and "lm_head" in q["exclude_modules"]
    assert q["activation_scale"] == "static"


def _sglang_quant_config(model_dir):
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant")
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    mc = ModelConfig(model_path=str(model_dir))  # SGLang's own detection of the checkpoint's method
    assert mc.quantization == "modelopt_fp4"
    return _get_quantization_config(mc, LoadConfig())


def test_real_sglang_modelopt_config_keeps_bf16_modules_excluded(exported, tmp_path):
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    _, out, _ = exported
    cfg = _sglang_quant_config(out)
    assert isinstance(cfg, ModelOptFp4Config) and cfg.is_checkpoint_nvfp4_serialized and cfg.group_size == 16
    # the same checkpoint with hf_quant_config.json only (how SGLang reads older ModelOpt exports)
    legacy = tmp_path / "legacy"
    shutil.copytree(out, legacy)
    hf = json.loads((legacy / "config.json").read_text())
    del hf["quantization_config"]
    (legacy / "config.json").write_text(json.dumps(hf))
    nested = _sglang_quant_config(legacy)
    assert isinstance(nested, ModelOptFp4Config) and nested.exclude_modules == cfg.exclude_modules
    arch = ModelArch.from_hf_config(out)
    policy = QuantPolicy(kv="bf16", bf16_layers_end=1)
    fp4 = set(policy.quantized_linears(arch))
    assert fp4 and len(fp4) < len(arch.hf_linear_modules()) - 1  # both kinds are present
    kinds = {
        "self_attn.qkv_proj": (QKVParallelLinear, ["q_proj", "k_proj", "v_proj"]),
        "self_attn.o_proj": (RowParallelLinear, ["o_proj"]),
        "mlp.gate_up_proj": (MergedColumnParallelLinear, ["gate_proj", "up_proj"]),
        "mlp.down_proj": (RowParallelLinear, ["down_proj"]),
    }
    checked = 0
    for i in range(arch.num_layers):
        for sg_name, (cls, members) in kinds.items():
            prefix = f"model.layers.{i}.{sg_name}"
            parent = prefix.rpartition(".")[0]
            want_fp4 = f"{parent}.{members[0]}" in fp4
            for c in (cfg, nested):
                method = c.get_quant_method(cls.__new__(cls), prefix)  # only the layer's type is read
                assert isinstance(method, ModelOptFp4LinearMethod if want_fp4 else UnquantizedLinearMethod), prefix
            checked += 1
    for c in (cfg, nested):
        assert isinstance(
            c.get_quant_method(ParallelLMHead.__new__(ParallelLMHead), "lm_head"), UnquantizedLinearMethod
        )
    assert checked == 4 * arch.num_layers


def _reference_amax(src, prompts: list[list[int]], modules: list[str]) -> dict[str, float]:
    """Independent of transfer.static_scales: transformers' from_pretrained + plain hooks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    amax = dict.fromkeys(modules, 0.0)
    hooks = [
        model.get_submodule(m).register_forward_pre_hook(
            lambda _m, a, m=m: amax.__setitem__(m, max(amax[m], a[0].abs().max().item())) or None
        )
        for m in modules
    ]
    with torch.no_grad():
        for ids in prompts:
            model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def test_w4a4_export_has_calibrated_input_scales(exported):
    from safetensors.torch import load_file

    src, out, _ = exported
    prompts = [PROMPTS[0], PROMPTS[1]["input_ids"]]
    arch = ModelArch.from_hf_config(out)
    fp4 = QuantPolicy(kv="bf16", bf16_layers_end=1).quantized_linears(arch)
    ref = _reference_amax(src, prompts, fp4)
    sd = load_file(str(out / "model.safetensors"))
    for m in fp4:
        parent, _, leaf = m.rpartition(".")
        group = [f"{parent}.{x}" for x in ("gate_proj", "up_proj")] if leaf in ("gate_proj", "up_proj") else [m]
        want = input_scale_from_amax(max(ref[g] for g in group))  # fused shards share one scale
        got = sd[f"{m}.input_scale"]
        assert got.dtype == torch.float32 and got.shape == () and torch.equal(got, want), m
        assert abs(float(got) * 6 * 448 / max(ref[g] for g in group) - 1) < 1e-6
    assert not any(k.endswith("input_scale") and k.rpartition(".")[0] not in fp4 for k in sd)


def test_chat_template_travels_with_the_export(exported):
    from transformers import AutoTokenizer

    src, out, _ = exported
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|> user two plus three is <|im_end|> <|im_start|> assistant "
    )


def test_calibration_prompts_text_and_chat(tmp_path):
    from megatron_trace.transfer.static_scales import load_prompts

    _tokenizer_into(tmp_path / "tok")
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(json.dumps(x) for x in ([1, 2], "hello world two", {"text": "plus three"}, {"messages": MSGS}))
    )
    assert load_prompts(f, tmp_path / "tok") == [[1, 2], [7, 8, 9], [10, 11], [2, 4, 9, 10, 11, 12, 3, 2, 5]]
    f.write_text(json.dumps("hello"))
    with pytest.raises(ValueError, match="tokenizer"):
        load_prompts(f, tmp_path / "none")


def test_w4a4_export_without_calibration_refuses(exported, tmp_path, capsys):
    src, _, _ = exported
    assert main(["--load", str(src), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--calib-prompts" in err and "input_scale" in err and not (tmp_path / "x").exists()
