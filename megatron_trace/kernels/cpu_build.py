"""Builds and loads the engine's CPU kernels: the C sources in this directory (`cpu_*.c`, `*.h`,
`cpu_*_parallel.cpp`) and their bindings (`cpu_ops.cpp`, functions of torch tensors), compiled
into one extension by torch.utils.cpp_extension (ninja) on first use.

The engine's build targets what MEGATRON_TRACE_CPU_ISA allows (cpu_routes.py): -march=native, the
x86-64-v3 ISA (AVX2 + FMA + F16C: the AVX2 branches, no AVX-512) or the baseline ISA (the scalar C
paths). The build is cached under CACHE_DIR, one directory per content of the sources, flags, torch
version and target (for -march=native also this CPU's feature flags), so an edit or a torch upgrade
rebuilds and concurrent processes share one build (cpp_extension locks the directory).
When the build is impossible (no C++ compiler, no ninja, a compile error), `module()` returns None,
`reason()` says why, one warning is logged, and the callers run the torch references; the engine
reports it in `model_info()["cpu_linear"]` (sglang_backend/local/layers.streaming_status).

Every source is compiled with -ffp-contract=off and without fast-math: the quantizers' fp32 steps
then round exactly as the torch reference's, so results stay bit-identical.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
from pathlib import Path

import torch

from . import cpu_routes

_HERE = Path(__file__).resolve().parent
SOURCES = (
    "cpu_quant.c",
    "cpu_quant_parallel.cpp",
    "cpu_fused.c",
    "cpu_gemv.c",
    "cpu_gemv_w4a4.c",
    "cpu_gemv_parallel.cpp",
    "cpu_attention_parallel.cpp",
    "cpu_layer_stream.cpp",
    "cpu_sampling_parallel.cpp",
    "cpu_ops.cpp",
)
HEADERS = (
    "cpu_fp4.h",
    "cpu_quant.h",
    "cpu_fused.h",
    "cpu_layer.h",
    "cpu_gemv.h",
    "cpu_fused_typed.h",
    "cpu_attention_typed.h",
    "cpu_layer_typed.h",
)
# -fopenmp: at::parallel_for (cpu_*_parallel.cpp) is an OpenMP pragma in ATen's headers; without it
# the loop runs on the calling thread only. The extension's libgomp.so.1 resolves to the one torch
# already loaded (same soname), so torch.set_num_threads sizes one shared pool.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
TARGETS = cpu_routes.SETTINGS  # native (AVX-512 where the compiler targets it), avx2 (x86-64-v3), baseline
CACHE_DIR = Path.home() / ".cache" / "megatron_trace" / "cpu_kernels"
_log = logging.getLogger(__name__)


class KernelBuild:
    """One build target of the extension, built at most once per process.

    compiler: the C++ compiler the build must find (default: the one torch's build calls, `c++` or
    $CXX); tests point it at a missing one to exercise the loud fallback."""

    def __init__(self, target: str = "native", compiler: str | None = None, enabled: bool = True):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}; got {target!r}")
        self.target, self.compiler, self.enabled = target, compiler, enabled
        self._module, self._reason, self._tried = None, None, False
        self._lock = threading.Lock()  # the engine's worker and server threads may ask first at once

    def module(self):
        """The loaded extension, or None (why: `reason()`; logged once as a warning)."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._load()
        return self._module

    def _load(self) -> None:
        if not self.enabled:
            self._reason = "disabled (megatron_trace.kernels.cpu_build: enabled=False)"
        else:
            try:
                self._module = self._build()
            except Exception as e:  # no compiler / ninja / a compile error: say so, the references serve
                self._reason = f"build failed ({type(e).__name__}: {_last_line(e)})"
        if self._module is None:
            _log.warning(
                "CPU kernels (%s) unavailable: %s. The engine runs the torch references instead "
                "(same numbers, slower). The build needs a C++ compiler and ninja (pip install ninja).",
                self.target,
                self._reason,
            )
        self._tried = True  # last: a thread past the unlocked check sees the finished state

    def reason(self) -> str | None:
        """None when built, else why not (for model_info and benchmark columns)."""
        self.module()
        return self._reason

    def _build(self):
        from torch.utils import cpp_extension

        compiler = self.compiler or cpp_extension.get_cxx_compiler()
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang++, or set CXX)")
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed (pip install ninja): torch.utils.cpp_extension builds with it")
        march = cpu_routes.MARCH.get(cpu_routes.machine(), {}).get(self.target)
        if march is None:
            raise RuntimeError(f"target {self.target} does not exist on {cpu_routes.machine()}")
        flags = [*FLAGS, march]
        name = f"megatron_trace_cpu_kernels_{self.target}"
        build = CACHE_DIR / f"{self.target}-torch{torch.__version__.replace('+', '_')}-{self._stamp(flags)}"
        build.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name,
            [str(_HERE / s) for s in SOURCES],
            extra_cflags=flags,
            extra_include_paths=[str(_HERE)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )

    def _stamp(self, flags: list[str]) -> str:
        h = hashlib.sha256(" ".join(flags).encode())
        for f in SOURCES + HEADERS:
            h.update(f.encode() + b"\0" + (_HERE / f).read_bytes())
        if self.target == "native":
            h.update(" ".join(sorted(cpu_routes.cpu_flags())).encode() or cpu_routes.machine().encode())
        return h.hexdigest()[:16]


