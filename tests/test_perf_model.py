"""Sanity properties of the rollout roofline model (megatron_trace/perf/roofline.py); stdlib math, < 1 s."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.perf import roofline as pm
from megatron_trace.perf import step as ps

M72 = pm.MODELS["qwen2.5-72b"]
H200, B200 = pm.GPUS["h200"], pm.GPUS["b200"]
NO_OVERHEAD = dict(step_overhead_ms=0.0, allreduce_us=0.0)


def test_param_counts_match_published_sizes():
    assert pm.weight_bytes(M72, pm.PRECISIONS["bf16"]) / 1e9 == pytest.approx(145.4, abs=1.0)
    assert pm.total_params(pm.MODELS["qwen3-30b-a3b"]) / 1e9 == pytest.approx(30.5, abs=0.5)
    assert pm.total_params(pm.MODELS["qwen3-235b-a22b"]) / 1e9 == pytest.approx(235.1, abs=1.0)
    assert pm.active_linear_params(pm.MODELS["qwen3-235b-a22b"]) / 1e9 == pytest.approx(21, abs=1.0)
    # 72B KV: 80 layers x 2 x 8 heads x 128 x 2 B = 320 KiB per token in BF16
    assert pm.kv_bytes_per_token(M72, pm.PRECISIONS["bf16"]) == 327680


def test_nvfp4_bits_and_byte_ceiling():
    assert pm.PRECISIONS["nvfp4"].weight_bits == 4.5
    assert pm.byte_ceiling("nvfp4") == pytest.approx(16 / 4.5)


@pytest.mark.parametrize("gpu", ["h200", "b200", "gb200"])
@pytest.mark.parametrize("L", [4096, 131072])
def test_bf16_speedup_is_one(gpu, L):
    d = pm.decompose(M72, pm.GPUS[gpu], 8, 16, 4, 1024, L, "bf16", pm.Eff())
    for k in ("bytes", "batch", "flops", "total"):
        assert d[k] == pytest.approx(1.0)


@pytest.mark.parametrize("model", list(pm.MODELS))
@pytest.mark.parametrize("L", [4096, 32768, 131072])
def test_fixed_batch_speedup_below_byte_ceiling(model, L):
    """Same batch, bandwidth-bound decode: bytes alone can't beat 16/4.5."""
    m, eff = pm.MODELS[model], pm.Eff(**NO_OVERHEAD)
    b = 8
    t16 = pm.decode_time(m, H200, 8, b, 1024, L, pm.PRECISIONS["bf16"], "bf16", eff)
    t4 = pm.decode_time(m, H200, 8, b, 1024, L, pm.PRECISIONS["nvfp4"], "fp4", eff)
    assert 1.0 < t16 / t4 <= pm.byte_ceiling("nvfp4") + 1e-9
    # and the decomposition's bytes factor obeys the same bound
    d = pm.decompose(m, B200, 8, 16, 4, 1024, L, "nvfp4", pm.Eff(), "decode_s")
    assert d["bytes"] <= pm.byte_ceiling("nvfp4") + 1e-9


def test_decomposition_multiplies_to_total():
    eff = pm.Eff()
    for L in (8192, 131072):
        d = pm.decompose(M72, B200, 8, 16, 4, 1024, L, "nvfp4", eff)
        r0 = pm.rollout(M72, B200, 8, 16, 4, 1024, L, pm.same("bf16"), eff)
        r1 = pm.rollout(M72, B200, 8, 16, 4, 1024, L, pm.same("nvfp4"), eff)
        assert d["bytes"] * d["batch"] * d["flops"] == pytest.approx(r0.total_s / r1.total_s)


def test_hopper_has_no_fp4_flops_gain():
    d = pm.decompose(M72, H200, 8, 16, 4, 8192, 4096, "nvfp4", pm.Eff())
    assert d["flops"] == pytest.approx(1.0)
    assert H200.peak("fp4") == H200.peak("bf16") and B200.peak("fp4") == 4 * B200.peak("bf16")


def test_batch_grows_about_356x_when_kv_dominates_memory():
    # Qwen3-30B-A3B on B200 TP8: weights are ~4% of HBM per GPU, so B scales ~ with 16/4.5.
    m, eff = pm.MODELS["qwen3-30b-a3b"], pm.Eff(max_batch=10**6)
    b16 = pm.max_batch(m, B200, 8, pm.PRECISIONS["bf16"], 132096, eff)
    b4 = pm.max_batch(m, B200, 8, pm.PRECISIONS["nvfp4"], 132096, eff)
    assert b4 / b16 == pytest.approx(16 / 4.5, rel=0.08)
    assert b4 / b16 >= 16 / 4.5 - 0.1  # freed weight memory only adds
    # with weights a big share (72B TP4 on H200) the growth is well above 3.56x
    r = pm.max_batch(M72, H200, 4, pm.PRECISIONS["nvfp4"], 132096, eff) / pm.max_batch(
        M72, H200, 4, pm.PRECISIONS["bf16"], 132096, eff
    )
    assert r > 4.5


