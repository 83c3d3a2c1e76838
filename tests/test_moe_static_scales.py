"""Static activation scales with routed experts: each expert has its own input_scale, so the engine
records gate_up per (token, slot) with the token's expert's scale, and the trainer's QAT rounds each
expert's rows with that expert's scale (tiny Qwen3-MoE)."""

import pytest
import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode, input_scale_from_amax
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint, tiny_hf_config


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from sglang_backend.local import Engine

    eng = Engine(
        str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe_static"), "qwen3_moe", seed=0)), quantization="nvfp4"
    )
    yield eng
    eng.shutdown()


def test_engine_records_gate_up_with_each_experts_static_scale(engine):
    """Every expert of layer 0 gets a different static S_enc: the gate_up record at (token, slot) is
    the token's input quantized by the expert of that slot (expert 0's scale everywhere before)."""
    layer = engine.model.layers[0]
    a = engine.arch
    for e, lin in enumerate(layer.experts_gate_up):  # not powers of two apart: distinct E4M3 block scales
        lin.input_global_scale = torch.tensor(300.0 + 110.0 * e)
    try:
        x = torch.randn(24, a.hidden_size, generator=torch.Generator().manual_seed(3))
        routed = torch.zeros(x.shape[0], a.num_layers, a.num_experts_per_tok, dtype=torch.long)
        got = {}
        layer._moe(x, lambda site, q: got.__setitem__(site, q), routed)
        rec = got["model.layers.0.mlp.experts.gate_up_proj"]
        assert rec.data.shape[:2] == (x.shape[0], a.num_experts_per_tok)
        experts = routed[:, 0]
        assert (experts != 0).any()  # some slots belong to experts other than 0
        for t in range(x.shape[0]):
            for k in range(a.num_experts_per_tok):
                want = layer.experts_gate_up[int(experts[t, k])].quantize_input(x[t : t + 1])
                assert torch.equal(rec.data[t, k], want.data[0]) and torch.equal(rec.scale[t, k], want.scale[0])
                assert float(rec.global_scale[t, k]) == float(want.global_scale)
    finally:
        for lin in layer.experts_gate_up:
            lin.input_global_scale = None


def test_static_site_scales_are_per_expert():
    """{HF module: amax} -> one S_enc per expert site: max(gate, up) for gate_up, down's own."""
    from megatron_trace.transfer.static_scales import static_site_scales

    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe"))
    policy = QuantPolicy(kv="bf16", activation_scale="static")
    amax = {}
    for layer in range(arch.num_layers):
        for e in range(arch.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            amax.update({p + "gate_proj": 1.0 + e, p + "up_proj": 2.0 + e, p + "down_proj": 9.0 - e})
    scales = static_site_scales(amax, arch, policy)
    assert len(scales) == arch.num_layers * arch.num_experts * 2
    for e in range(arch.num_experts):
        assert torch.equal(scales[f"model.layers.1.mlp.experts.{e}.gate_up_proj"], _s_enc(2.0 + e))
        assert torch.equal(scales[f"model.layers.1.mlp.experts.{e}.down_proj"], _s_enc(9.0 - e))


def _s_enc(amax: float) -> torch.Tensor:
    """The static S_enc the engine reads back from a checkpoint calibrated to `amax`."""
    return encode_scale_from_decode(input_scale_from_amax(amax))


class _Expert:
    """A `select` stub for global expert 2's linear_fc2 (ExpertRows' interface, no dispatcher)."""

    def __init__(self, weights):
        self.weights = weights

    def expert_site(self, site):
        return site.replace(".mlp.experts.", ".mlp.experts.2.")

    def input_weights(self):
        return self.weights


def test_trainer_rounds_expert_rows_with_that_experts_static_scale():
    """QATState.activation of Megatron's fc2 input h * w under expert 2's static S_enc = the engine's
    quantize-dequantize of h with that S_enc, weighted: neither the site-wide key nor h * w itself."""
    from megatron_trace.trainer.qat import QATState

    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe"))
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(32, 64, generator=g), torch.rand(32, generator=g) * 0.9 + 0.05
    st = QATState(arch, QuantPolicy(kv="bf16", activation_scale="static"), "rtn")
    s_enc = torch.tensor(700.0)
    st.set_static_activation_scales({"model.layers.0.mlp.experts.2.down_proj": s_enc})
    got = st.activation((h * w[:, None])[:, None], "model.layers.0.mlp.experts.down_proj", None, select=_Expert(w))[
        :, 0
    ]
    want = nvfp4.dequantize(nvfp4.quantize(h, global_scale=s_enc)) * w[:, None]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weighted = nvfp4.dequantize(nvfp4.quantize(h * w[:, None], global_scale=s_enc))
    assert (weighted - want).abs().max() > 1e-2  # rounding h * w under the static scale is another answer
