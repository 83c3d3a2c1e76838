"""One run's curves from its metrics.jsonl, for a document (TensorBoard reads the same run live).

    .venv/bin/python experiments/plot_run.py RUN_DIR --out curves.png

Four panels by RL step: sampled reward, mean |dlogp| (train/rollout mismatch), resident memory
after the step beside the step's phase peaks, and the step's seconds split into rollout, train and
weight sync.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def step_rows(run_dir: Path) -> list[dict]:
    """The last metrics row of each RL step (a resumed run rewrites a step's row)."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "perf/step_s" in r:
            rows[r["step"]] = r
    return [rows[s] for s in sorted(rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    rows = step_rows(args.run_dir)
    if not rows:
        raise SystemExit(f"{args.run_dir}/metrics.jsonl holds no finished step")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def col(key):
        return [r.get(key, float("nan")) for r in rows]

    fig, ax = plt.subplots(1, 4, figsize=(20, 4))
    ax[0].plot(steps, col("rollout/reward_mean"))
    ax[0].set(title="sampled reward", xlabel="RL step")
    ax[1].plot(steps, col("mismatch/mean_abs_dlogp"))
    ax[1].set(title="mean |dlogp| (trainer vs rollout)", xlabel="RL step", yscale="log")
    for key, label in (
        ("perf/rss_gib", "resident after the step"),
        ("perf/mem_rollout_peak_gib", "rollout peak"),
        ("perf/mem_forward_backward_peak_gib", "forward/backward peak"),
        ("perf/mem_optimizer_peak_gib", "optimizer step peak"),
        ("perf/mem_sync_peak_gib", "weight sync peak"),
    ):
        if any(key in r for r in rows):
            ax[2].plot(steps, col(key), label=label)
    ax[2].set(title="memory (GiB)", xlabel="RL step")
    ax[2].legend(fontsize=8)
    parts = [("perf/rollout_s", "rollout"), ("perf/train_s", "train"), ("perf/transfer_s", "weight sync")]
    bottom = [0.0] * len(rows)
    for key, label in parts:
        v = col(key)
        ax[3].bar(steps, v, bottom=bottom, label=label)
        bottom = [b + x for b, x in zip(bottom, v)]
    ax[3].set(title="step seconds", xlabel="RL step")
    ax[3].legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"{len(rows)} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
