"""megatron_trace/kernels/cpu_routes: MEGATRON_TRACE_CPU_ISA read once, the libraries capped before torch's
first op, and every CPU route decided by what the CPU can do, said once, with the fallback's numbers.

The capped runs are subprocesses: a process's caps are fixed once torch has run an op, so this one
(whatever its own setting) cannot become another CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.kernels import cpu_routes

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.isa_avx2
X86_AVX2 = cpu_routes.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= cpu_routes.cpu_flags()


def _python(code: str, isa: str | None, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    base = {k: v for k, v in base.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", cpu_routes.ENV)}
    if isa is not None:
        base[cpu_routes.ENV] = isa
    base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True, timeout=300)


def test_a_bad_setting_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"MEGATRON_TRACE_CPU_ISA='avx3': must be one of native, avx2, baseline"):
        cpu_routes._read_setting({cpu_routes.ENV: "avx3"})
    assert cpu_routes._read_setting({}) == "native" and cpu_routes._read_setting({cpu_routes.ENV: " AVX2 "}) == "avx2"


def test_a_cap_the_environment_already_sets_otherwise_is_refused():
    env = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    if cpu_routes.machine() == "x86_64":
        with pytest.raises(ValueError, match="caps ONEDNN_MAX_CPU_ISA to AVX2, but the environment sets"):
            cpu_routes._apply_caps("avx2", env)
        env = {"ONEDNN_MAX_CPU_ISA": "avx2"}
        cpu_routes._apply_caps("avx2", env)  # the same cap, spelt in lower case: kept
        assert env == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    cpu_routes._apply_caps("native", env)  # native caps nothing


ROUTES = """
import json, logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from megatron_trace.kernels import cpu_routes, onednn_linear
r = cpu_routes.routes()
cpu_routes.routes()
print(json.dumps({**r.__dict__, "packing": onednn_linear.available(), "line": r.describe()}))
"""


@pytest.mark.skipif(not X86_AVX2, reason="an x86-64 CPU with AVX2, FMA and F16C")
@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_a_capped_process_runs_as_the_lesser_cpu_and_says_so_once(isa):
    res = _python(ROUTES, isa)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["setting"] == isa and got["torch_isa"] == {"avx2": "AVX2", "baseline": "DEFAULT"}[isa]
    assert got["march"] == {"avx2": "-march=x86-64-v3", "baseline": "-march=x86-64"}[isa]
    # no oneDNN bf16 path below AVX-512: packing is off from the start and bf16 GEMMs run in fp32
    assert not got["packing"] and "oneDNN has no bf16 path" in got["onednn_bf16"]
    assert got["bf16_gemm"] == "fp32" and "bf16 GEMMs in fp32 on the up-cast" in got["line"]
    said = [ln for ln in res.stderr.splitlines() if "CPU routes:" in ln]
    assert said == [f"WARNING CPU routes: {got['line']}"]  # once, loudly


def test_native_routes_follow_the_cpu():
    r = cpu_routes.routes()
    assert r.setting == cpu_routes.SETTING and r.torch_isa == torch.backends.cpu.get_cpu_capability()
    bf16_hw = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert r.bf16_gemm == ("bf16" if bf16_hw else "fp32")
    assert (r.onednn_bf16 is None) == bf16_hw


@pytest.mark.skipif(not X86_AVX2, reason="an x86-64 CPU with AVX2")
def test_a_cap_set_after_torch_ran_an_op_is_an_error_not_a_silent_native_run():
    code = (
        "import torch, os\ntorch.ones(4).add_(1)\n"
        f"os.environ['{cpu_routes.ENV}'] = 'avx2'\n"
        "from megatron_trace.kernels import cpu_routes\ncpu_routes.routes()\n"
    )
    res = _python(code, None)
    if "AVX512" not in res.stderr and res.returncode == 0:
        pytest.skip("this CPU's torch dispatches AVX2 anyway: the late cap cannot be told apart")
    assert res.returncode != 0 and "torch ran an op before the cap was set" in res.stderr


@pytest.mark.skipif(not X86_AVX2, reason="an x86-64 CPU with AVX2")
def test_bf16_engine_batches_on_a_cpu_without_bf16_support_answer(tmp_path):
    """The AVX2-only VM's failure: an 8-prompt bf16 decode went through oneDNN's bf16 weight reorder,
    which raised inside the batch and aborted every request. As an AVX2 CPU the engine takes no
    packing, says so in model_info, and answers every prompt."""
    from megatron_trace.models import make_tiny_checkpoint
    from tests.helpers import WIDE

    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", seed=1, dtype="bfloat16", **WIDE)
    code = f"""
