"""`python -m sglang_backend.launch --backend sglang`: flag translation (dry run), no SGLang needed."""
from __future__ import annotations

import importlib.util
import shlex
import sys

import pytest

from sglang_backend.launch import main


def _dry(capsys, *argv):
    assert main(["--backend", "sglang", "--model-path", "/m", "--dry-run", *argv]) == 0
    line = capsys.readouterr().out.strip()
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-") and w.split("=")[0].isupper())
    return env, words[len(env):]


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_translation(capsys):
    env, cmd = _dry(capsys, "--host", "0.0.0.0", "--port", "31000", "--api-key", "sekrit", "--quantization", "nvfp4",
                    "--kv-cache-dtype", "mxfp4", "--tp-size", "4", "--dtype", "bfloat16", "--random-seed", "7",
                    "--", "--mem-fraction-static", "0.8", "--enable-metrics")
    assert env["SGLANG_PLUGINS"] == "trace_fp4" and env["TRACE_GUIDANCE_MODE"] == "mantissa"
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for name, want in (("--model-path", "/m"), ("--host", "0.0.0.0"), ("--port", "31000"), ("--quantization", "trace_fp4"),
                       ("--kv-cache-dtype", "fp4_mx_block16"), ("--tp-size", "4"), ("--dtype", "bfloat16"),
                       ("--random-seed", "7"), ("--api-key", "***")):
        assert _flag(cmd, name) == want, name
    assert cmd[-3:] == ["--mem-fraction-static", "0.8", "--enable-metrics"]


@pytest.mark.parametrize("ours,theirs", [("nvfp4", "nvfp4"), ("auto", "auto"), ("bf16", "bf16")])
def test_kv_dtypes(capsys, ours, theirs):
    _, cmd = _dry(capsys, "--kv-cache-dtype", ours)
    assert _flag(cmd, "--kv-cache-dtype") == theirs and "--quantization" not in cmd and "--api-key" not in cmd


def test_quantization_choices(capsys):
    _, cmd = _dry(capsys, "--quantization", "modelopt_fp4")
    assert _flag(cmd, "--quantization") == "modelopt_fp4"
    _, cmd = _dry(capsys, "--quantization", "mxfp4")
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
