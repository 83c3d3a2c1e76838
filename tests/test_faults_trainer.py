"""The trainer SIGKILLed in the middle of a real checkpoint save; the previous checkpoint stays
`latest`, `--resume` continues from it, and the half-written shard is refused by name.

The save is real (`Actor.save_checkpoint` of the tiny run); a test-only wrapper only throttles
the bytes of `torch.save` into `step_N.tmp/` (the 2nd save on) so the kill lands mid-write
instead of racing a few-millisecond save. Kill mid-step + exact resume: tests/test_train_loop.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--config", "configs/tiny_cpu.yaml", "trainer.warm_start_steps=0", "rollout.prompts_per_step=2",
        "rollout.n_samples=2", "rollout.eval_prompts=0", "trainer.micro_batch_size=4", "logging.progress=false",
        "trainer.steps=2", "trainer.save_every=1"]

SLOW_SAVE = r'''
import io, os, runpy, sys, time
import torch

_save, _n = torch.save, [0]

def slow_save(obj, f, *a, **kw):
    if not (isinstance(f, (str, os.PathLike)) and ".tmp" in str(f)):
        return _save(obj, f, *a, **kw)
    _n[0] += 1
    if _n[0] < 2:  # step_0 saves normally
        return _save(obj, f, *a, **kw)
    buf = io.BytesIO()
    _save(obj, buf, *a, **kw)
    data = buf.getvalue()
    with open(f, "wb") as fh:
        for i in range(0, len(data), 4096):
            fh.write(data[i:i + 4096]); fh.flush()
            time.sleep(0.05)

torch.save = slow_save
sys.argv = ["megatron_trace.train", *sys.argv[1:]]
runpy.run_module("megatron_trace.train", run_name="__main__", alter_sys=True)
'''


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": str(ROOT)}


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "rollout/reward_mean" in r}


def test_kill_mid_checkpoint_save_keeps_previous_and_resumes(tmp_path):
    run_dir = tmp_path / "runs" / "cut"
    ckpt = run_dir / "checkpoints"
    wrapper = tmp_path / "slow_save_train.py"
    wrapper.write_text(SLOW_SAVE)
    proc = subprocess.Popen([sys.executable, str(wrapper), *BASE, f"logging.run_dir={run_dir}"], cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    shard = ckpt / "step_1.tmp" / "rank_00000.pt"
    deadline = time.time() + 300
    try:
        while not (shard.exists() and shard.stat().st_size > 0):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "the run never started saving step 1"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # a real kill while the real save is writing
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    full = (ckpt / "step_0" / "rank_00000.pt").stat().st_size
    assert 0 < shard.stat().st_size < full, "the kill did not land mid-write"
    assert (ckpt / "latest").read_text() == "step_0" and not (ckpt / "step_1").exists()
    assert not (ckpt / "step_1.tmp" / "meta.json").exists()

    # The half-written shard, were it ever pointed at, is refused by name and nothing is loaded.
    from megatron_trace.trainer.actor import Actor

    bad = tmp_path / "bad"
    (bad / "step_1").mkdir(parents=True)
    (bad / "step_1" / "rank_00000.pt").write_bytes(shard.read_bytes())
    (bad / "step_1" / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    (bad / "latest").write_text("step_1")
    with pytest.raises(ValueError, match=r"step_1/rank_00000\.pt is unreadable"):
        Actor.load_checkpoint(SimpleNamespace(), bad)  # fails before touching the (absent) model

    # --resume loads step_0 (latest) and continues: step 1 is trained and saved again.
    res = subprocess.run([sys.executable, "-m", "megatron_trace.train", *BASE, f"logging.run_dir={run_dir}",
                          "--resume"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert (ckpt / "latest").read_text() == "step_1" and not (ckpt / "step_1.tmp").exists()
    meta = json.loads((ckpt / "step_1" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["version"] == 2
    m = _metrics(run_dir)
    assert set(m) == {0, 1} and json.loads((run_dir / "summary.json").read_text())["steps"] == 1
