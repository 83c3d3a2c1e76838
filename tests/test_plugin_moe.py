"""The plugin's routed experts (plugin/moe_method.py) without a server: which FusedMoE layers each
quantization config gives FP4 experts, refuses, or leaves BF16; and the experts' arithmetic and
guidance against the embedded engine's Qwen3-MoE layer on the same checkpoint, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from sglang_backend.local.loader import load_checkpoint
from sglang_backend.local.model import QwenEngineModel
from sglang_backend.plugin import capture
from sglang_backend.plugin.moe_method import TraceFP4MoEMethod
from sglang_backend.plugin.online_quant import TraceMXFP4OnlineConfig, TraceNVFP4OnlineConfig
from sglang_backend.plugin.quant_config import TraceFP4Config

PREFIX = "model.layers.1.mlp.experts"


class _ExpertsProbe(FusedMoE):
    """What get_quant_method sees of a FusedMoE (its class and expert count), without SGLang's runtime."""

    def __init__(self, num_experts: int):
        torch.nn.Module.__init__(self)
        self.num_experts = num_experts


def _policy_env(monkeypatch, policy: QuantPolicy, num_layers: int = 2) -> None:
    monkeypatch.setenv("TRACE_QUANT_POLICY", json.dumps({"policy": policy.to_dict(), "num_layers": num_layers}))


