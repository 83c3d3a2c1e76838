"""Same seeds and prompts, six ways to train with FP4 rollout; a table and curves of the result.

    .venv/bin/python scripts/compare_methods.py --out results/compare [--steps 40] [base overrides ...]

Methods (each a run of `python -m megatron_trace.train --config configs/tiny_cpu.yaml`):
  bf16            BF16 rollout and BF16 trainer (the reference)
  naive_fp4       FP4 rollout, BF16 trainer, no correction
  fp4_qat         FP4 rollout, plain QAT (round to nearest) in the trainer
  fp4_tis         FP4 rollout, BF16 trainer, truncated importance sampling
  trace_full      FP4 rollout, TRACE guided QAT with full codes
  trace_mantissa  FP4 rollout, TRACE guided QAT with 1 mantissa bit per element
Writes <out>/table.md, <out>/curves.png (reward and mean |dlogp| over steps) and
<out>/dlogp_by_position.png, and the raw runs under <out>/runs/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "bf16": ["quant.format=bf16", "quant.weights=bf16", "quant.activations=bf16", "quant.kv=bf16", "trainer.qat_mode=off"],
    "naive_fp4": ["trainer.qat_mode=off", "algo.loss=none"],
    "fp4_qat": ["trainer.qat_mode=rtn"],
    "fp4_tis": ["trainer.qat_mode=off", "algo.loss=tis"],
    "trace_full": ["trainer.qat_mode=guided", "guidance.mode=full"],
    "trace_mantissa": ["trainer.qat_mode=guided", "guidance.mode=mantissa"],
}


def run_method(name: str, out: Path, steps: int, base: list[str], reuse: bool = False) -> Path:
    run_dir = out / "runs" / name
    if reuse and (run_dir / "summary.json").exists():
        print(f"[{name}] reusing {run_dir}", flush=True)
        return run_dir
    cmd = [sys.executable, "-m", "megatron_trace.train", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
           f"trainer.steps={steps}", f"logging.run_dir={run_dir}", "logging.progress=false", *base, *METHODS[name]]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"[{name}] failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return run_dir


def load(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "rollout/reward_mean" in r}
    return [steps[k] for k in sorted(steps)], json.loads((run_dir / "summary.json").read_text())


def table(results: dict[str, tuple[list[dict], dict]]) -> str:
    head = ("| method | held-out reward before → after | greedy acc before → after | train reward (last 5 steps) | mean abs dlogp | max abs dlogp | K3 KL "
            "| clipped frac | guidance B/token | step time (s) |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (rows, s) in results.items():
        tail = rows[-5:]
        mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        lines.append(
            f"| {name} | {s['eval_reward_before']:.3f} → {s['eval_reward_after']:.3f} "
            f"| {s['eval_accuracy_before']:.3f} → {s['eval_accuracy_after']:.3f} "
            f"| {sum(r['rollout/reward_mean'] for r in tail) / len(tail):.3f} | {mean('mismatch/mean_abs_dlogp'):.4f} "
            f"| {max(r.get('mismatch/max_abs_dlogp', 0) for r in rows):.3f} | {mean('mismatch/k3_kl'):.2e} "
            f"| {mean('mismatch/clipped_frac'):.4f} | {mean('mismatch/guidance_bytes_per_token'):.0f} | {mean('perf/step_s'):.2f} |")
    return "\n".join(lines)


def plots(results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, (rows, _) in results.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, _smooth([r["rollout/reward_mean"] for r in rows]), label=name)
        axes[1].plot(steps, [r.get("mismatch/mean_abs_dlogp", 0) for r in rows], label=name)
    axes[0].set(title="reward (sampled, 5-step mean)", xlabel="RL step")
    axes[1].set(title="mean |logp_rollout - logp_train|", xlabel="RL step", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (rows, _) in results.items():
        keys = sorted({k for r in rows for k in r if k.startswith("mismatch/dlogp_pos_")},
                      key=lambda k: int(k.split("_")[-2]))
        if keys:
            ax.plot([int(k.split("_")[-2]) for k in keys],
                    [sum(r.get(k, 0) for r in rows) / len(rows) for k in keys], marker="o", label=name)
    ax.set(title="mean |dlogp| by response position", xlabel="response position (bucket start)", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "dlogp_by_position.png", dpi=110)


def _smooth(v, k=5):
    return [sum(v[max(0, i - k + 1) : i + 1]) / len(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--reuse", action="store_true", help="keep runs that already finished (same settings!)")
    ap.add_argument("base", nargs="*", help="extra section.key=value overrides for every run")
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; allowed: {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {m: load(run_method(m, out, args.steps, args.base, args.reuse)) for m in args.methods.split(",")}
    md = table(results)
    (out / "table.md").write_text(md + "\n")
    plots(results, out)
    print(md)


if __name__ == "__main__":
    main()