def _last_line(e: Exception) -> str:
    """The compiler's first error line when there is one (ninja's own last line says only that it stopped)."""
    lines = str(e).strip().splitlines()
    errors = [ln for ln in lines if "error:" in ln]
    return (errors or lines or [repr(e)])[0 if errors else -1].strip()


def compile_only(compiler: str, target_flags: list[str], sources=SOURCES) -> None:
    """Compiles `sources` to objects with `compiler`, the build's flags and `target_flags` (e.g.
    ["-march=x86-64-v4", "-mavx512bf16"]; an aarch64 cross compiler with ["-march=armv8-a"]) at -O0,
    linking nothing, the sources side by side: how a target this machine cannot run is at least
    compiled (ISA branches this CPU lacks, another architecture). -O0 still inlines the intrinsics'
    always_inline wrappers, so an intrinsic the target lacks fails as in the real build. Raises with
    the compiler's first error."""
    import os
    import subprocess
    import sysconfig
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils import cpp_extension

    includes = [f"-I{_HERE}"]
    for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", path]
    defines = ["-DTORCH_EXTENSION_NAME=megatron_trace_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd = [compiler, *defines, *includes, "-fPIC", "-std=c++20", *FLAGS, *target_flags, "-O0"]
    with tempfile.TemporaryDirectory() as out:

        def compile_one(src: str):
            return src, subprocess.run(
                [*cmd, "-c", str(_HERE / src), "-o", f"{out}/{src}.o"], capture_output=True, text=True
            )

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            results = list(pool.map(compile_one, sources))
    for src, res in results:
        if res.returncode:
            errors = [ln for ln in res.stderr.splitlines() if "error" in ln] or res.stderr.splitlines()[-1:]
            raise RuntimeError(f"{src} does not compile with {compiler} {' '.join(target_flags)}: {errors[0]}")


ENGINE = KernelBuild(cpu_routes.SETTING)  # what the engine runs: the target MEGATRON_TRACE_CPU_ISA allows
_BASELINE = ENGINE if cpu_routes.SETTING == "baseline" else KernelBuild("baseline")


def library():
    """The engine's extension (cpu_routes.SETTING's target), or None when it cannot be built (see KernelBuild)."""
    return ENGINE.module()


def baseline():
    """The baseline-ISA build (scalar C paths), for tests that check them too; raises when unbuildable."""
    mod = _BASELINE.module()
    if mod is None:
        raise RuntimeError(f"baseline CPU kernels unavailable: {_BASELINE.reason()}")
    return mod