@pytest.mark.parametrize("config", [TraceNVFP4OnlineConfig, TraceMXFP4OnlineConfig])
def test_online_configs_read_no_quant_file_and_claim_no_checkpoint(config):
    """SGLang's get_quant_config asks for the files a quant config reads from the checkpoint: an online
    config quantizes a BF16 checkpoint, so none (a name there makes SGLang refuse to start), and it
    never claims a ModelOpt export that trace_fp4 serves."""
    assert config.get_config_filenames() == []
    modelopt = {"quantization": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    assert config.override_quantization_method(modelopt, None) is None
    assert config.override_quantization_method(modelopt, "modelopt") is None
    assert TraceFP4Config.get_config_filenames() != []


@pytest.mark.parametrize("config", [TraceNVFP4OnlineConfig, TraceMXFP4OnlineConfig])
def test_online_configs_give_fp4_experts_where_the_policy_says(monkeypatch, config):
    _policy_env(monkeypatch, QuantPolicy(kv="bf16", format=config.FMT))
    method = config().get_quant_method(_ExpertsProbe(4), PREFIX)
    assert isinstance(method, TraceFP4MoEMethod) and method.fmt == config.FMT and method.site == PREFIX
    # BF16 experts by the policy: SGLang's own method (None), as the engine keeps them BF16
    _policy_env(monkeypatch, QuantPolicy(kv="bf16", format=config.FMT, targets=("*.mlp.gate_proj",)))
    assert config().get_quant_method(_ExpertsProbe(4), PREFIX) is None
    # static per-expert input scales never reach a FusedMoE: refused, not rounded per token
    _policy_env(monkeypatch, QuantPolicy(kv="bf16", format=config.FMT, activation_scale="static"))
    with pytest.raises(NotImplementedError, match="activation_scale=static"):
        config().get_quant_method(_ExpertsProbe(4), PREFIX)
    # a layer whose experts are partly FP4 cannot be one FusedMoE
    _policy_env(monkeypatch, QuantPolicy(kv="bf16", format=config.FMT, targets=("*.mlp.experts.0.*",)))
    with pytest.raises(ValueError, match="only some routed-expert linears FP4"):
        config().get_quant_method(_ExpertsProbe(4), PREFIX)


def test_export_loader_refuses_fp4_experts_and_keeps_excluded_ones_bf16():
    """trace_fp4 (ModelOpt NVFP4 exports) has no FusedMoE method: FP4 experts refuse by name, never load as BF16."""
    with pytest.raises(NotImplementedError, match=rf"{PREFIX} holds ModelOpt NVFP4 routed experts"):
        TraceFP4Config().get_quant_method(_ExpertsProbe(4), PREFIX)
    excluded = TraceFP4Config(exclude_modules=["model.layers.*.mlp.experts.*"])
    assert excluded.get_quant_method(_ExpertsProbe(4), PREFIX) is None


class _Rows:
    """A capture buffer that keeps what record() hands it, per site."""

    def __init__(self):
        self.sites = {}

    def write(self, site, slots, positions, q):
        self.sites[site] = q


def _same_bits(a, b) -> None:
    assert type(a) is type(b)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    if isinstance(a, nvfp4.NVFP4Tensor):
        assert torch.equal(a.global_scale.float(), b.global_scale.float())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_experts_equal_the_engine_layer_bit_for_bit(tmp_path, fmt):
    """Same checkpoint weights, same router output: the plugin's dequantized expert weights, its MoE
    output and its two expert guidance sites equal the engine's (QwenEngineModel layer 1, W4A4)."""
    ckpt = make_tiny_checkpoint(tmp_path, "qwen3_moe", seed=5)
    arch = ModelArch.from_hf_config(ckpt)
    model = QwenEngineModel(arch, QuantPolicy(kv="bf16", format=fmt), torch.float32)
    load_checkpoint(model, ckpt)
    layer = model.layers[1]
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(f))
    w13 = torch.stack(
        [torch.cat([state[f"{PREFIX}.{e}.gate_proj.weight"], state[f"{PREFIX}.{e}.up_proj.weight"]]) for e in range(4)]
    )
    w2 = torch.stack([state[f"{PREFIX}.{e}.down_proj.weight"] for e in range(4)])
    method = TraceFP4MoEMethod(fmt, PREFIX)
    w13_deq = torch.stack([method.quantize_dequantize_weight(w, torch.float32) for w in w13])
    w2_deq = torch.stack([method.quantize_dequantize_weight(w, torch.float32) for w in w2])
    for e in range(arch.num_experts):
        assert torch.equal(w13_deq[e], layer.experts_gate_up[e].weight) and torch.equal(
            w2_deq[e], layer.experts_down[e].weight
        )

    x = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    engine_sites = {}
    want = layer._moe(x, lambda site, q: engine_sites.__setitem__(site, q))
    probs = F.softmax(F.linear(x, layer.router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, arch.num_experts_per_tok, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    rows = _Rows()
    with capture.capture_batch(torch.arange(9), torch.arange(9), buffer=rows):
        got = method.experts_forward(x, weights, ids.to(torch.int32), w13_deq, w2_deq)
    assert torch.equal(got, want)
    assert list(rows.sites) == list(engine_sites) == [f"{PREFIX}.gate_up_proj", f"{PREFIX}.down_proj"]
    for site in engine_sites:
        _same_bits(rows.sites[site], engine_sites[site])
    assert rows.sites[f"{PREFIX}.down_proj"].data.shape == (
        9,
        arch.num_experts_per_tok,
        arch.moe_intermediate_size // 2,
    )
    assert isinstance(rows.sites[f"{PREFIX}.gate_up_proj"], mxfp4.MXFP4Tensor if fmt == "mxfp4" else nvfp4.NVFP4Tensor)


# -- the launcher refuses before SGLang starts -------------------------------------------------
@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3)


def _as_export(src, dst, policy: QuantPolicy):
    """src's config with the quant configs the exporter writes for `policy` (a dry run reads no weights)."""
    from megatron_trace.transfer.export import quant_configs

    dst.mkdir()
    qc, hq = quant_configs(ModelArch.from_hf_config(src), policy)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    (dst / "hf_quant_config.json").write_text(json.dumps(hq))
    return str(dst)


def _launch(*argv):
    from sglang_backend.launch import main

    return main(["--backend", "sglang", "--dry-run", "--device", "cpu", *argv])


def test_launcher_refuses_fp4_experts_the_plugin_cannot_serve(moe_ckpt, tmp_path, capsys):
    export = _as_export(moe_ckpt, tmp_path / "fp4", QuantPolicy(kv="bf16", format="nvfp4"))
    assert _launch("--model-path", export) == 2
    assert "model.layers.0.mlp.experts holds ModelOpt NVFP4 routed experts" in capsys.readouterr().err
    dense_only = _as_export(
        moe_ckpt, tmp_path / "attn", QuantPolicy(kv="bf16", format="nvfp4", targets=("*.self_attn.o_proj",))
    )
    assert _launch("--model-path", dense_only) == 0  # BF16 experts by the checkpoint: SGLang's method is right
    capsys.readouterr()
    assert _launch("--model-path", str(moe_ckpt), "--quantization", "nvfp4", "--tp-size", "2") == 2
    assert "routed experts of model.layers.0.mlp.experts FP4" in capsys.readouterr().err
    assert _launch("--model-path", str(moe_ckpt), "--quantization", "nvfp4") == 0
    assert "--quantization trace_nvfp4" in capsys.readouterr().out


def test_slot_capture_keeps_a_per_slot_s_enc(tmp_path):
    """The down_proj site's S_enc is [T, top_k]: SlotCapture stores and returns it per KV slot and slot."""
    from megatron_trace.guidance import GuidanceRecord
    from sglang_backend.plugin.slot_capture import SlotCapture

    cap = SlotCapture(16, "full", [1])
    h = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(1))
    q = nvfp4.quantize(h, per_row_global=True)
    assert q.global_scale.shape == (3, 2)
    cap.write(f"{PREFIX}.down_proj", torch.tensor([5, 9, 2]), None, q)
    site = GuidanceRecord.from_bytes(cap.record("r", torch.tensor([2, 5, 9]))).sites[f"{PREFIX}.down_proj"]
    order = torch.tensor([2, 0, 1])  # slots 2, 5, 9 hold rows 2, 0, 1
    assert torch.equal(site.global_scale, q.global_scale[order].float())
    assert torch.equal(site.payload, q.data[order]) and torch.equal(site.scale, q.scale[order])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_expert_loader_routes_each_form_and_marks_the_layer(fmt):
    """moe_packed.load around FusedMoE's loader: BF16 rows go to w13_weight, an NVFP4 layer's packed codes
    to its packed buffer (remembered per expert and shard), E4M3 scales as bytes; MXFP4 refuses codes."""
    from sglang_backend.plugin import moe_packed

    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 64, 32), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(2, 32, 32), requires_grad=False)
    calls = []

    def loader(param, loaded, name, shard_id, expert_id):
        calls.append((param, loaded.dtype))

    if fmt == "nvfp4":
        moe_packed.add_update_params(layer, 2, 32, 32, loader)
    layer._trace_dirty = False
    moe_packed.load(loader, layer, PREFIX, fmt, layer.w13_weight, torch.ones(32, 32), "w13", shard_id="w1", expert_id=1)
    assert calls[-1][0] is layer.w13_weight and layer._trace_dirty
    codes = torch.zeros(32, 16, dtype=torch.uint8)
    if fmt == "mxfp4":
        with pytest.raises(TypeError, match="MXFP4 experts are quantized from BF16"):
            moe_packed.load(loader, layer, PREFIX, fmt, layer.w13_weight, codes, "w13", shard_id="w3", expert_id=1)
        return
    assert not bool(layer.trace_packed["w13"].any())
    moe_packed.load(loader, layer, PREFIX, fmt, layer.w13_weight, codes, "w13", shard_id="w3", expert_id=1)
    assert calls[-1][0] is layer.trace_w13_packed and layer.trace_packed["w13"].tolist() == [
        [False, False],
        [False, True],
    ]
    with pytest.raises(ValueError, match="expert 1's gate and up arrived one packed FP4, one BF16"):
        moe_packed.packed_expert_weight(layer, "w13", 1, PREFIX)
    scale = torch.zeros(32, 2, dtype=torch.float8_e4m3fn)
    moe_packed.load(loader, layer, PREFIX, fmt, layer.w13_weight_scale, scale, "w13_scale", shard_id="w1", expert_id=0)
    assert calls[-1] == (layer.w13_weight_scale, torch.uint8)
