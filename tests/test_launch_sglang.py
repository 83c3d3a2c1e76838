"""`python -m sglang_backend.launch --backend sglang`: flag translation (dry run), no SGLang needed."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

from sglang_backend.launch import main


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    from megatron_trace.models import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), "qwen2", seed=3))


def _dry(capsys, *argv, model):
    assert main(["--backend", "sglang", "--model-path", model, "--dry-run", *argv]) == 0
    line = capsys.readouterr().out.strip()
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-") and w.split("=")[0].isupper())
    return env, words[len(env) :]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_translation(capsys, bf16_ckpt):
    env, cmd = _dry(
        capsys,
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
        "--api-key",
        "sekrit",
        "--quantization",
        "nvfp4",
        "--kv-cache-dtype",
        "mxfp4",
        "--tp-size",
        "4",
        "--dtype",
        "bfloat16",
        "--random-seed",
        "7",
        "--device",
        "cuda",
        "--",
        "--mem-fraction-static",
        "0.8",
        "--enable-metrics",
        model=bf16_ckpt,
    )
    assert env["SGLANG_PLUGINS"] == "trace_fp4" and env["TRACE_GUIDANCE_MODE"] == "mantissa"
    assert env["TRACE_GUIDED_LAYERS"] == "2,3"  # last_half of 4 layers, resolved for the plugin
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for name, want in (
        ("--model-path", bf16_ckpt),
        ("--host", "0.0.0.0"),
        ("--port", "31000"),
        ("--quantization", "trace_nvfp4"),
        ("--kv-cache-dtype", "fp4_mx_block16"),
        ("--tp-size", "4"),
        ("--dtype", "bfloat16"),
        ("--random-seed", "7"),
        ("--api-key", "***"),
        ("--weight-version", "0"),
    ):
        assert _flag(cmd, name) == want, name
    assert "--skip-tokenizer-init" in cmd and "SGLANG_USE_CPU_ENGINE" not in env and "torch_native" not in cmd
    assert cmd[-3:] == ["--mem-fraction-static", "0.8", "--enable-metrics"]
    # online quantization follows the engine's policy for the same flags (MLP linears, 4 layers)
    online = json.loads(env["TRACE_QUANT_POLICY"])
    assert online["num_layers"] == 4 and online["policy"]["targets"][0] == "*.mlp.gate_proj"


def test_cpu_engine_flags(capsys, bf16_ckpt):
    env, cmd = _dry(capsys, "--device", "cpu", "--max-total-tokens", "2048", model=bf16_ckpt)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    for name, want in (
        ("--device", "cpu"),
        ("--attention-backend", "torch_native"),
        ("--sampling-backend", "pytorch"),
        ("--mem-fraction-static", "0.05"),
        ("--max-total-tokens", "2048"),
    ):
        assert _flag(cmd, name) == want, name
    assert "--disable-cuda-graph" in cmd


def test_per_side_kv_goes_through_the_plugins_per_side_method(capsys, bf16_ckpt):
    """FP8 K + NVFP4 V (and MXFP4 KV on the CPU engine) run as SGLang's nvfp4 KV pool with the
    plugin's per-side method named in TRACE_KV_SIDES; on GPUs the launcher adds torch_native, loudly."""
    env, cmd = _dry(capsys, "--device", "cpu", "--kv-k", "fp8", "--kv-v", "nvfp4", model=bf16_ckpt)
    assert _flag(cmd, "--kv-cache-dtype") == "nvfp4" and env["TRACE_KV_SIDES"] == "fp8,nvfp4"
    env, cmd = _dry(capsys, "--device", "cpu", "--kv-cache-dtype", "mxfp4", model=bf16_ckpt)
    assert _flag(cmd, "--kv-cache-dtype") == "nvfp4" and env["TRACE_KV_SIDES"] == "mxfp4,mxfp4"
    env, cmd = _dry(capsys, "--device", "cpu", "--kv-cache-dtype", "nvfp4", "--dtype", "float32", model=bf16_ckpt)
    assert _flag(cmd, "--kv-cache-dtype") == "nvfp4" and env["TRACE_KV_READ_DTYPE"] == "float32"
    assert "TRACE_KV_SIDES" not in env  # both NVFP4: the plugin's NVFP4 method, GPU layouts included
    assert (
        main(
            [
                "--backend",
                "sglang",
                "--model-path",
                bf16_ckpt,
                "--dry-run",
                "--device",
                "cuda",
                "--kv-cache-dtype",
                "fp8",
                "--kv-v",
                "bf16",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    cmd = shlex.split(out.out.strip())
    assert "TRACE_KV_SIDES=fp8,bf16" in cmd and _flag(cmd, "--attention-backend") == "torch_native"
    assert "torch_native" in out.err and "warning" in out.err


def test_nvfp4_export_needs_no_flag(capsys, tmp_path, bf16_ckpt):
    cfg = json.loads((Path(bf16_ckpt) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    env, cmd = _dry(capsys, "--quantization", "nvfp4", "--device", "cpu", model=str(tmp_path))
    assert "--quantization" not in cmd and "TRACE_QUANT_POLICY" not in env


@pytest.mark.parametrize("ours,theirs", [("nvfp4", "nvfp4"), ("auto", "auto"), ("bf16", "bf16")])
def test_kv_dtypes(capsys, ours, theirs, bf16_ckpt):
    _, cmd = _dry(capsys, "--kv-cache-dtype", ours, "--device", "cuda", model=bf16_ckpt)
    assert _flag(cmd, "--kv-cache-dtype") == theirs and "--quantization" not in cmd and "--api-key" not in cmd


def test_quantization_choices(capsys, bf16_ckpt):
    _, cmd = _dry(capsys, "--quantization", "modelopt_fp4", model=bf16_ckpt)
    assert _flag(cmd, "--quantization") == "modelopt_fp4"
    _, cmd = _dry(capsys, "--quantization", "mxfp4", model=bf16_ckpt)
    assert _flag(cmd, "--quantization") == "trace_mxfp4"
    assert main(["--backend", "sglang", "--model-path", "/m", "--dry-run", "--quantization", "w4a16_nvfp4"]) == 2
    assert "--backend local only" in capsys.readouterr().err


def test_errors_without_sglang_or_key(capsys):
    assert main(["--backend", "sglang", "--model-path", "/m", "--host", "0.0.0.0"]) == 2
    assert "--api-key is required" in capsys.readouterr().err
    assert main(["--model-path", "/m", "--", "--x"]) == 2  # pass-through is for --backend sglang only
    assert "--backend sglang" in capsys.readouterr().err
    if importlib.util.find_spec("sglang") is None:
        assert main(["--backend", "sglang", "--model-path", "/m"]) == 2
        err = capsys.readouterr().err
        assert "'sglang' package" in err and "not installed" in err


def test_routed_experts_flag_reaches_sglang(capsys, bf16_ckpt):
    for device in ("cuda", "cpu"):  # on CPU the plugin unpins SGLang's routed-experts host buffer
        _env, cmd = _dry(capsys, "--device", device, "--enable-return-routed-experts", model=bf16_ckpt)
        assert "--enable-return-routed-experts" in cmd
        _env, cmd = _dry(capsys, "--device", device, model=bf16_ckpt)
        assert "--enable-return-routed-experts" not in cmd


def test_cpu_mem_fraction_covers_weights_and_kv(bf16_ckpt):
    """SGLang's CPU engine needs --mem-fraction-static of the available memory for the weights and
    the KV pool (a fixed 0.05 failed for a real 0.5B model at fp32): weights at the served dtype +
    the KV tokens, a third more, at least 0.05."""
    from safetensors.torch import load_file

    from megatron_trace.models import ModelArch
    from sglang_backend.cpu_engine_sizing import cpu_mem_fraction
    from sglang_backend.launch import parser

    weights = sum(t.numel() for f in Path(bf16_ckpt).glob("*.safetensors") for t in load_file(f).values())
    arch = ModelArch.from_hf_config(Path(bf16_ckpt))
    kv_per_token = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim
    for dtype, wide in (("float32", 4), ("bfloat16", 2)):
        args = parser().parse_args(["--model-path", bf16_ckpt, "--dtype", dtype])
        need = (weights + 1000 * kv_per_token) * wide
        assert cpu_mem_fraction(args, 1000, available=need * 4) == round(1.34 / 4, 3)
        assert cpu_mem_fraction(args, 1000, available=need * 1000) == 0.05  # small models: the old floor
        assert cpu_mem_fraction(args, 1000, available=need) == 0.9  # capped: SGLang then says what it lacks
        quant = parser().parse_args(["--model-path", bf16_ckpt, "--dtype", dtype, "--quantization", "nvfp4"])
        online = int(weights * wide * 2.2) + 1000 * kv_per_token * wide  # float weights + their FP4 copy
        assert cpu_mem_fraction(quant, 1000, available=online * 4) == round(1.34 / 4, 3)


def test_cpu_tp_ranks_get_their_own_cores(capsys, bf16_ckpt, monkeypatch):
    """SGLang's CPU engine wants one NUMA node per TP rank unless SGLANG_CPU_OMP_THREADS_BIND says
    which cores each rank takes: the launcher splits this process's CPUs; a user's own value wins."""
    from sglang_backend.cpu_engine_sizing import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0-1|2-3"
    assert cpu_thread_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(ValueError, match="at least one CPU per rank"):
        cpu_thread_binding(4, [0, 1])
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    env, _ = _dry(capsys, "--device", "cpu", "--tp-size", "2", model=bf16_ckpt)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    env, _ = _dry(capsys, "--device", "cpu", model=bf16_ckpt)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|0")
    env, _ = _dry(capsys, "--device", "cpu", "--tp-size", "2", model=bf16_ckpt)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env  # the caller's passes through the exec environment
