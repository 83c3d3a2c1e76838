"""`rollout.reward=code` through the main command: the tiny model with Qwen's tokenizer (its
152K-token vocabulary, so code reads as code) on rollout.prompts=code_tasks. Its answers are random
text, so what is checked is the wiring: every answer is run in the sandbox and each zero counted by
why (reward/code_*), HumanEval scored before and after (eval/humaneval_pass@1), the quality gate
measured on HumanEval, the mismatch logged along the answer; all read back from TensorBoard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.data.code_reward import REASONS

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAMPLES = 2, 2 * 2


def _overrides(real_qwen) -> list[str]:
    return [
        f"model.tokenizer={real_qwen}",
        "model.tiny={vocab_size: 151936}",
        "rollout.prompts=code_tasks",
        "rollout.reward=code",
        "rollout.code_workers=2",
        "rollout.prompts_per_step=2",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=16",
        "rollout.max_prompt_len=512",
        "rollout.eval_prompts=2",
        "rollout.humaneval_problems=2",
        "quant.quality_prompts=2",
        "quant.accept_quality_loss=true",  # a random model's NLL on code says nothing about the policy
        "quant.quality_after=false",
        "trainer.warm_start_steps=0",
        f"trainer.steps={STEPS}",
        "trainer.save_every=0",
        "logging.progress=false",
    ]


@pytest.fixture(scope="module")
def code_run(real_qwen, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("code_run")
    cmd = [sys.executable, "-m", "megatron_trace.train", "--config", "configs/tiny_cpu.yaml"]
    cmd += [*_overrides(real_qwen), f"logging.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return run_dir, proc.stdout


def test_every_answer_is_run_and_each_zero_counted_by_why(code_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = code_run
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    for step in range(STEPS):
        counts = {r: acc.Scalars(f"reward/code_{r}")[step].value for r in REASONS}
        reward = acc.Scalars("rollout/reward_mean")[step].value
        # every answer either passed or scored 0 for one counted reason
        assert sum(counts.values()) + round(reward * SAMPLES) == SAMPLES, counts
        assert counts["bad_answer"] == counts["sandbox_error"] == 0, counts  # no host faults
        assert acc.Scalars("rollout/reward_errors")[step].value == 0
        # random text has no fenced block, so it runs whole: the sandbox really ran the programs
        ran = SAMPLES - counts["no_code"]
        assert ran > 0 and counts["failed"] + counts["crash"] + counts["no_sentinel"] > 0, counts
    assert "WARNING model-written code ran with" not in out  # bwrap: no weaker mode to name


def test_humaneval_is_scored_before_and_after_and_the_gate_measures_it(code_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = code_run
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    he = acc.Scalars("eval/humaneval_pass@1")
    assert [e.step for e in he] == [0, STEPS] and all(e.value == 0 for e in he)  # random weights pass nothing
    assert [e.value for e in acc.Scalars("eval/humaneval_problems")] == [2, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["humaneval_pass1_before"] == summary["humaneval_pass1_after"] == 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    shown = [s for s in samples if s["kind"] == "eval/humaneval_answers_before"]
    assert "def has_close_elements(" in shown[0]["prompt"]  # HumanEval/0, from the installed package
    gate = [s for s in samples if s["kind"] == "quality/answers_vs_bf16"]
    assert [json.loads(g["answer"])["entry_point"] for g in gate[:2]] == ["has_close_elements", "separate_paren_groups"]
    assert "rollout quality gate (2 eval prompts, bfloat16, up to 16 new tokens)" in out
    # the mismatch along the answer, every step
    assert len(acc.Scalars("mismatch/dlogp_by_pos/0_8")) == STEPS


def test_gate_only_measures_what_the_run_measures_and_trains_nothing(code_run, real_qwen, tmp_path):
    """`--gate-only`: the run's gate alone (same checkpoint, policy, prompts, answer length, reward),
    its numbers the ones the full run logged as quality/*; no trainer, no checkpoints."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_trace import train

    rc = train.main(
        [
            "--config",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            *_overrides(real_qwen),
            f"logging.run_dir={tmp_path}",
            "--gate-only",
        ]
    )
    got = json.loads((tmp_path / "gate.json").read_text())
    assert rc == 0 and got["passed"] and got["prompts"] == 2 and got["max_new_tokens"] == 16
    assert len(got["rewards"]) == len(got["bf16_rewards"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.json"]
    acc = EventAccumulator(str(code_run[0]))
    acc.Reload()
    assert got["nll_increase"] == pytest.approx(acc.Scalars("quality/nll_increase")[0].value, rel=1e-6)
    assert got["accuracy"] == acc.Scalars("quality/accuracy")[0].value
    assert got["bf16_accuracy"] == acc.Scalars("quality/bf16_accuracy")[0].value
