"""benchmarks/fp4_kernels.py --cpu-check: every kernel path, check and table row on tiny shapes."""

import os
import subprocess
import sys

import pytest

from megatron_trace.kernels.dispatch import triton_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_cpu_check_runs_every_path(tmp_path):
    out = tmp_path / "table.md"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fp4_kernels.py"), "--cpu-check", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md = out.read_text()
    for row in (
        "W4A16 GEMM",
        "W4A4 GEMM",
        "BF16 paged attn",
        "NVFP4 paged attn",
        "MXFP4 paged attn",
        "bf16 copy",
        "quantize per-token",
        "quantize+guidance mantissa",
    ):
        assert f"| {row} |" in md, row
    assert "FAIL" not in md
