"""benchmarks/train_phase.py runs end to end on the tiny config (the benchmark itself is not a timed
test: BENCHMARKS.md holds its figures on the real model)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[1]


def test_every_trainer_mode_trains_the_same_rollout_batch(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--config", "configs/tiny_cpu.yaml", "--samples", "4", "--max-new-tokens", "8", "--rounds", "1"]
    args += ["--recompute", "full,none"]  # both on the one built model
    args += ["--json", str(out), "trainer.warm_start_steps=0", f"logging.run_dir={tmp_path / 'run'}"]
    args += ["trainer.dtype=bfloat16", "trainer.optimizer_offload=disk"]  # the real config's trainer
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_phase.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| guided | none |" in proc.stdout and "matmul floor" in proc.stdout
    res = json.loads(out.read_text())
    assert set(res["median"]) == {f"{m}/{r}" for m in ("off", "rtn", "guided") for r in ("full", "none")}
    assert res["floor_s"]["full"] > res["floor_s"]["none"] > 0 and res["gemm_gflops"] > 0
    assert all(r["s"] > 0 for runs in res["runs"].values() for r in runs)
