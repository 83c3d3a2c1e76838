"""The actor under TP/PP: QAT recompute, a train step's grad norm, and checkpoint reload match TP1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.models import make_tiny_checkpoint
from tests.ports import free_port

SCRIPT = Path(__file__).parent / "mp_scripts" / "actor_check.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3", seed=2)
    out = tmp_path_factory.mktemp("out")
    launches = [(1, "1x1"), (2, "2x1,1x2")]  # (nproc, TPxPP layouts run one after another)
    for nproc, layouts in launches:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            str(SCRIPT),
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
            "--layouts",
            layouts,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    tags = [tuple(layout.split("x")) for _, layouts in launches for layout in layouts.split(",")]
    return {f"tp{tp}_pp{pp}": json.loads((out / f"rtn_tp{tp}_pp{pp}.json").read_text()) for tp, pp in tags}


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2"])
def test_parallel_layouts_match_tp1(results, layout):
    ref, got = results["tp1_pp1"], results[layout]
    for key in ("before", "step", "after"):
        for a, b in zip(ref[key], got[key]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-5), key
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)


def test_step_changes_the_policy_and_checkpoint_reloads_exactly(results):
    r = results["tp1_pp1"]
    assert r["before"] == r["step"]  # the train step's forward is the pre-update recompute
    assert r["after"] != r["before"]
    assert r["reloaded"] == r["after"]


def test_finish_training_frees_the_optimizer_and_keeps_the_weights(results):
    """What a run does before its measurement after training (the 0.5B config's peak phase)."""
    for r in results.values():
        assert r["state_tensors"] > 0 and r["state_alive"] == 0
        assert r["after_finish"] == r["reloaded"]
        assert "finish_training" in r["step_refused"]
