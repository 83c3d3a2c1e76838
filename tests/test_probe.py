"""The mismatch probe end to end: engine rollout (bf16) vs Megatron recompute (fp32), TP1 and TP2."""

import json
import subprocess
import sys
import time

import pytest

from megatron_trace.models import make_tiny_checkpoint
from tests.helpers import probe_in_process
from tests.ports import free_port


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("probe"), "qwen2", seed=0)


def _run(args, tmp_path, nproc=1):
    out = tmp_path / f"probe_{nproc}.json"
    args = ["--kv-cache-dtype", "nvfp4", *args]  # NVFP4 K and V unless the test says (the qwen2 auto is FP8 K)
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_trace.quality.probe"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            "-m",
            "megatron_trace.quality.probe",
        ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + args + ["--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tp1(ckpt, tmp_path_factory):
    """One TP1 probe run, shared: the guided/rtn/off ordering and the TP2 reference."""
    return _run(_probe_args(ckpt), tmp_path_factory.mktemp("tp1"))


def _probe_args(ckpt):
    return ["--model-path", str(ckpt), "--num-prompts", "6", "--max-new-tokens", "24"]


def test_guided_beats_rtn_beats_off_and_agrees_on_every_site(tp1):
    res, stdout, seconds = tp1
    m = res["modes"]
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    assert m["guided-mantissa"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"]
    full, mant = m["guided-full"]["agreement"], m["guided-mantissa"]["agreement"]
    assert len(full) == len(mant) == 4 * 4  # 4 layers x (gate_up, down, k, v)
    assert min(full.values()) >= 0.999
    # Mantissa mode measured against the rollout's full codes (not its own bits): one bit cannot
    # recover a code two codewords away, so it agrees a little less than full codes do.
    assert 0.99 <= min(mant.values()) and sum(mant.values()) <= sum(full.values())
    for mode in ("guided-full", "guided-mantissa"):  # guidance did override round-to-nearest somewhere
        assert len(m[mode]["override"]) == 16 and 0 < max(m[mode]["override"].values()) < 0.5
    assert max(m["rtn"]["agreement"].values()) < 0.999  # bf16 vs fp32 noise does flip rtn codes
    assert m["guided-mantissa"]["guidance_bytes_per_token"] < 0.5 * m["guided-full"]["guidance_bytes_per_token"]
    assert any(k.startswith("dlogp_pos_") for k in m["off"])
    assert "| guided-full |" in stdout


def test_tp2_gives_the_tp1_numbers(ckpt, tp1, tmp_path):
    one, two = tp1[0], _run(_probe_args(ckpt) + ["--tp", "2"], tmp_path, nproc=2)[0]
    for mode in ("off", "rtn", "guided-full"):
        assert two["modes"][mode]["mean_abs_dlogp"] == pytest.approx(
            one["modes"][mode]["mean_abs_dlogp"], rel=1e-3, abs=1e-5
        )
    assert min(two["modes"]["guided-full"]["agreement"].values()) >= 0.999


def test_bad_flags_are_named(ckpt):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_trace.quality.probe", "--model-path", str(ckpt), "--tp", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--tp must be >= 1" in proc.stderr


def test_moe_experts_follow_the_rollout(tmp_path_factory, tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=0)
    res, _, _ = _run(["--model-path", str(ckpt), "--num-prompts", "4", "--max-new-tokens", "16"], tmp_path)
    m = res["modes"]
    assert m["guided-full"]["mean_abs_dlogp"] < 0.3 * m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    experts = {k: v for k, v in m["guided-full"]["agreement"].items() if ".mlp.experts." in k}
    assert len(experts) == 2 * 4
    # With routing replay (on for MoE) the trainer routes as the rollout did; test_routing_replay
    # pins >= 99.9% and what replay buys over guided-full-no-replay.
    rtn_experts = [v for k, v in m["rtn"]["agreement"].items() if ".mlp.experts." in k]
    assert min(experts.values()) > 0.95 and sum(rtn_experts) / len(rtn_experts) < 0.8


def test_w4a16_with_nvfp4_kv_guides_k_and_v(ckpt):
    """W4A16 NVFP4 + NVFP4 KV: the only guided sites are K and V; guided < rtn < off there."""
    res = probe_in_process(ckpt, "--quantization", "w4a16_nvfp4", "--kv-cache-dtype", "nvfp4")
    m = res["modes"]
    assert res["guided_skipped"] is None
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree = m["guided-full"]["agreement"]
    assert sorted({k.rsplit(".", 1)[1] for k in agree}) == ["k_cache", "v_cache"] and min(agree.values()) >= 0.999


def test_mxfp4_activations_and_kv_are_guided(ckpt):
    """MXFP4 W4A4 + MXFP4 KV: the rollout records E8M0 scales and codes at every FP4 site (linear
    inputs, K, V), and guided < rtn < off with every site's agreement >= 99.9%."""
    res = probe_in_process(ckpt, "--quantization", "mxfp4", "--kv-cache-dtype", "mxfp4")
    m = res["modes"]
    assert res["guided_skipped"] is None and res["policy"]["format"] == "mxfp4"
    assert m["guided-full"]["mean_abs_dlogp"] < 0.1 * m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree = m["guided-full"]["agreement"]
    assert {"k_cache", "v_cache", "gate_up_proj", "down_proj"} <= {k.rsplit(".", 1)[1] for k in agree}
    assert min(agree.values()) >= 0.999 and min(m["rtn"]["agreement"].values()) < 0.9


def test_mxfp4_weights_are_modelled_as_mxfp4_and_unguidable_runs_say_so(ckpt):
    """W4A16 MXFP4: plain QAT with the engine's MXFP4 weights closes most of the gap (NVFP4-modelled
    weights would not); the engine records no MXFP4 guidance, so the probe runs off/rtn and says why."""
    res = probe_in_process(ckpt, "--quantization", "w4a16_mxfp4", "--kv-cache-dtype", "bf16")
    m = res["modes"]
    assert sorted(m) == ["off", "rtn"] and "no guided modes" in res["guided_skipped"]
    assert m["rtn"]["mean_abs_dlogp"] < 0.2 * m["off"]["mean_abs_dlogp"]
    assert res["policy"]["format"] == "mxfp4" and res["policy"]["activations"] == "bf16"


def test_fp8_k_and_v_are_guided_sites(ckpt):
    """W4A16 NVFP4 + FP8 K and V: the rollout records each token's S_enc and E4M3 bytes (or their low
    bits) and the trainer rounds to them. With an fp32 rollout every code agrees; with the bf16 one,
    guided < rtn < off in both modes, but FP8 resolves small elements finer than a bf16 rollout and an
    fp32 trainer agree (several E4M3 codewords near zero), so some codes stay more than one codeword
    apart, where neither one bit nor the nearer bracket reaches: agreement >= 90% and above rtn's."""
    exact = probe_in_process(
        ckpt, "--quantization", "w4a16_nvfp4", "--kv-cache-dtype", "fp8", "--rollout-dtype", "float32"
    )
    assert min(exact["modes"]["guided-mantissa"]["agreement"].values()) == 1.0
    res = probe_in_process(ckpt, "--quantization", "w4a16_nvfp4", "--kv-cache-dtype", "fp8")
    m = res["modes"]
    assert res["guided_skipped"] is None
    for mode in ("guided-full", "guided-mantissa"):
        assert m[mode]["mean_abs_dlogp"] < 0.5 * m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree, rtn = m["guided-full"]["agreement"], m["rtn"]["agreement"]
    assert sorted({k.rsplit(".", 1)[1] for k in agree}) == ["k_cache", "v_cache"]
    assert min(agree.values()) >= 0.9 and all(agree[k] > rtn[k] + 0.02 for k in agree), (agree, rtn)
    # a byte per element in full mode, a bit in mantissa mode (plus 4 bytes of S_enc per token)
    assert m["guided-mantissa"]["guidance_bytes_per_token"] < 0.25 * m["guided-full"]["guidance_bytes_per_token"]


def test_kv_only_policy_models_the_fp4_kv_cache(ckpt):
    """quant.format bf16 with NVFP4 K and V (--quantization none): the rollout records K/V guidance,
    and guided < rtn < off with K/V agreement >= 99.9%."""
    res = probe_in_process(ckpt, "--quantization", "none", "--kv-cache-dtype", "nvfp4")
    m = res["modes"]
    assert res["policy"]["format"] == "bf16" and res["guided_skipped"] is None
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree = m["guided-full"]["agreement"]
    assert sorted({k.rsplit(".", 1)[1] for k in agree}) == ["k_cache", "v_cache"] and min(agree.values()) >= 0.999


def test_static_activation_scales_are_calibrated_and_guided(ckpt):
    """--activation-scale static: one calibrated S_enc per FP4-activation site, on both sides (the
    engine got it as input_scale, the trainer's QAT from the same amax); guided < rtn < off, and the
    guided trainer reproduces every rollout code (>= 99.9%) with the static scale."""
    res = probe_in_process(ckpt, "--activation-scale", "static")
    m = res["modes"]
    assert res["policy"]["activation_scale"] == "static" and res["guided_skipped"] is None
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    agree = m["guided-full"]["agreement"]
    assert len(agree) == 4 * 4 and min(agree.values()) >= 0.999
    # every record carries the one S_enc per site the trainer used (a per-token scale would read -1 here)
    scales = res["static_scales"]
    assert len(scales["trainer"]) == 4 * 2 and scales["rollout"] == scales["trainer"]
    assert all(v[0] > 0 for v in scales["trainer"].values())


def test_static_activation_scale_needs_nvfp4_w4a4(ckpt):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_trace.quality.probe",
            "--model-path",
            str(ckpt),
            "--quantization",
            "w4a16_nvfp4",
            "--activation-scale",
            "static",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--activation-scale static needs --quantization nvfp4" in proc.stderr
