"""megatron_trace/kernels/cpu_build: a build that cannot happen says so, loudly and once, and the engine reports
it in model_info while the torch references serve."""

import logging

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import cpu_build, cpu_fused, cpu_gemv, dispatch

MISSING = "/nonexistent/megatron-trace-c++"


def test_a_missing_compiler_is_named_and_logged_once(caplog):
    build = cpu_build.KernelBuild("portable", compiler=MISSING)
    with caplog.at_level(logging.WARNING, logger="megatron_trace.kernels.cpu_build"):
        assert build.module() is None
        assert build.module() is None
    assert (
        build.reason() == f"build failed (RuntimeError: no C++ compiler: {MISSING!r} is not on PATH "
        f"(install g++ or clang++, or set CXX))"
    )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and MISSING in warnings[0].getMessage()
    assert "torch references" in warnings[0].getMessage()


def test_without_kernels_the_engine_reports_it_and_runs_the_references(monkeypatch, tmp_path, caplog):
    import torch

    from megatron_trace.models import make_tiny_checkpoint
    from sglang_backend.local import Engine

    monkeypatch.setattr(cpu_build, "NATIVE", cpu_build.KernelBuild("native", compiler=MISSING))
    with caplog.at_level(logging.WARNING):
        assert not cpu_gemv.available() and not cpu_fused.available(torch.float32)
        x = torch.randn(3, 32)
        q, xhat = dispatch.nvfp4_quantize_dequantize(x, per_row_global=True, dequant_dtype=torch.float32)
        r = nvfp4.quantize(x, per_row_global=True)
        assert torch.equal(q.data, r.data) and torch.equal(xhat, nvfp4.dequantize(r, torch.float32))
        eng = Engine(str(make_tiny_checkpoint(tmp_path, "qwen2", seed=1)), quantization="nvfp4")
        try:
            info = eng.get_model_info()["cpu_linear"]
            out = eng.generate(
                input_ids=[[5, 6, 7]], sampling_params={"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
            )
        finally:
            eng.shutdown()
    assert info.startswith("torch (build failed (RuntimeError: no C++ compiler") and MISSING in info
    assert len(out[0]["output_ids"]) == 2
    assert any(MISSING in r.getMessage() for r in caplog.records if r.name == "megatron_trace.kernels.cpu_build")
