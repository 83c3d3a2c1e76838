"""The plugin's settings travel launcher -> environment -> plugin under one set of names."""

import pytest

from sglang_backend import plugin_settings
from sglang_backend.plugin_settings import PluginSettings


def test_round_trip_through_the_environment():
    s = PluginSettings(
        guidance_mode="full",
        guided_layers=(2, 3),
        guidance_dir="/tmp/g",
        quant_policy='{"a": 1}',
        kv_sides=("fp8", "nvfp4"),
        kv_k_debias=True,
        kv_read_dtype="bfloat16",
        fp4_kv=False,
        fp4_native="0",
    )
    env = s.to_env()
    assert env == {
        "TRACE_GUIDANCE_MODE": "full",
        "TRACE_GUIDED_LAYERS": "2,3",
        "TRACE_GUIDANCE_DIR": "/tmp/g",
        "TRACE_QUANT_POLICY": '{"a": 1}',
        "TRACE_KV_SIDES": "fp8,nvfp4",
        "TRACE_KV_K_DEBIAS": "1",
        "TRACE_KV_READ_DTYPE": "bfloat16",
        "TRACE_FP4_KV": "0",
        "TRACE_FP4_NATIVE": "0",
    }
    assert PluginSettings.from_env(env) == s
    assert set(env) == set(plugin_settings.env_names())


def test_defaults_and_unset_values():
    s = PluginSettings.from_env({})
    assert s == PluginSettings() and s.guided_layers is None and s.kv_sides is None and s.fp4_kv
    assert "TRACE_GUIDED_LAYERS" not in s.to_env() and "TRACE_KV_SIDES" not in s.to_env()
    assert PluginSettings.from_env({"TRACE_GUIDED_LAYERS": ""}).guided_layers == ()  # set, but no layer: no capture


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TRACE_GUIDED_LAYERS": "1,x"}, "TRACE_GUIDED_LAYERS must be comma-separated layer indices"),
        ({"TRACE_KV_SIDES": "fp8"}, "TRACE_KV_SIDES must be '<K format>,<V format>'"),
        ({"TRACE_KV_SIDES": "fp8,int4"}, "TRACE_KV_SIDES must be '<K format>,<V format>' with each one of bf16, fp8"),
        ({"TRACE_GUIDANCE_MODE": "bits"}, "TRACE_GUIDANCE_MODE must be one of full, mantissa"),
        ({"TRACE_FP4_KV": "no"}, "TRACE_FP4_KV must be 0 or 1"),
        ({"TRACE_KV_K_DEBIAS": "true"}, "TRACE_KV_K_DEBIAS must be 0 or 1"),
        ({"TRACE_FP4_NATIVE": "1"}, "TRACE_FP4_NATIVE must be one of auto, 0"),
    ],
)
def test_malformed_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_env(env)


def test_current_follows_the_process_environment(monkeypatch):
    monkeypatch.setenv("TRACE_GUIDED_LAYERS", "1")
    assert plugin_settings.current().guided_layers == (1,)
    monkeypatch.setenv("TRACE_GUIDED_LAYERS", "0,1")
    assert plugin_settings.current().guided_layers == (0, 1)
    assert plugin_settings.current() is plugin_settings.current()  # parsed once per distinct environment
