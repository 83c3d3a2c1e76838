"""Sequence parallelism with QAT on two gloo processes: the project's layer spec runs Megatron's SP
on CPU (its norms allow it), each rank's QAT linears quantize its [S/TP, B, H] rows with the
guidance rows sliced to match, and recompute and a guided training step give TP2's numbers
(forward bit for bit) and TP1's (to float tolerance)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_trace.models import QuantPolicy, make_tiny_checkpoint  # noqa: E402
from tests.ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POLICY = QuantPolicy(kv="nvfp4", targets=("*.self_attn.*", "*.mlp.*"))  # as in the worker
PROMPTS = [[5, 17, 40, 2, 99, 7, 31, 4], [11, 3, 250, 8], [64, 1, 9, 200, 45]]


def _rollout(ckpt, root: Path) -> None:
    """bf16 engine rollout with full guidance; 8 + 6 tokens make the longest row S = 13, which the
    actor pads to 14 under SP (SP splits S over the 2 ranks)."""
    from sglang_backend.local import Engine

    eng = Engine(
        str(ckpt), dtype="bfloat16", quant_policy=POLICY, guidance_mode="full", guided_layers="all", random_seed=0
    )
    try:
        outs = eng.generate(
            input_ids=PROMPTS,
            sampling_params=[
                {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": i}
                for i in range(len(PROMPTS))
            ],
            return_logprob=True,
            return_guidance=True,
        )
        (root / "records").mkdir()
        samples = []
        for i, (p, o) in enumerate(zip(PROMPTS, outs)):
            record = eng.fetch_guidance(o["meta_info"]["guidance_handle"])
            record.validate(len(p) + len(o["output_ids"]) - 1)
            (root / "records" / f"{i}.bin").write_bytes(record.to_bytes())
            samples.append(
                {
                    "prompt": p,
                    "response": o["output_ids"],
                    "advantage": 1.0 - i,
                    "logprobs": [t[0] for t in o["meta_info"]["output_token_logprobs"]],
                }
            )
    finally:
        eng.shutdown()
    (root / "samples.json").write_text(json.dumps(samples))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen2", seed=0)
    _rollout(ckpt, root)
    out = root / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "mp_scripts" / "sp_qat_check.py"),
        "--ckpt",
        str(ckpt),
        "--samples",
        str(root / "samples.json"),
        "--records",
        str(root / "records"),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("tp1", "tp2", "tp2_sp")}


def _max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_sequence_parallel_recompute_equals_tp2_and_tp1_in_every_mode(runs):
    tp1, tp2, sp = runs["tp1"], runs["tp2"], runs["tp2_sp"]
    for mode in ("off", "rtn", "guided"):
        assert sp[mode] == tp2[mode], mode  # same reductions, rows split: bit for bit
        assert _max_diff(sp[mode], tp1[mode]) < 1e-4, mode
        assert sp[mode + "_unguided"] == {}, mode
    assert _max_diff(tp1["off"], tp1["rtn"]) > 1e-3 and _max_diff(tp1["rtn"], tp1["guided"]) > 1e-3
    # Rank 0 under SP quantizes only its half of the rows: guided still meets the rollout's codes there.
    agree = sp["guided_agreement"]
    assert any(k.endswith("self_attn.qkv_proj") for k in agree) and min(agree.values()) >= 0.999
    assert max(sp["rtn_agreement"].values()) < 0.999


def test_sequence_parallel_training_step_matches_tp2(runs):
    """One guided Adam step: SP's norm-weight grads (all-reduced by Megatron as SP params) and the
    rest give TP2's update, so the post-step logprobs agree."""
    tp1, tp2, sp = runs["tp1"], runs["tp2"], runs["tp2_sp"]
    assert sp["step"]["update_ok"] and sp["step"]["loss"] == pytest.approx(tp2["step"]["loss"], abs=1e-6)
    assert sp["step"]["grad_norm"] == pytest.approx(tp2["step"]["grad_norm"], rel=1e-5)
    assert _max_diff(sp["after_step"], tp2["after_step"]) < 1e-4
    assert _max_diff(sp["after_step"], tp1["after_step"]) < 1e-3
    assert _max_diff(sp["after_step"], sp["guided"]) > 1e-3  # the step moved the policy
