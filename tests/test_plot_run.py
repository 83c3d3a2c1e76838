"""experiments/plot_run.py draws a run's steps (the last row of a resumed step wins) and refuses a run
with none."""

import json

import pytest

from experiments.plot_run import main, step_rows


def test_a_runs_curves_are_drawn_from_its_last_row_per_step(tmp_path):
    rows = [
        {"step": 0, "eval/accuracy": 0.5},
        {"step": 0, "perf/step_s": 9.0, "perf/rollout_s": 1.0, "perf/train_s": 7.0, "perf/transfer_s": 1.0},
        {"step": 1, "perf/step_s": 8.0, "perf/rollout_s": 1.0, "perf/train_s": 6.0, "perf/transfer_s": 1.0},
        {"step": 1, "perf/step_s": 7.0, "perf/rollout_s": 1.0, "perf/train_s": 5.0, "perf/transfer_s": 1.0},
    ]
    for r in rows:
        r.update({"rollout/reward_mean": 0.5, "mismatch/mean_abs_dlogp": 0.01, "perf/rss_gib": 1.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows[1:]))
    assert [r["perf/step_s"] for r in step_rows(tmp_path)] == [9.0, 7.0]
    assert main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]))
    with pytest.raises(SystemExit, match="no finished step"):
        main([str(tmp_path), "--out", str(tmp_path / "d.png")])
