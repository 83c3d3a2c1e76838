"""The RL loop on the tiny Qwen3-MoE config (configs/tiny_moe_cpu.yaml) with expert parallelism 2,
routing replay and full-code guidance: two steps under torchrun on gloo (~10 s on 2 cores, most
of it two processes importing Megatron)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_moe_rl_steps_replay_the_rollouts_routing_with_guidance(tmp_path):
    run_dir = tmp_path / "moe_ep2"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_trace.train",
        "--config",
        "configs/tiny_moe_cpu.yaml",
        "trainer.ep=2",
        "trainer.warm_start_steps=20",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
        "rollout.eval_prompts=8",
        "trainer.micro_batch_size=16",
        "trainer.steps=2",
        "trainer.save_every=0",
        "logging.progress=false",
        "quant.quality_gate=false",  # routing replay is the subject; the gate has its own tests
        f"logging.run_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Megatron-Core TP1 PP1 EP2, routing replay on" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    assert sorted(steps) == [0, 1]
    for r in steps.values():
        assert r["mismatch/routing_replayed"] == 1.0  # the trainer routed exactly as the rollout did
        assert 0.9 < r["mismatch/routing_agreement"] <= 1.0  # its own router mostly would have, too
        # full-code guidance matched by expert id (rank 0's experts under EP2): the rollout's codes
        assert r["mismatch/codeword_disagreement/mean"] < 1e-3
        assert r["mismatch/mean_abs_dlogp"] < 0.01
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
