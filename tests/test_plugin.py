"""The SGLang plugin's layer methods on CPU, without SGLang: bit parity with the embedded engine.

The stand-in layer is a bare nn.Module (SGLang's LinearBase is what is missing here, not our
code); the SGLang modules that `register()` mutates are replaced by test doubles in sys.modules.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from megatron_trace.fp4 import nvfp4, swizzle_scales, to_modelopt_fused
from megatron_trace.fp4.nvfp4 import decode_scale, encode_scale_from_amax
from megatron_trace.guidance import GuidanceRecord
from sglang_backend.local.kv_cache import PagedKVCache
from sglang_backend.local.layers import EngineLinear
from sglang_backend.plugin import capture, quant_config, register, slot_capture
from sglang_backend.plugin.kv_capture import TraceNVFP4KVMethod
from sglang_backend.plugin.quant_config import TraceFP4Config, TraceMXFP4Config
from sglang_backend.plugin.quant_method import TraceFP4LinearMethod, TraceMXFP4LinearMethod

TENSORS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
QKV = {"q": 32, "k": 16, "v": 16}
GATE_UP = {0: 48, 1: 48}


def _weights(shards: dict, k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, k, generator=g) * (0.5 + i) for i, rows in enumerate(shards.values())]


def _engine(shards, k, tensors, bias, fmt="nvfp4"):
    names = {str(s): rows for s, rows in shards.items()}
    lin = EngineLinear(names, k, bias=True, weight_fmt=fmt, act_fmt=fmt, dtype=torch.float32, site="site")
    for (shard, t), b in zip(zip(names, tensors), bias.split(list(names.values()))):
        if fmt == "nvfp4":
            for name in TENSORS:
                if name in t:
                    lin.load_shard(shard, t[name], "weight_packed" if name == "weight" else name)
        else:
            lin.load_shard(shard, t)
        lin.load_shard(shard, b, "bias")
    lin.finalize()
    return lin


def _plugin(shards, k, tensors, method=None):
    layer = nn.Module()
    method = method or TraceFP4LinearMethod(TraceFP4Config(), site="site")
    method.create_weights(layer, k, list(shards.values()), k, sum(shards.values()), torch.float32)
    _load(layer, shards, tensors)
    method.process_weights_after_loading(layer)
    return layer, method


def _load(layer, shards, tensors):
    for shard, t in zip(shards, tensors):
        if isinstance(t, torch.Tensor):
            layer.weight.weight_loader(layer.weight, t, shard)
            continue
        for name in TENSORS:
            if name in t:
                p = getattr(layer, name)
                p.weight_loader(p, t[name], shard)


@pytest.mark.parametrize("shards,k", [(QKV, 64), (GATE_UP, 32)], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("input_amax", [None, 3.0], ids=["per_token", "static"])
def test_nvfp4_apply_matches_engine_linear(shards, k, input_amax):
    tensors = to_modelopt_fused(_weights(shards, k, 0), input_amax=input_amax)
    bias = torch.randn(sum(shards.values()))
    x = torch.randn(5, k) * 2
    site = "model.layers.0.self_attn.qkv_proj"
    layer, method = _plugin(shards, k, tensors, TraceFP4LinearMethod(TraceFP4Config(), site=site))
    eng = _engine(shards, k, tensors, bias)
    seen = []
    want = eng(x, capture=lambda _, q: seen.append(q))
    cap = slot_capture.SlotCapture(8, "full", guided_layers=[0])
    with capture.capture_batch(torch.tensor([4, 5, 6, 0, 1]), None, buffer=cap):  # two requests' KV slots
        got = method.apply(layer, x, bias)
    assert torch.equal(got, want)
    first, second = (
        GuidanceRecord.from_bytes(cap.record(r, s)).sites[site]
        for r, s in (("a", torch.tensor([4, 5, 6])), ("b", torch.tensor([0, 1])))
    )
    assert torch.equal(first.payload, seen[0].data[:3]) and torch.equal(first.scale, seen[0].scale[:3])
    if input_amax is None:  # guidance: the per-token quantization of the input
        ref = nvfp4.quantize(x, per_row_global=True)
        assert torch.equal(first.payload, ref.data[:3]) and torch.equal(first.scale, ref.scale[:3])
        assert torch.equal(first.global_scale.reshape(-1), ref.global_scale.reshape(-1)[:3])
        assert torch.equal(second.payload, ref.data[3:])
    assert method.apply(layer, x.unsqueeze(0), bias).shape == (1, 5, sum(shards.values()))


def test_weight_update_in_place_refreshes_derived():
    k = 64
    layer, method = _plugin(QKV, k, to_modelopt_fused(_weights(QKV, k, 1)))
    ptrs = {n: getattr(layer, n).data_ptr() for n in TENSORS}
    params = {n: getattr(layer, n) for n in TENSORS}
    swz_ptr, old_swz = layer.trace_weight_scale_swizzled.data_ptr(), layer.trace_weight_scale_swizzled.clone()
    new = to_modelopt_fused(_weights(QKV, k, 2))
    _load(layer, QKV, new)
    method.process_weights_after_loading(layer)
    assert {n: getattr(layer, n).data_ptr() for n in TENSORS} == ptrs
    assert all(getattr(layer, n) is params[n] for n in TENSORS)
    want_swz = swizzle_scales(torch.cat([t["weight_scale"] for t in new]).view(torch.uint8))
    assert torch.equal(layer.trace_weight_scale_swizzled, want_swz) and not torch.equal(want_swz, old_swz)
    assert layer.trace_weight_scale_swizzled.data_ptr() == swz_ptr
    x, bias = torch.randn(3, k), torch.zeros(64)
    assert torch.equal(method.apply(layer, x, bias), _engine(QKV, k, new, bias)(x))
    _load(layer, QKV, to_modelopt_fused(_weights(QKV, k, 3)))  # no explicit process: apply refreshes lazily
    assert torch.equal(method.apply(layer, x, bias), _engine(QKV, k, to_modelopt_fused(_weights(QKV, k, 3)), bias)(x))


def test_loader_rejects_bad_tensors():
    layer, _ = _plugin(QKV, 64, to_modelopt_fused(_weights(QKV, 64, 0)))
    with pytest.raises(ValueError, match="checkpoint"):
        layer.weight.weight_loader(layer.weight, torch.zeros(16, 16, dtype=torch.uint8), "q")
    with pytest.raises(TypeError, match="uint8"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 32), "q")
    with pytest.raises(KeyError):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 32, dtype=torch.uint8), "z")
    fresh = nn.Module()
    m = TraceFP4LinearMethod(site="x")
    m.create_weights(fresh, 64, [32], 64, 32, torch.float32)
    with pytest.raises(ValueError, match="weight_scale_2 missing"):
        m.process_weights_after_loading(fresh)


def test_tensor_parallel_rows():
    tensors = to_modelopt_fused(_weights(GATE_UP, 32, 4))
    layer = nn.Module()
    # 0.5.23 layers carry a tp_group read by get_group_rank_size (no tp_rank/tp_size attributes);
    # real layers at TP=2: tests/test_sglang_tp2.py
    layer.tp_group = types.SimpleNamespace(rank_in_group=1, world_size=2)
    m = TraceFP4LinearMethod(site="gu")
    m.create_weights(layer, 32, [24, 24], 32, 96, torch.float32)
    _load(layer, GATE_UP, tensors)
    assert torch.equal(layer.weight.data[:24], tensors[0]["weight"][24:])
    assert torch.equal(layer.weight.data[24:], tensors[1]["weight"][24:])


def test_mxfp4_apply_matches_engine_linear_and_records_its_guidance():
    """Inside a server's capture the MXFP4 method records its input as the engine's guidance log keeps
    it: the codes, the E8M0 bytes per 32 and a static S_enc of 1.0 (no global scale in MXFP4)."""
    from megatron_trace.guidance import encode_records, make_site
    from sglang_backend.plugin import slot_capture

    shards, k, site = {0: 32, 1: 32}, 64, "model.layers.0.mlp.gate_up_proj"
    ws = _weights(shards, k, 5)
    bias = torch.randn(64)
    layer, method = _plugin(shards, k, ws, TraceMXFP4LinearMethod(TraceMXFP4Config(), site=site))
    x = torch.randn(4, k)
    seen = []
    want = _engine(shards, k, ws, bias, fmt="mxfp4")(x, capture=lambda _, q: seen.append(q))
    cap = slot_capture.SlotCapture(8, "full", guided_layers=[0])
    with capture.capture_batch(torch.tensor([5, 1, 2, 3]), None, buffer=cap):
        got = method.apply(layer, x.reshape(2, 2, k), bias)  # a 3-d input is captured per token too
    assert torch.equal(got.reshape(4, -1), want)
    (q,) = seen
    assert q.scale.shape == (4, k // 32)
    rows = torch.tensor([1, 2, 0])
    site_rec = make_site(q.scale[rows], torch.tensor(1.0), q.data[rows], "full")
    assert cap.record("r", torch.tensor([1, 2, 5])) == encode_records(["r"], "full", [3], {site: site_rec})[0]


def test_kv_method_matches_paged_kv_cache():
    heads, d = 2, 32
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, heads, d, generator=g), torch.randn(3, heads, d, generator=g) * 5
    cache = PagedKVCache(
        num_layers=2, kv_heads=heads, head_dim=d, num_pages=4, page_size=4, kv_dtype="nvfp4", dtype=torch.float32
    )
    cache.global_scale[1] = torch.stack([encode_scale_from_amax(k.abs().amax()), torch.tensor(1.0)])
    slots = torch.tensor([3, 5, 14])
    cache.write(1, 0, slots, k)
    cache.write(1, 1, slots, v)
    method = TraceNVFP4KVMethod(num_layers=2)
    bufs = method.create_buffers(16, heads, d, 2, "cpu")
    cap = slot_capture.SlotCapture(8, "full", guided_layers=[1])  # slot 14 is past its capacity: dumped
    with capture.capture_batch(slots, None, buffer=cap):
        method.quantize_and_store(
            bufs["k_buffer"][1],
            bufs["v_buffer"][1],
            bufs["k_scale_buffer"][1],
            bufs["v_scale_buffer"][1],
            slots,
            k,
            v,
            k_scale=decode_scale(cache.global_scale[1, 0]),
            v_scale=None,
        )
    rec = GuidanceRecord.from_bytes(cap.record("r", slots[:2]))
    for which, name in ((0, "k"), (1, "v")):
        assert torch.equal(bufs[f"{name}_buffer"][1][slots], cache.codes[1, which][slots])
        assert torch.equal(bufs[f"{name}_scale_buffer"][1][slots], cache.scales[1, which][slots])
        recorded = rec.sites[f"model.layers.1.self_attn.{name}_cache"]
        assert torch.equal(recorded.payload, cache.codes[1, which][slots[:2]])
        assert torch.equal(recorded.scale, cache.scales[1, which][slots[:2]])
    assert not bufs["k_buffer"][0].any()


def test_register_mutates_fake_sglang(monkeypatch):
    methods = {"fp8": object, "modelopt_fp4": object}
    quant_mod = types.ModuleType("sglang.srt.layers.quantization")
    quant_mod.QUANTIZATION_METHODS = methods
    args_mod = types.ModuleType("sglang.srt.server_args")
    args_mod.QUANTIZATION_CHOICES = ["fp8", "modelopt_fp4"]
    for name, mod in {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt.layers.quantization": quant_mod,
        "sglang.srt.server_args": args_mod,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(quant_config._ACTIVE, "on", False)
    # This fake SGLang has no KV registry; without this, a real SGLang module that an earlier test
    # of the session imported would be found (and mutated) instead.
    monkeypatch.setattr(register, "sglang_nvfp4_base", lambda: (None, None))
    done = register.register()
    assert done["quantization"] and done["cli_choices"] and not done["kv_cache"]
    assert quant_mod.QUANTIZATION_METHODS is methods
    assert list(methods)[:3] == ["trace_fp4", "trace_nvfp4", "trace_mxfp4"] and methods["trace_fp4"] is TraceFP4Config
    assert "fp8" in methods and args_mod.QUANTIZATION_CHOICES[-3:] == ["trace_fp4", "trace_nvfp4", "trace_mxfp4"]
    ckpt = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    assert TraceFP4Config.override_quantization_method(ckpt, None) == "trace_fp4"
    assert TraceFP4Config.override_quantization_method(ckpt, "modelopt_fp4") is None
    assert TraceFP4Config.override_quantization_method({"quant_method": "fp8"}, None) is None


def test_config_from_exported_checkpoint_and_exclusion(monkeypatch):
    monkeypatch.setitem(quant_config._ACTIVE, "on", False)
    monkeypatch.setattr(quant_config, "sglang_attr", lambda *_: None)  # bare nn.Modules stand in for SGLang's layers
    hq = {
        "producer": {"name": "megatron_trace"},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "trace_targets": ["*.mlp.*"],
            "exclude_modules": ["lm_head", "model.layers.*.self_attn.*"],
        },
    }
    cfg = TraceFP4Config.from_config(hq)
    assert cfg.get_name() == "trace_fp4" and cfg.trace_targets == ["*.mlp.*"]
    assert TraceFP4Config.override_quantization_method(hq, None) is None  # plugin not active
    assert TraceFP4Config.override_quantization_method(hq, "trace_fp4") == "trace_fp4"
    assert cfg.get_quant_method(nn.Module(), "model.layers.0.self_attn.qkv_proj") is None  # excluded, no SGLang
    assert isinstance(cfg.get_quant_method(nn.Module(), "model.layers.0.mlp.gate_up_proj"), TraceFP4LinearMethod)
    with pytest.raises(ValueError, match="partly"):
        TraceFP4Config(exclude_modules=["model.layers.0.mlp.gate_proj"]).is_layer_excluded(
            "model.layers.0.mlp.gate_up_proj"
        )
    with pytest.raises(ValueError, match="group_size"):
        TraceFP4Config.from_config({"quant_algo": "NVFP4", "group_size": 32})


def test_slot_capture_record_and_guidance_answer(tmp_path, monkeypatch):
    """Rows land by KV slot; a request's record gathers its slots in order (a reused prefix slot
    too) in the project's record format; /get_guidance's answer is those bytes once, then 404."""
    from megatron_trace.guidance import GuidanceRecord, encode_records, make_site
    from sglang_backend.plugin import slot_capture

    monkeypatch.setenv(capture.GUIDANCE_DIR_ENV, str(tmp_path))
    cap = slot_capture.SlotCapture(8, "full", guided_layers=[1])
    x = torch.randn(5, 32)
    q = nvfp4.quantize(x, per_row_global=True)
    with capture.capture_batch(torch.tensor([3, 4, 5, 6, 99]), None, buffer=cap):  # slot 99: the dump row
        capture.record("model.layers.1.mlp.down_proj", q)
        capture.record("model.layers.0.mlp.down_proj", q)  # not a guided layer
    assert list(cap.sites) == ["model.layers.1.mlp.down_proj"]
    got = cap.record("r-1", torch.tensor([5, 3, 4]))
    rows = torch.tensor([2, 0, 1])
    want = encode_records(
        ["r-1"],
        "full",
        [3],
        {"model.layers.1.mlp.down_proj": make_site(q.scale[rows], q.global_scale[rows], q.data[rows], "full")},
    )[0]
    assert got == want and GuidanceRecord.from_bytes(got).num_positions == 3
    slot_capture.publish("r-1", got)
    assert register.guidance_answer({"rid": "r-1"}) == (200, got)
    assert register.guidance_answer({"rid": "r-1"})[0] == 404  # already fetched
    assert register.guidance_answer({"rid": "../etc"})[0] == 400 and register.guidance_answer({})[0] == 400
    with capture.capture_batch(torch.tensor([1, 2]), None, buffer=cap):  # 2 slots, 5 rows: an error, not a skip
        capture.record("model.layers.1.mlp.down_proj", q)
    with pytest.raises(RuntimeError, match="5 quantized rows but 2 token slots"):
        cap.record("r-2", torch.tensor([1]))


def test_import_without_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import sglang_backend.plugin as p, sglang_backend.plugin.register as r\n"
        "assert not p.HAVE_SGLANG and p.TraceFP4LinearMethod.__mro__[1].__name__ == '_TraceLinearBase'\n"
        "assert r.register()['quantization'] is False\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("input_amax", [None, 3.0], ids=["per_token", "static"])
def test_nvfp4_apply_on_the_triton_w4a4_route_matches_f_linear(monkeypatch, input_amax):
    """Off SM100 on CUDA the method multiplies the activation codes by the stored weight in the
    Triton W4A4 GEMM; the interpreter stands in for the GPU (gemm_backend 'triton')."""
    import importlib

    from megatron_trace.kernels.dispatch import triton_available

    if not triton_available() or not importlib.import_module("megatron_trace.kernels.triton_fp4_codecs").INTERPRETED:
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    fp4_gemm = importlib.import_module("megatron_trace.kernels.fp4_gemm")
    tensors = to_modelopt_fused(_weights(QKV, 64, 1), input_amax=input_amax)
    bias, x = torch.randn(sum(QKV.values())), torch.randn(5, 64) * 2
    layer, method = _plugin(QKV, 64, tensors)
    want = method.apply(layer, x, bias)  # CPU: dequantize + F.linear, EngineLinear's bits
    calls, real = [], fp4_gemm.fp4_linear_w4a4_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp4_gemm, "fp4_linear_w4a4_triton", counted)
    layer2, method2 = _plugin(QKV, 64, tensors)
    method2.gemm_backend = "triton"
    method2.process_weights_after_loading(layer2)
    assert layer2.trace_weight_dequant is None  # the kernel reads the weight as stored
    got = method2.apply(layer2, x, bias)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 summation order only
