"""experiments/compare_methods.py's table: per-method figures over seeds, the spread only where there is one."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "compare_methods", Path(__file__).resolve().parents[1] / "experiments" / "compare_methods.py"
)
cm = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(cm)


def _run(dlogps: list[float], before: float, after: float):
    rows = [
        {
            "step": i,
            "rollout/reward_mean": 0.25 * (i % 2),
            "mismatch/mean_abs_dlogp": d,
            "mismatch/max_abs_dlogp": 10 * d,
            "mismatch/k3_kl": d * d,
            "train/entropy": 0.3,
            "rollout/response_len_mean": 200.0 + i,
            "perf/step_s": 60.0,
            "perf/rollout_s": 15.0,
            "perf/train_s": 40.0,
            "perf/transfer_s": 5.0,
        }
        for i, d in enumerate(dlogps)
    ]
    summary = {
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_accuracy_before": before,
        "eval_accuracy_after": after,
        "guidance_bytes_per_token": 0,
    }
    return rows, summary


def test_one_seed_shows_values_two_seeds_show_mean_and_half_range():
    one = cm.summarize([_run([0.004, 0.006], 0.25, 0.5)])
    two = cm.summarize([_run([0.004, 0.006], 0.25, 0.5), _run([0.002, 0.004], 0.75, 0.5)])
    text = cm.table({"bf16": one, "trace_mantissa": two})
    lines = text.splitlines()
    bf16 = next(line for line in lines if line.startswith("| bf16 |"))
    trace = next(line for line in lines if line.startswith("| trace_mantissa |"))
    assert "±" not in bf16 and "| 0.250 → 0.500 |" in bf16 and "| 0.0050 / 0.0050 |" in bf16
    assert "| 0.500 ± 0.250 → 0.500 ± 0.000 |" in trace and "| 0.0040 ± 0.0010 / 0.0040 ± 0.0010 |" in trace
    steps = [line for line in lines if line.startswith("| bf16 | 2 |")]
    assert steps and "| 15 / 40 / 5 |" in steps[0] and "| 60 |" in steps[0]


def test_code_runs_show_humaneval_before_and_after():
    rows, s = _run([0.004], 0.25, 0.5)
    code = cm.summarize([(rows, {**s, "humaneval_pass1_before": 0.5, "humaneval_pass1_after": 0.625})])
    lines = cm.table({"trace_mantissa": code}).splitlines()
    assert "| HumanEval pass@1 before → after |" in lines[0] and lines[1].count("|") == lines[0].count("|")
    assert "| 0.500 → 0.625 |" in lines[2]
    assert "HumanEval" not in cm.table({"bf16": cm.summarize([_run([0.004], 0.25, 0.5)])})  # math runs: none
