"""Same seeds and prompts, several ways to train with FP4 rollout; a table and curves of the result.

    .venv/bin/python experiments/compare_methods.py --out results/compare --steps 200 --seeds 0,1
        [--config configs/tiny_cpu.yaml] [--resume] [base overrides ...]

Methods (each a run of `python -m megatron_trace.train --config CONFIG` per seed):
  bf16            BF16 rollout and BF16 trainer (the reference)
  naive_fp4       FP4 rollout, BF16 trainer, no correction
  fp4_qat         FP4 rollout, plain QAT (round to nearest) in the trainer
  fp4_tis         FP4 rollout, BF16 trainer, truncated importance sampling
  trace_full      FP4 rollout, TRACE guided QAT with full codes
  trace_mantissa  FP4 rollout, TRACE guided QAT with 1 mantissa bit per element
Every figure is the mean over seeds with the spread (min..max) as a band (one seed: the value alone).
Writes <out>/table.md (eval before/after, rewards, |dlogp|; then K3 KL, entropy, response length, step
time and its split),
<out>/curves.png (sampled reward, mean and max |dlogp|, entropy and response length over steps),
<out>/summary.json and the raw runs under <out>/runs/<method>/seed<k>/. --resume keeps runs that
reached --steps and continues the others from their last checkpoint, so a long comparison can grow
over several sessions.
Every run passes quant.accept_quality_loss=true: the methods are compared on the policy given, and each
run's quality gate still measures it against BF16 (quality/* in its metrics, a WARNING when it fails).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "bf16": [
        "quant.format=bf16",
        "quant.weights=bf16",
        "quant.activations=bf16",
        "quant.kv=bf16",
        "quant.kv_k=bf16",  # a config that names each side (the real-model one) would keep its KV formats
        "quant.kv_v=bf16",
        "quant.kv_k_debias=false",
        "trainer.qat_mode=off",
    ],
    "naive_fp4": ["trainer.qat_mode=off", "algo.loss=none"],
    "fp4_qat": ["trainer.qat_mode=rtn"],
    "fp4_tis": ["trainer.qat_mode=off", "algo.loss=tis"],
    "trace_full": ["trainer.qat_mode=guided", "guidance.mode=full"],
    "trace_mantissa": ["trainer.qat_mode=guided", "guidance.mode=mantissa"],
}
CURVES = (
    ("rollout/reward_mean", "sampled reward (5-step mean)", False),
    ("mismatch/mean_abs_dlogp", "mean |logp_rollout - logp_train|", True),
    ("mismatch/max_abs_dlogp", "max |logp_rollout - logp_train|", True),
    ("train/entropy", "policy entropy (nats/token)", False),
    ("rollout/response_len_mean", "response length (tokens)", False),
)
STEP_PARTS = ("rollout_s", "train_s", "transfer_s")


def run_method(name: str, seed: int, out: Path, steps: int, base: list[str], config: str, resume: bool = False) -> Path:
    run_dir = out / "runs" / name / f"seed{seed}"
    summary = run_dir / "summary.json"
    if resume and summary.exists() and json.loads(summary.read_text())["steps"] >= steps:
        print(f"[{name} seed {seed}] reusing {run_dir}", flush=True)
        return run_dir
    cmd = [
        sys.executable,
        "-m",
        "megatron_trace.train",
        "--config",
        config,
        f"trainer.steps={steps}",
        f"trainer.seed={seed}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "quant.accept_quality_loss=true",
        *base,
        *METHODS[name],
    ]
    if resume and (run_dir / "checkpoints" / "latest").exists():
        cmd.append("--resume")
    print(f"[{name} seed {seed}] {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"[{name} seed {seed}] failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return run_dir


def load(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    return [steps[k] for k in sorted(steps)], json.loads((run_dir / "summary.json").read_text())


def _spread(values: list[float], fmt: str) -> str:
    """mean ± half the min..max range over seeds; one seed has no spread to show."""
    if len(values) == 1:
        return format(values[0], fmt)
    half = (max(values) - min(values)) / 2
    return f"{format(statistics.fmean(values), fmt)} ± {format(half, fmt)}"


def summarize(runs: list[tuple[list[dict], dict]]) -> dict:
    def per_seed(f):
        return [f(rows, s) for rows, s in runs]

    return {
        "seeds": len(runs),
        "eval_reward_before": per_seed(lambda r, s: s["eval_reward_before"]),
        "eval_reward_after": per_seed(lambda r, s: s["eval_reward_after"]),
        "eval_accuracy_before": per_seed(lambda r, s: s["eval_accuracy_before"]),
        "eval_accuracy_after": per_seed(lambda r, s: s["eval_accuracy_after"]),
        "train_reward_last10": per_seed(lambda r, s: statistics.fmean(x["rollout/reward_mean"] for x in r[-10:])),
        "mean_abs_dlogp": per_seed(lambda r, s: statistics.fmean(x.get("mismatch/mean_abs_dlogp", 0.0) for x in r)),
        "mean_abs_dlogp_last10": per_seed(
            lambda r, s: statistics.fmean(x.get("mismatch/mean_abs_dlogp", 0.0) for x in r[-10:])
        ),
        "max_abs_dlogp": per_seed(lambda r, s: max(x.get("mismatch/max_abs_dlogp", 0.0) for x in r)),
        "guidance_bytes_per_token": per_seed(lambda r, s: s["guidance_bytes_per_token"]),
        "eval_set_size": runs[0][1].get("eval_set_size"),
        "k3_kl": per_seed(lambda r, s: _mean(r, "mismatch/k3_kl")),
        "entropy": per_seed(lambda r, s: _mean(r, "train/entropy")),
        "response_len": per_seed(lambda r, s: _mean(r, "rollout/response_len_mean")),
        "step_s": per_seed(lambda r, s: _mean(r, "perf/step_s")),
        **{k: per_seed(lambda r, s, k=k: _mean(r, f"perf/{k}")) for k in STEP_PARTS},
        "steps": per_seed(lambda r, s: len(r)),
        # code runs (rollout.reward=code): HumanEval pass@1, greedy, before and after
        "humaneval_before": per_seed(lambda r, s: s.get("humaneval_pass1_before")),
        "humaneval_after": per_seed(lambda r, s: s.get("humaneval_pass1_after")),
    }


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(x.get(key, 0.0) for x in rows) if rows else 0.0


def table(summary: dict[str, dict]) -> str:
    head = (
        "| method | eval reward before → after | greedy eval acc before → after | train reward (last 10) "
        "| mean abs dlogp (all / last 10 steps) | max abs dlogp | guidance B/token |"
    )
    code = all(None not in s.get("humaneval_before", [None]) for s in summary.values())
    if code:
        head = head.replace("| train reward", "| HumanEval pass@1 before → after | train reward")
    lines = [head, "|---|---|---|" + ("---|" if code else "") + "---:|---:|---:|---:|"]
    for name, s in summary.items():
        he = f"| {_spread(s['humaneval_before'], '.3f')} → {_spread(s['humaneval_after'], '.3f')} " if code else ""
        lines.append(
            f"| {name} | {_spread(s['eval_reward_before'], '.3f')} → {_spread(s['eval_reward_after'], '.3f')} "
            f"| {_spread(s['eval_accuracy_before'], '.3f')} → {_spread(s['eval_accuracy_after'], '.3f')} "
            f"{he}| {_spread(s['train_reward_last10'], '.3f')} | {_spread(s['mean_abs_dlogp'], '.4f')} / "
            f"{_spread(s['mean_abs_dlogp_last10'], '.4f')} | {_spread(s['max_abs_dlogp'], '.3f')} "
            f"| {statistics.fmean(s['guidance_bytes_per_token']):.0f} |"
        )
    lines += [
        "",
        "| method | steps | K3 KL | entropy | response tokens | step s | rollout / train / transfer s |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in summary.items():
        split = " / ".join(f"{statistics.fmean(s[k]):.0f}" for k in STEP_PARTS)
        lines.append(
            f"| {name} | {min(s['steps'])} | {_spread(s['k3_kl'], '.2e')} | {_spread(s['entropy'], '.3f')} "
            f"| {_spread(s['response_len'], '.0f')} | {_spread(s['step_s'], '.0f')} | {split} |"
        )
    return "\n".join(lines)


def plots(results: dict[str, list[tuple[list[dict], dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 4))
    for name, runs in results.items():
        n = min(len(rows) for rows, _ in runs)
        steps = [runs[0][0][i]["step"] for i in range(n)]
        for ax, (key, title, log) in zip(axes, CURVES):
            per = [_smooth([rows[i].get(key, 0.0) for i in range(n)]) for rows, _ in runs]
            mean = [statistics.fmean(v) for v in zip(*per)]
            (line,) = ax.plot(steps, mean, label=name)
            ax.fill_between(
                steps, [min(v) for v in zip(*per)], [max(v) for v in zip(*per)], color=line.get_color(), alpha=0.2
            )
            ax.set(title=title, xlabel="RL step", yscale="log" if log else "linear")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"mean over {len(next(iter(results.values())))} seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def _smooth(v, k=5):
    return [sum(v[max(0, i - k + 1) : i + 1]) / len(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1", help="comma-separated trainer seeds (>= 2 to see a spread)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--config", default=str(ROOT / "configs/tiny_cpu.yaml"), help="the runs' config file")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep runs at --steps, continue the rest from checkpoints (same settings!)",
    )
    ap.add_argument("base", nargs="*", help="extra section.key=value overrides for every run")
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; allowed: {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        m: [load(run_method(m, seed, out, args.steps, args.base, args.config, args.resume)) for seed in seeds]
        for m in args.methods.split(",")
    }
    summary = {m: summarize(runs) for m, runs in results.items()}
    md = table(summary)
    (out / "table.md").write_text(md + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {"config": args.config, "steps": args.steps, "seeds": seeds, "base": args.base, "methods": summary},
            indent=1,
        )
    )
    plots(results, out)
    print(md)


if __name__ == "__main__":
    main()
