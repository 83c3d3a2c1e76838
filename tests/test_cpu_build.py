"""megatron_trace/kernels/cpu_build: a build that cannot happen says so, loudly and once, and the engine reports
it in model_info while the torch references serve."""

import logging
import shutil

import pytest
from torch.utils import cpp_extension

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import cpu_build, cpu_fused, cpu_gemv, cpu_routes, dispatch

MISSING = "/nonexistent/megatron-trace-c++"


def test_a_missing_compiler_is_named_and_logged_once(caplog):
    build = cpu_build.KernelBuild("baseline", compiler=MISSING)
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

    monkeypatch.setattr(cpu_build, "ENGINE", cpu_build.KernelBuild(cpu_build.ENGINE.target, compiler=MISSING))
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


# The sources whose preprocessor branches follow the target's ISA (cpu_ops.cpp binds them, with none)
BRANCHED = tuple(s for s in cpu_build.SOURCES if s != "cpu_ops.cpp")
AVX512_TARGETS = {
    "skylake-x": ["-march=x86-64-v4"],  # AVX-512 F/BW/DQ/VL only: the fp32 GEMV, no VNNI
    "cooper-lake": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],  # BF16 without VBMI
    "sapphire-rapids": ["-march=sapphirerapids"],  # every branch: BF16 + VBMI, VNNI
}


@pytest.mark.skipif(cpu_routes.machine() != "x86_64", reason="x86-64 targets")
@pytest.mark.parametrize("target", list(AVX512_TARGETS))
def test_the_avx512_branches_compile_for_every_avx512_cpu(target):
    """Compiled whatever this CPU is: on an AVX2-only machine no build would otherwise see them. (The
    x86-64-v3 and baseline targets are built and run by the avx2 and baseline lanes of scripts/test.sh.)"""
    cpu_build.compile_only(cpp_extension.get_cxx_compiler(), AVX512_TARGETS[target], BRANCHED)


def test_the_sources_compile_for_aarch64():
    """Arm users build them natively (-march=native); here Debian's cross compiler, against this torch's
    headers, compile only (scripts/cross/install.sh installs it)."""
    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("aarch64-linux-gnu-g++ is missing: bash scripts/cross/install.sh installs it (root and apt-get)")
    cpu_build.compile_only("aarch64-linux-gnu-g++", ["-march=armv8-a"])


@pytest.mark.skipif(cpu_routes.machine() != "x86_64", reason="x86-64 targets")
def test_a_branch_the_target_cannot_run_fails_with_the_compilers_error():
    """What the check catches: the bf16 GEMV branch once took VBMI's vpermi2b under AVX512_BF16 alone,
    which Cooper Lake's -march=native could not build. Claiming VBMI without it reproduces that."""
    flags = ["-march=x86-64-v4", "-mavx512bf16", "-D__AVX512VBMI__"]
    with pytest.raises(RuntimeError, match=r"cpu_gemv.c does not compile with .* -D__AVX512VBMI__: .*vbmi.*error"):
        cpu_build.compile_only(cpp_extension.get_cxx_compiler(), flags, ("cpu_gemv.c",))
