"""What the train CLI prints: the run's plan (without third-party noise), its progress and its summary.

    quiet_third_party()  ─► known import-time warnings of Megatron/TE/Apex/HF filtered by message
    plan_lines(cfg, sleeps) ─► model, quantization, guidance, rollout, steps, the CPU's routes (kernel
                               ISA, bf16 GEMMs, oneDNN packing), where TensorBoard writes
    progress_bar(n, on)  ─► the RL steps' bar;  print_summary(summary) ─► the run's end, after it
Only warnings known to be harmless on the machines we run are filtered, each by its exact text,
so a new warning from the same libraries still shows.
"""

from __future__ import annotations

import warnings

from megatron_trace.kernels import cpu_routes

# What Megatron-Core 0.16 says at import on a box without Transformer Engine or Apex; every
# fallback named here is the one the trainer relies on (trainer/cpu_compat.py).
_KNOWN_USER_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated",
)


def quiet_third_party() -> None:
    for message in _KNOWN_USER_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.")


def plan_lines(cfg, engine_sleeps: bool = False) -> list[str]:
    """The run in a few lines, from the config alone (nothing loaded yet); engine_sleeps: the run's
    resolved rollout.colocated."""
    q, g, r, t = cfg.quant, cfg.guidance, cfg.rollout, cfg.trainer
    if cfg.model.path:
        model = cfg.model.path
    else:
        size = {"hidden_size": 64, "num_hidden_layers": 4, **cfg.model.tiny}
        model = (
            f"tiny {cfg.model.family} (hidden {size['hidden_size']}, {size['num_hidden_layers']} layers), "
            f"warm start {t.warm_start_steps} supervised steps (cached)"
        )
    if q.format == "bf16":
        weights = "BF16 linears"
    else:
        acts = "W4A4" if q.activations == "fp4" else "W4A16"
        weights = f"{q.format.upper()} {acts} on {', '.join(q.targets)}"
    k, v = q.kv_k or q.kv, q.kv_v or q.kv
    kv = f"K {k}{' de-biased' if q.kv_k_debias else ''}, V {v}" + (
        " (auto: per model family)" if "auto" in (k, v) else ""
    )
    guided = {
        "guided": f"TRACE guided QAT ({g.mode} guidance, layers {g.layers})",
        "rtn": "plain QAT (round to nearest)",
        "off": "BF16 trainer (no QAT)",
    }[t.qat_mode]
    backend = "embedded engine, in-process" if r.backend == "local" else f"HTTP: {', '.join(r.urls) or '(no urls)'}"
    if engine_sleeps:
        backend += ", releasing its KV pool and weights while the trainer trains"
    where = cfg.logging.run_dir
    # MoE: expert parallelism and routing replay (auto: on for MoE)
    tiny_moe = not cfg.model.path and cfg.model.family == "qwen3_moe"
    replay = {"auto": "on" if tiny_moe else "auto (on for MoE)", "on": "on", "off": "off"}[t.routing_replay]
    moe = f" EP{t.ep}, routing replay {replay}" if tiny_moe or t.ep > 1 or t.routing_replay != "auto" else ""
    return [
        "== megatron-trace ==",
        f"model:      {model}",
        f"rollout:    {backend}, {r.dtype}; {weights}; KV {kv}",
        f"trainer:    Megatron-Core TP{t.tp} PP{t.pp}{moe}, {t.dtype}, {guided}, loss {cfg.algo.loss}",
        f"steps:      {t.steps} x {r.prompts_per_step} prompts x {r.n_samples} samples ({r.prompts}, "
        f"T={r.temperature}, top_p={r.top_p}, up to {r.max_new_tokens} tokens); eval on up to {r.eval_prompts} "
        f"prompts of the eval split ({r.eval_fraction:.0%} of the problems, never trained on)",
        f"cpu:        {cpu_routes.routes().describe()}",
        f"logs:       {where} (tensorboard --logdir {where}; metrics.jsonl, summary.json, checkpoints/)",
    ]


def policy_line(policy, arch) -> str:
    """The resolved quantization policy in one line: what "auto" became for this checkpoint."""
    weights = (
        "BF16 linears"
        if not policy.enabled
        else f"{policy.format.upper()} W4A{4 if policy.activations == 'fp4' else 16}"
    )
    debias = " de-biased" if policy.kv_k_debias and policy.k_format != "bf16" else ""
    return f"policy:     {weights}; K {policy.k_format}{debias}, V {policy.v_format} (resolved for {arch.family})"


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="RL steps", dynamic_ncols=True)


def print_summary(s: dict) -> None:
    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}"

    print("\n== summary ==")
    size = s.get("eval_set_size")
    print(f"eval set: {size or 0} problems of the eval split (never trained on)")
    print(
        f"eval reward (sampled, T=rollout): before {fmt(s['eval_reward_before'])} -> "
        f"after {fmt(s['eval_reward_after'])}"
    )
    print(f"eval accuracy (greedy): before {fmt(s['eval_accuracy_before'])} -> after {fmt(s['eval_accuracy_after'])}")
    print(f"reward (sampled): first step {fmt(s['reward_first_step'])} -> last step {fmt(s['reward_last_step'])}")
    print(
        f"mismatch: mean |dlogp| {s['mean_abs_dlogp']:.4f}, max {s['max_abs_dlogp']:.4f}, K3 KL {s['k3_kl']:.2e}, "
        f"clipped {s['clipped_frac']:.2%}, guidance {s['guidance_bytes_per_token']:.0f} B/token"
    )
    split = ", ".join(f"{k.removesuffix('_s')} {v:.0%}" for k, v in s["time_split"].items())
    parts = s["train_split"]
    inner = ", ".join(f"{k} {v / (sum(parts.values()) or 1.0):.0%}" for k, v in parts.items())
    print(f"time split: {split} ({inner} of train); wall {s['wall_s']:.0f} s")
    print(f"peak memory: {s['peak_rss_gb']:.1f} GiB RSS (rank 0: rollout engine and trainer)")
