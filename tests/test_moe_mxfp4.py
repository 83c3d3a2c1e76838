"""MXFP4 routed experts: the trainer's QAT reproduces the embedded engine's expert codes, and the
engine's records of them guide the trainer (tiny Qwen3-MoE, probe in-process)."""

import subprocess
import sys

import pytest
import torch

from megatron_trace.fp4 import mxfp4, unpack_fp4
from megatron_trace.models import make_tiny_checkpoint
from tests.helpers import probe_in_process
from tests.ports import free_port


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe_mxfp4"), "qwen3_moe", seed=0)


def _expert_agreement(mode_result) -> dict[str, float]:
    return {k: v for k, v in mode_result["agreement"].items() if ".mlp.experts." in k}


def test_fp32_rollout_and_trainer_round_expert_inputs_identically(moe_ckpt):
    """Both sides in fp32: round-to-nearest QAT gives the engine's codes at every expert site (the
    down_proj input once Megatron's routing weight is divided out; it was 75% at layer 0 before)."""
    res = probe_in_process(
        moe_ckpt, "--quantization", "mxfp4", "--kv-cache-dtype", "bf16", "--rollout-dtype", "float32"
    )
    rtn = _expert_agreement(res["modes"]["rtn"])
    assert len(rtn) == 2 * 4  # 4 layers x (gate_up, down)
    assert min(rtn.values()) >= 0.999
    assert res["modes"]["rtn"]["mean_abs_dlogp"] < 1e-4 < res["modes"]["off"]["mean_abs_dlogp"]


def test_mxfp4_expert_sites_are_recorded_and_guided(moe_ckpt):
    """bf16 rollout: the engine records the MXFP4 expert sites, guided < rtn < off, and guided
    expert-site agreement >= 99.9% (rtn's is well below: bf16 vs fp32 noise flips codes)."""
    res = probe_in_process(moe_ckpt, "--quantization", "mxfp4", "--kv-cache-dtype", "bf16")
    m = res["modes"]
    assert res["guided_skipped"] is None and res["policy"]["format"] == "mxfp4"
    assert m["guided-full"]["mean_abs_dlogp"] < m["rtn"]["mean_abs_dlogp"] < m["off"]["mean_abs_dlogp"]
    guided = _expert_agreement(m["guided-full"])
    assert len(guided) == 2 * 4 and min(guided.values()) >= 0.999
    rtn = _expert_agreement(m["rtn"])
    assert sum(rtn.values()) / len(rtn) < 0.9


class _WeightedRows:
    """A `select` stub whose rows carry routing weights (as ExpertRows' linear_fc2 does)."""

    def __init__(self, weights):
        self.weights = weights

    def input_weights(self):
        return self.weights


def test_weighted_expert_input_is_quantized_unweighted():
    """QATState.activation of h * w (Megatron's fc2 input) = MXFP4(h) * w (the engine quantizes h),
    which plain MXFP4 of h * w is not: E8M0 block scales cannot absorb a weight like 0.3."""
    from megatron_trace.models import ModelArch, QuantPolicy, tiny_hf_config
    from megatron_trace.trainer.qat import QATState

    torch.manual_seed(0)
    h = torch.randn(64, 96)
    w = torch.rand(64) * 0.9 + 0.05
    state = QATState(
        ModelArch.from_hf_config(tiny_hf_config("qwen3_moe")), QuantPolicy(kv="bf16", format="mxfp4"), "rtn"
    )
    got = state.activation(
        (h * w[:, None])[:, None], "model.layers.0.mlp.experts.down_proj", None, select=_WeightedRows(w)
    )
    want = mxfp4.dequantize(mxfp4.quantize(h)) * w[:, None]
    torch.testing.assert_close(got[:, 0], want, rtol=0, atol=1e-6)
    plain = mxfp4.quantize(h * w[:, None])
    assert (unpack_fp4(plain.data) != unpack_fp4(mxfp4.quantize(h).data)).float().mean() > 0.05


def test_tp_that_splits_an_mxfp4_block_is_refused_by_name(moe_ckpt, tmp_path):
    """TP2 gives each rank 16 of the tiny experts' 32 intermediate channels: half an E8M0 block,
    which the ranks cannot quantize alone. The trainer says so and names the linear and the fix."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_trace.quality.probe",
        "--model-path",
        str(moe_ckpt),
        "--quantization",
        "mxfp4",
        "--kv-cache-dtype",
        "bf16",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "4",
        "--tp",
        "2",
        "--json",
        str(tmp_path / "out.json"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "linear_fc2 holds K=16 per TP rank, not a multiple of MXFP4's 32-element blocks" in proc.stderr
