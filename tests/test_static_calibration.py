"""transfer.static_scales: the static-scale calibration a run makes at start, and its refusals."""

import pytest

from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.transfer.export import load_hf_dir
from megatron_trace.transfer.static_scales import calibrate_input_amax, calibrate_static_amax, static_amax_modules

PROMPTS = [[1, 5, 9, 2], [7, 3, 3, 8, 4]]
STATIC = QuantPolicy(kv="bf16", format="nvfp4", activation_scale="static")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), "qwen2", seed=0)


def test_amax_is_the_exporters_calibration_of_every_fp4_activation_linear(dense):
    arch = ModelArch.from_hf_config(dense)
    amax = calibrate_static_amax(dense, arch, STATIC, PROMPTS)
    assert sorted(amax) == sorted(f"model.layers.{i}.mlp.{m}_proj" for i in range(4) for m in ("gate", "up", "down"))
    _, sd, cfg = load_hf_dir(dense)
    assert amax == calibrate_input_amax(sd, cfg, PROMPTS, static_amax_modules(arch, STATIC))
    assert min(amax.values()) > 0
    for i in range(4):  # gate and up read the same input: one amax, which the fused S_enc is made from
        assert amax[f"model.layers.{i}.mlp.gate_proj"] == amax[f"model.layers.{i}.mlp.up_proj"]


@pytest.mark.parametrize(
    "policy, message",
    [
        (QuantPolicy(kv="bf16", format="nvfp4"), "activation_scale='per_token'"),
        (QuantPolicy(kv="bf16", format="nvfp4", activations="bf16", activation_scale="static"), "nothing to calibrate"),
    ],
)
def test_refuses_a_policy_with_nothing_static(dense, policy, message):
    with pytest.raises(ValueError, match=message):
        calibrate_static_amax(dense, ModelArch.from_hf_config(dense), policy, PROMPTS)


def test_engine_says_which_static_linears_still_run_per_token(caplog, tmp_path):
    """A static policy on a BF16 checkpoint (no input_scale yet): the engine warns and lists the
    FP4-activation linears that round per token until a weight update brings their input_scale."""
    import logging

    from megatron_trace.models import QuantPolicy, make_tiny_checkpoint
    from sglang_backend.local import Engine

    ckpt = make_tiny_checkpoint(tmp_path / "ck", "qwen2", seed=0)
    with caplog.at_level(logging.WARNING, logger="sglang_backend.local.engine"):
        eng = Engine(str(ckpt), quant_policy=QuantPolicy(kv="bf16", activation_scale="static"))
    try:
        missing = eng.get_model_info()["static_scales_missing"]
        assert missing and all(s.startswith("model.layers.") for s in missing)
        assert "no input_scale yet" in caplog.text
    finally:
        eng.shutdown()
    plain = Engine(str(ckpt), quant_policy=QuantPolicy(kv="bf16"))
    try:
        assert plain.get_model_info()["static_scales_missing"] == []
    finally:
        plain.shutdown()
