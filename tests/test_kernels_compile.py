"""The Triton NVFP4 quantize kernel compiles to GPU code for Hopper (sm_90) and Blackwell (sm_100)
in every variant (round-to-nearest with each scale mode and the mantissa capture, guided rounding
full and mantissa with scalar and per-row S_enc). The interpreter runs the same source on CPU but
accepts things the GPU compiler rejects; triton.compile needs no GPU."""

import os
import subprocess
import sys

import pytest

from megatron_trace.kernels.dispatch import triton_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_trace.kernels import nvfp4_quantize as m

fn = m._nvfp4_quantize_kernel
names = fn.arg_names
types = {"x_ptr": "*bf16", "senc_ptr": "*fp32", "sdec_ptr": "*fp32", "senc_out_ptr": "*fp32",
         "M": "i32", "K": "i32", "stride_xm": "i32", "k_tiles_per_prog": "i32"}
variants = [(m._SCALAR, m._RTN, False), (m._PER_ROW, m._RTN, False), (m._FUSED_ROW, m._RTN, False),
            (m._FUSED_ROW, m._RTN, True)]
variants += [(s, g, False) for g in (m._GUIDED_FULL, m._GUIDED_MANTISSA) for s in (m._SCALAR, m._PER_ROW)]
for arch in (90, 100):
    for mode, guide, mantissa in variants:
        const = {"MODE": mode, "GUIDE": guide, "MANTISSA": mantissa, "BLOCK_M": 16, "BLOCK_K": 256}
        sig = {n: "constexpr" if n in const else types.get(n, "*u8") for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
        out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False})
        assert len(out.asm["cubin"]) > 0
        print("ok", arch, mode, guide, mantissa)
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_quantize_kernel_compiles_for_sm90_and_sm100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    res = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok ") == 16
