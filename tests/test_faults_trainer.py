"""The trainer SIGKILLed in the middle of a real checkpoint save; the previous checkpoint stays
`latest`, `--resume` continues from it, a half-written shard is refused by name, and a save onto a full disk says so.

The save is real (`Actor.save_checkpoint` of the tiny run); the kill comes from the named fault
point `checkpoint.shard_written` (armed by tests/mp_scripts/with_fault.py), between the shard's
write and the save's commit, so it lands there on any machine. Kill mid-step + exact resume:
tests/test_train_loop.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--config",
    "configs/tiny_cpu.yaml",
    "trainer.warm_start_steps=0",
    "rollout.prompts_per_step=2",
    "rollout.n_samples=2",
    "rollout.eval_prompts=0",
    "trainer.micro_batch_size=4",
    "logging.progress=false",
    "trainer.steps=2",
    "trainer.save_every=1",
    "quant.quality_gate=false",  # faults are the subject; the gate has its own tests
]


def _env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(ROOT),
    }


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "rollout/reward_mean" in r}


def test_kill_mid_checkpoint_save_keeps_previous_and_resumes(tmp_path):
    run_dir = tmp_path / "runs" / "cut"
    ckpt = run_dir / "checkpoints"
    # The kill lands after step 1's shard is on disk and before the save commits it.
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/mp_scripts/with_fault.py"),
            "--kill-at",
            "checkpoint.shard_written:step=1",
            "-m",
            "megatron_trace.train",
            *BASE,
            f"logging.run_dir={run_dir}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
    shard = ckpt / "step_1.tmp" / "rank_00000.pt"
    assert shard.exists() and shard.stat().st_size > 0
    assert (ckpt / "latest").read_text() == "step_0" and not (ckpt / "step_1").exists()
    assert not (ckpt / "step_1.tmp" / "meta.json").exists()

    # The half-written shard, were it ever pointed at, is refused by name and nothing is loaded.
    from megatron_trace.trainer import checkpoint

    bad = tmp_path / "bad"
    (bad / "step_1").mkdir(parents=True)
    data = shard.read_bytes()  # a shard cut off mid-write (as a kill during torch.save leaves it)
    (bad / "step_1" / "rank_00000.pt").write_bytes(data[: len(data) // 2])
    (bad / "step_1" / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    (bad / "latest").write_text("step_1")
    with pytest.raises(ValueError, match=r"step_1/rank_00000\.pt is unreadable"):
        checkpoint.load(bad, None, None)  # fails before touching the (absent) model and optimizer

    # --resume loads step_0 (latest) and continues: step 1 is trained and saved again.
    res = subprocess.run(
        [sys.executable, "-m", "megatron_trace.train", *BASE, f"logging.run_dir={run_dir}", "--resume"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert (ckpt / "latest").read_text() == "step_1" and not (ckpt / "step_1.tmp").exists()
    meta = json.loads((ckpt / "step_1" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["version"] == 2
    m = _metrics(run_dir)
    # the resumed run's summary is the whole run's: step 0 (before the kill) and step 1
    assert set(m) == {0, 1} and json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_a_save_onto_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The disk filling mid-shard (torch's zip writer then raises a bare RuntimeError): an error naming
    the shard, the space left and the knobs; the partial shard removed; `latest` and its load intact."""
    import torch

    from megatron_trace.trainer import checkpoint

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, 1, model, opt)
    saved = model.weight.detach().clone()
    real_save = torch.save

    def fills_the_disk(obj, f):  # a part written, then the writer's own error, as on a full disk
        Path(f).write_bytes(b"\0" * 4096)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8277739776 vs 8277739672")

    monkeypatch.setattr(checkpoint.torch, "save", fills_the_disk)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(OSError, match=r"checkpoint step 2: writing .*rank_00000\.pt failed after 0\.00 GiB") as e:
        checkpoint.save(tmp_path, 2, model, opt)
    assert "GiB free on its disk" in str(e.value) and "trainer.keep_checkpoints" in str(e.value)
    assert "unexpected pos" in str(e.value) and "previous checkpoint stays latest" in str(e.value)
    assert not (tmp_path / "step_2.tmp" / "rank_00000.pt").exists() and not (tmp_path / "step_2").exists()
    assert (tmp_path / "latest").read_text() == "step_1"
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    fresh = torch.nn.Linear(4, 3)
    checkpoint.load(tmp_path, fresh, torch.optim.Adam(fresh.parameters()))
    assert torch.equal(fresh.weight, saved)
