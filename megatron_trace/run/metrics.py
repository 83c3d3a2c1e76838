"""Metrics behind one interface: TensorBoard event files, a JSONL log, and a progress line; and a
step's scalars, from its StepResult (run/step.py), as the loggers get them.

Namespaces (DESIGN.md): rollout/, train/, mismatch/, perf/, eval/, and quality/ (the rollout-quality
gate at step 0, quality/gate.py). `mismatch/` always carries
mean and max |logp_rollout - logp_train|, the K3 KL estimate, importance-ratio mean/max and
clipped fraction, per-layer codeword disagreement and guidance bytes per token; MoE runs add
`mismatch/routing_agreement` (share of the rollout's (token, layer, k) expert choices the trainer's
own router makes too) and `mismatch/routing_replayed` (share its forward used: 1 under routing
replay), from trainer/routing_replay.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_trace.kernels.cpu_alloc import process_peak_rss, resident_gib

if TYPE_CHECKING:
    from .step import StepResult

NAMESPACES = ("rollout", "reward", "train", "mismatch", "perf", "eval", "quality")  # quality: the gate, at step 0
REQUIRED_MISMATCH = (
    "mean_abs_dlogp",
    "max_abs_dlogp",
    "k3_kl",
    "ratio_mean",
    "ratio_max",
    "clipped_frac",
    "guidance_bytes_per_token",
)


class Logger(Protocol):
    def scalars(self, step: int, metrics: dict[str, float]) -> None: ...

    def histogram(self, step: int, name: str, values: torch.Tensor) -> None: ...

    def text(self, step: int, name: str, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    def __init__(self, run_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir))

    def scalars(self, step, metrics) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def histogram(self, step, name, values) -> None:
        if values.numel():
            self.writer.add_histogram(name, values.float(), step)

    def text(self, step, name, rows) -> None:
        """One markdown block per row (TensorBoard's TEXT tab): the prompt, the answer, the reward."""

        def quote(s: str) -> str:
            return "\n".join("    " + line for line in str(s).splitlines()) or "    (empty)"

        def reward(x) -> str:
            return "—" if x is None else f"{x:g}"

        blocks = [
            f"**{i}.** reward {reward(r['reward'])} (reference: {r['answer']})\n\nprompt:\n\n{quote(r['prompt'])}"
            f"\n\nresponse:\n\n{quote(r['response'])}"
            + (
                f"\n\nBF16 response (reward {reward(r['bf16_reward'])}):\n\n{quote(r['bf16_response'])}"
                if "bf16_response" in r
                else ""
            )
            for i, r in enumerate(rows)
        ]
        self.writer.add_text(name, "\n\n---\n\n".join(blocks), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def resumed_part(run_dir: str | Path, start_step: int) -> tuple[list[dict], dict | None]:
    """What a run resumed at `start_step` did before: its step rows (the newest row of each step below
    start_step: a run killed after its last checkpoint logged steps it now repeats) and its "before"
    eval (the eval row at step 0), from metrics.jsonl. A line cut short by a kill is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    steps, before = {}, None
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "rollout/reward_mean" in row and row["step"] < start_step:
            steps[row["step"]] = row
        elif before is None and row.get("step") == 0 and any(k.startswith("eval/") for k in row):
            before = {k: v for k, v in row.items() if k != "step"}
    return [steps[k] for k in sorted(steps)], before


class JsonlLogger:
    """metrics.jsonl in the run dir: one line per step, what scripts and tests read back."""

    def __init__(self, run_dir: str | Path, append: bool = False):
        self.run_dir, self.append = Path(run_dir), append
        self.f = open(self.run_dir / "metrics.jsonl", "a" if append else "w")
        self.samples = None  # samples.jsonl, opened at the first text

    def scalars(self, step, metrics) -> None:
        self.f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.f.flush()

    def histogram(self, step, name, values) -> None:
        pass

    def text(self, step, name, rows) -> None:
        """samples.jsonl beside metrics.jsonl: one line per readable sample."""
        if self.samples is None:
            self.samples = open(self.run_dir / "samples.jsonl", "a" if self.append else "w")
        for r in rows:
            self.samples.write(json.dumps({"step": step, "kind": name, **r}) + "\n")
        self.samples.flush()

    def close(self) -> None:
        self.f.close()
        if self.samples is not None:
            self.samples.close()


class MetricsHub:
    """Fans metrics out to every logger; checks namespaces so typos don't become new charts."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = loggers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        bad = [k for k in metrics if k.split("/", 1)[0] not in NAMESPACES]
        if bad:
            raise ValueError(f"metric names must start with one of {NAMESPACES}: {bad}")
        clean = {
            k: float(v) for k, v in metrics.items() if v is not None and not (isinstance(v, float) and math.isnan(v))
        }
        for lg in self.loggers:
            lg.scalars(step, clean)

    def histogram(self, step: int, name: str, values: torch.Tensor) -> None:
        for lg in self.loggers:
            lg.histogram(step, name, values)

    def text(self, step: int, name: str, rows: list[dict]) -> None:
        """Readable samples (prompt, response, answer, reward) under a namespaced name."""
        if name.split("/", 1)[0] not in NAMESPACES:
            raise ValueError(f"text names must start with one of {NAMESPACES}: {name}")
        if rows:
            for lg in self.loggers:
                lg.text(step, name, rows)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def mismatch_scalars(
    m: dict, agreement: dict[str, float], bytes_per_token: float, override: dict[str, float] | None = None
) -> dict[str, float]:
    """Probe/loop mismatch dict -> mismatch/* scalars, with per-layer codeword disagreement (where
    full codes were recorded) and, under guided QAT, the share of codes guidance overrode
    against round-to-nearest (all mantissa guidance can measure: it has no codes to agree with)."""
    out = {
        f"mismatch/{k}": m[k]
        for k in ("mean_abs_dlogp", "max_abs_dlogp", "k3_kl", "ratio_mean", "ratio_max", "clipped_frac")
    }
    out["mismatch/guidance_bytes_per_token"] = bytes_per_token
    per_layer: dict[int, list[float]] = {}
    for site, a in agreement.items():
        per_layer.setdefault(int(site.split(".")[2]), []).append(a)
    for layer, vals in sorted(per_layer.items()):
        out[f"mismatch/codeword_disagreement/layer_{layer}"] = 1 - sum(vals) / len(vals)
    if per_layer:
        out["mismatch/codeword_disagreement/mean"] = 1 - sum(sum(v) for v in per_layer.values()) / sum(
            len(v) for v in per_layer.values()
        )
    per_layer = {}
    for site, a in (override or {}).items():
        per_layer.setdefault(int(site.split(".")[2]), []).append(a)
    for layer, vals in sorted(per_layer.items()):
        out[f"mismatch/guidance_override/layer_{layer}"] = sum(vals) / len(vals)
    for k, v in m.items():  # the gap along the answer, one TensorBoard group: FP4 KV error grows with length
        if k.startswith("dlogp_pos_"):
            out[f"mismatch/dlogp_by_pos/{k.removeprefix('dlogp_pos_')}"] = v
    return out


def step_scalars(r: StepResult, store_stats: dict) -> dict[str, float]:
    """A step's scalars: rollout/, train/, mismatch/ (always the REQUIRED_MISMATCH set when it
    trained) and perf/ (its time split, transfer, guidance store, this process's memory)."""
    samples = r.batch.samples
    n = max(len(samples), 1)
    tokens = sum(len(s.response_ids) for s in samples)
    rollout_s = r.times["rollout_s"]
    m = {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": tokens / n,
        "rollout/weight_version": r.batch.version,
        "rollout/samples": len(samples),
        **{f"rollout/{k}": v for k, v in r.batch.stats.items() if k != "rollout_s"},
        "rollout/dropped_stale": r.trained.dropped_stale,
        # rollout.reward=code: answers that scored 0, by why (timeout, crash, no_code, ...)
        **{f"reward/code_{k}": v for k, v in r.batch.reward_reasons.items()},
    }
    step = r.trained.step
    if step is None:
        m["train/skipped"] = 1
    else:
        m.update({f"train/{k}": float(v) for k, v in step.metrics.items()})
        # the train step's parts (perf/train_s is their sum plus batching): the QAT forward that
        # recomputes the logprobs, the backward, the optimizer step
        m.update({f"perf/{k}_s": v for k, v in step.times.items()})
        m.update({f"mismatch/{k}": v for k, v in step.routing.items()})
        m.update(
            mismatch_scalars(
                r.trained.mismatch, step.codeword_agreement, r.trained.guidance_bytes_per_token, step.guidance_override
            )
        )
    m.update(r.metrics)
    m.update(
        {
            "perf/rollout_s": rollout_s,
            "perf/train_s": r.times["train_s"],
            "perf/transfer_s": r.times["transfer_s"],
            "perf/step_s": r.times["step_s"],
            "perf/transfer_wire_bytes": r.wire_bytes,
            "perf/rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
            "perf/guidance_spilled_bytes": store_stats.get("bytes_spilled_total", 0),
            "perf/guidance_bytes_per_token": store_stats.get("bytes_per_token", 0.0),
            # this process (rank 0: engine and trainer): resident now and its peak so far
            "perf/rss_gib": resident_gib(),
            "perf/peak_rss_gib": process_peak_rss(),
        }
    )
    return m


TRAIN_PARTS = ("recompute", "backward", "optimizer")


def run_summary(history: list[dict], evals: dict, totals: dict, wall_s: float) -> dict:
    """summary.json of a run: its steps' metrics (`history`), the evals before/after and the phase
    time totals (rollout_s, train_s, transfer_s)."""
    total = sum(totals.values()) or 1.0

    def mean(k):
        return sum(h.get(k, 0.0) for h in history) / max(len(history), 1)

    def ev(when, k):
        return evals.get(when, {}).get(k)

    return {
        "steps": len(history),
        "eval_accuracy_before": ev("before", "eval/accuracy"),
        "eval_accuracy_after": ev("after", "eval/accuracy"),
        "eval_reward_before": ev("before", "eval/reward_sampled"),
        "eval_reward_after": ev("after", "eval/reward_sampled"),
        "eval_set_size": ev("before", "eval/set_size") or ev("after", "eval/set_size"),
        "humaneval_pass1_before": ev("before", "eval/humaneval_pass@1"),
        "humaneval_pass1_after": ev("after", "eval/humaneval_pass@1"),
        "reward_first_step": history[0]["rollout/reward_mean"] if history else None,
        "reward_last_step": history[-1]["rollout/reward_mean"] if history else None,
        "mean_abs_dlogp": mean("mismatch/mean_abs_dlogp"),
        "max_abs_dlogp": max((h.get("mismatch/max_abs_dlogp", 0) for h in history), default=0),
        "k3_kl": mean("mismatch/k3_kl"),
        "clipped_frac": mean("mismatch/clipped_frac"),
        "guidance_bytes_per_token": mean("mismatch/guidance_bytes_per_token"),
        "time_split": {k: v / total for k, v in totals.items()},
        # the train step's parts: the QAT forward recomputing logprobs, backward, optimizer
        "train_split": {k: sum(h.get(f"perf/{k}_s", 0.0) for h in history) for k in TRAIN_PARTS},
        "wall_s": wall_s,
        "peak_rss_gb": process_peak_rss(),  # this process (rank 0)
    }