import json
from sglang_backend.local import Engine
eng = Engine({str(ckpt)!r}, dtype="bfloat16", quantization="nvfp4")
prompts = [[3 + i, 9 + 2 * i, 17 + i] for i in range(8)]
out = eng.generate(input_ids=prompts, sampling_params={{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
info = eng.get_model_info()
eng.shutdown()
print(json.dumps({{"out": out, "linear": info["cpu_linear"], "routes": info["cpu_routes"]}}))
"""
    res = _python(code, "avx2")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert [o["meta_info"]["finish_reason"]["type"] for o in got["out"]] == ["length"] * 8
    assert all(len(o["output_ids"]) == 6 for o in got["out"])
    assert "gemm: fp32 on the bf16 up-cast (oneDNN has no bf16 path" in got["linear"]
    assert "MEGATRON_TRACE_CPU_ISA=avx2" in got["routes"] and "no oneDNN packing" in got["routes"]


def _fp32_route(monkeypatch):
    monkeypatch.setattr(
        cpu_routes, "routes", lambda: cpu_routes.CpuRoutes("avx2", "x86_64", "AVX2", "", "test", "fp32")
    )


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 200), k=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 99))
def test_the_fp32_route_is_a_bf16_gemm_summed_in_fp32(m, n, k, bias, seed):
    """What the fp32 route computes: the exact product of the bf16 operands (plus the bias), summed in
    fp32, rounded once to bf16; so within half a bf16 ulp (plus the fp32 sum's error) of the fp64
    result. The large operand is up-cast tile by tile: tiles small enough to make several hold the
    same bound, for mm (the chunked head) and for linear outside autograd (the engine)."""
    with pytest.MonkeyPatch.context() as mp:
        _fp32_route(mp)
        mp.setattr(cpu_routes, "TILE_ELEMENTS", 64)
        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, n, generator=g).bfloat16()
        c = torch.randn(n, generator=g).bfloat16() if bias else None
        got = cpu_routes.mm(a, b)  # b row-major
        got_t = cpu_routes.mm(a, b.t().contiguous().t())  # b a transposed weight (column-major)
        lin = cpu_routes.linear(a, b.t().contiguous(), c)  # the engine's: x . W^T + bias
    exact = a.double() @ b.double()
    bound = k * 2.0**-23 * (a.double().abs() @ b.double().abs()) + 1e-30
    for y, want in ((got, exact), (got_t, exact), (lin, exact if c is None else exact + c.double())):
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert bool(((y.double() - want).abs() <= want.abs() * 2.0**-8 + bound + 2.0**-23 * want.abs()).all())


def test_the_fp32_route_is_differentiable_and_its_grads_are_bf16(monkeypatch):
    _fp32_route(monkeypatch)
    x = torch.randn(5, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16().requires_grad_()
    cpu_routes.linear(x, w).float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.float(), x.detach().float().sum(0).expand(8, 16), rtol=2**-7, atol=0)
    assert cpu_routes.gemm_dtype(x) == torch.float32 and cpu_routes.gemm_dtype(x.float()) == torch.float32
    assert cpu_routes.gemm_dtype(torch.zeros(1, dtype=torch.float16)) == torch.float16