def test_kv_heads_replicate_past_tp():
    m = pm.MODELS["qwen3-30b-a3b"]  # 4 KV heads
    p = pm.PRECISIONS["bf16"]
    assert pm.kv_bytes_per_token_gpu(m, p, 4) == pm.kv_bytes_per_token_gpu(m, p, 8)
    assert pm.kv_bytes_per_token_gpu(M72, p, 8) * 8 == pm.kv_bytes_per_token(M72, p)


def test_monotonic_in_length():
    eff = pm.Eff()
    prev_t, prev_b = 0.0, math.inf
    for L in (4096, 8192, 16384, 32768, 65536, 131072):
        r = pm.rollout(M72, H200, 8, 16, 4, 1024, L, pm.same("bf16"), eff)
        assert r.total_s > prev_t and r.batch <= prev_b
        prev_t, prev_b = r.total_s, r.batch


def test_oom_when_weights_do_not_fit():
    r = pm.rollout(pm.MODELS["qwen3-235b-a22b"], H200, 2, 16, 1, 1024, 4096, pm.same("bf16"), pm.Eff())
    assert r.batch == 0 and math.isinf(r.total_s)


def test_moe_expert_fraction():
    m = pm.MODELS["qwen3-30b-a3b"]
    assert pm.expert_fraction_read(m, 1) == pytest.approx(8 / 128)
    assert pm.expert_fraction_read(m, 1000) == pytest.approx(1.0)
    assert pm.expert_fraction_read(M72, 1) == 1.0


def test_guidance_bytes():
    for m in list(pm.MODELS.values()) + [pm.QWEN35_35B_A3B]:
        for layers in ("half", "all"):
            fa, fk = ps.guidance_bytes_per_token(m, "full", layers)
            ma, mk = ps.guidance_bytes_per_token(m, "mantissa", layers)
            assert ma < fa and mk < fk
        assert sum(ps.guidance_bytes_per_token(m, "full", "half")) < sum(ps.guidance_bytes_per_token(m, "full", "all"))
    # site format: 2048 elements full = 1024 B codes + 128 B scales + 4 B global
    assert ps.site_bytes(2048, "full") == 1156 and ps.site_bytes(2048, "mantissa") == 388
    # TRACE paper figures for Qwen3.5-35B-A3B: 45 KB act + 5.6 KB KV full, 7.5 KB mantissa (last 20)
    act, kv = ps.paper_style_guidance(pm.QWEN35_35B_A3B, "full", "all")
    assert act / 1024 == pytest.approx(45.0) and kv / 1024 == pytest.approx(5.6, abs=0.05)
    assert ps.paper_style_guidance(pm.QWEN35_35B_A3B, "mantissa", "half")[0] / 1024 == pytest.approx(7.5)


def test_sync_and_qat():
    r = ps.sync_bytes(M72, "bf16") / ps.sync_bytes(M72, "nvfp4")
    assert 3.0 < r < 16 / 4.5
    q = ps.qat_overhead(M72, H200, 8, 16384, pm.Eff())
    assert 0 < q["act_frac"] < 0.05 and 0 < q["weight_frac"] < 0.05


def test_measured_numbers_override_and_are_labelled():
    e = pm.eff_from_measured({"copy_bw_tbs": 4.3, "h200": {"gemv_pct_roofline": 70}}, "h200")
    assert e.gemv == pytest.approx(0.70) and e.source("gemv") == "measured" and e.source("attn") == "assumed"
    assert e.bw(H200, "gemv") == pytest.approx(4.8e12 * 0.70)
    assert e.bw(H200, "attn") == pytest.approx(3.6e12)  # 0.75 x 4.8 < 4.3: copy BW caps, never raises
    e.gemv = 0.98
    assert e.bw(H200, "gemv") == pytest.approx(4.3e12)
    assert pm.eff_from_measured({"h200": {"gemv": 0.5}}, "b200").gemv == 0.8


def test_cli_runs(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"h200": {"copy_bw_tbs": 4.3}}))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "perf_model.py"
    out = subprocess.run(
        [sys.executable, str(script), "--model", "qwen2.5-72b", "--gpu", "h200", "--measured", str(f), "--markdown"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "| 128K |" in out.stdout and "copy_bw_tbs | 4.3 | measured" in out.stdout


def test_kv_bits_per_side_and_the_fp8_k_precision():
    assert pm.kv_pair_bits("bf16", "bf16") == 32
    assert pm.kv_pair_bits("nvfp4", "nvfp4") == 9
    assert pm.kv_pair_bits("fp8", "nvfp4", row=128) == 8.25 + 4.5
    assert pm.kv_pair_bits("fp8", "nvfp4", row=2 * 64) == 8.25 + 4.5  # Qwen2.5-0.5B: 2 KV heads of 64
    p = pm.PRECISIONS["nvfp4_fp8k"]
    assert pm.kv_bytes_per_token(M72, p) == 327680 * 12.75 / 32
    assert pm.byte_ceiling("nvfp4_fp8k") == pytest.approx(32 / 12.75)
    with pytest.raises(ValueError, match="KV format must be one of"):
        pm.kv_side_bits("int8")
