"""The real-model config's train phase, mode by mode on one batch (a benchmark, not a test): the
BF16 trainer (qat off), plain QAT (rtn) and TRACE (guided by the rollout's own records), each one
`Actor.train_step` as the run calls it, interleaved over rounds, beside the step's matmul time at
this machine's measured bf16 GEMM rate.

    .venv/bin/python benchmarks/train_phase.py [--config configs/qwen2.5_0.5b_cpu.yaml] [--layers N]
        [--samples 16] [--max-new-tokens 256] [--modes off,rtn,guided] [--recompute full,none]
        [--rounds 2] [--profile DIR] [--json out.json] [config overrides ...]

    config's rollout (policy, engine dtype, guidance mode and layers) ─► --samples of its prompts,
        answers forced to --max-new-tokens (every mode sees the same tokens: the config's longest step)
    ─► one Actor (the config's trainer: dtype, recompute, micro-batch budget), per round, mode and
        --recompute setting: qat.set_mode(mode), train_step ─► wall s, forward / backward / optimizer s,
        peak RSS growth
    ─► matmul GFLOP of the step (forward, recomputed forward, backward: 3 or 4 forwards of every
        linear and attention score, 4 of the LM head) / the GEMM rate measured here = the matmul floor

--recompute full,none times both on the one built model, interleaved (the layers' checkpointing is
switched between rounds: full and none are the two a built model can swap; selective is chosen when
the layers are built, so it is timed with the config override trainer.recompute=selective).

--layers N keeps the checkpoint's first N layers (its real weights and shapes, less memory and
time; the embedding and the LM head stay whole). --profile DIR writes one torch profiler table per
mode (self CPU time per op, no memory tracking: that OOMs at this size).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODES = ("off", "rtn", "guided")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5_0.5b_cpu.yaml")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the config's rollout.max_new_tokens")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--recompute", default="", help="full,none: both on one model (default: the config's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", default="", help="a directory for one profiler table per mode")
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    return ap.parse_args(argv)


def first_layers(src: Path, n: int, out: Path) -> Path:
    """An HF directory holding src's first n decoder layers (safetensors, config.json, tokenizer)."""

    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    if n >= cfg["num_hidden_layers"]:
        return src
    cfg["num_hidden_layers"] = n
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= n:
                continue
            kept[name] = t
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.suffix in (".json", ".txt", ".model") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def rollout_batch(cfg, tok, prompts, ckpt: Path, policy, samples: int, max_new: int) -> list:
    """The config's rollout on `samples` of its training prompts, each answer max_new tokens, with
    the guidance the run records."""
    from megatron_trace.rl import Sample
    from sglang_backend.local import Engine

    ids = [tok.encode_prompt(p.text) for p in prompts.sample(samples, 0)]
    eng = Engine(
        str(ckpt),
        dtype=cfg.rollout.dtype,
        quant_policy=policy,
        guidance_mode=cfg.guidance.mode,
        guided_layers=cfg.guidance.layers,
        max_running_requests=samples,
        random_seed=0,
    )
    try:
        params = [
            {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": i}
            for i in range(len(ids))
        ]
        outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True, return_guidance=True)
        return [
            Sample(
                f"s{i}",
                p,
                o["output_ids"],
                [t[0] for t in o["meta_info"]["output_token_logprobs"]],
                (-1.0) ** i,
                eng.fetch_guidance(o["meta_info"]["guidance_handle"]),
            )
            for i, (p, o) in enumerate(zip(ids, outs))
        ]
    finally:
        eng.shutdown()


def gemm_rate(hidden: int, inter: int, tokens: int = 2048) -> float:
    """bf16 GFLOP/s of torch.mm at the MLP's shapes (forward, both backward GEMMs), median of 5."""
    a = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, inter, dtype=torch.bfloat16)
    g = torch.randn(tokens, inter, dtype=torch.bfloat16)
    flop = 3 * 2 * tokens * hidden * inter
    times = []
    for _ in range(6):
        t = time.perf_counter()
        a @ w, g @ w.t(), a.t() @ g
        times.append(time.perf_counter() - t)
    return flop / statistics.median(times[1:]) / 1e9


def step_gflop(arch, samples, recompute: str) -> float:
    """Matmul GFLOP of one train_step: every linear over every token and causal attention's QK^T and
    PV per sequence, 3 forwards' worth (forward, backward's two) plus the recomputed forward under
    full recompute (selective: its core attention and MLP), and the LM head's 4 (its backward
    recomputes each chunk's logits, trainer/logprobs.py)."""
    h, d = arch.hidden_size, arch.head_dim
    q_kv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    attn_proj = 2 * arch.num_layers * (h * q_kv + arch.num_heads * d * h)
    mlp = 2 * arch.num_layers * 3 * h * arch.intermediate_size
    lengths = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]
    tokens = sum(lengths)
    attn = sum(2 * 2 * arch.num_layers * arch.num_heads * d * n * (n + 1) / 2 for n in lengths)
    layers = 3 * ((attn_proj + mlp) * tokens + attn)
    layers += {"full": (attn_proj + mlp) * tokens + attn, "selective": mlp * tokens + attn}.get(recompute, 0)
    return (layers + 4 * 2 * h * arch.vocab_size * tokens) / 1e9


def use_recompute(actor, how: str) -> None:
    """Switches the built trainer between full recompute and none: Megatron's TransformerBlock reads
    its config's recompute_granularity at each forward, the actor its trainer config's recompute."""
    import dataclasses

    if how not in ("full", "none"):
        raise SystemExit(f"--recompute takes full and none (selective is fixed when layers are built); got {how!r}")
    for cfg in {id(m.config): m.config for m in actor.ddp.modules() if hasattr(m, "config")}.values():
        if hasattr(cfg, "recompute_granularity"):
            cfg.recompute_granularity = "full" if how == "full" else None
            cfg.recompute_method, cfg.recompute_num_layers = ("uniform", 1) if how == "full" else (None, None)
    actor.cfg = dataclasses.replace(actor.cfg, recompute=how)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_trace.config import Config
    from megatron_trace.kernels.cpu_alloc import bound_kernel_caches, peak_rss, reset_peak_rss
    from megatron_trace.models import ModelArch
    from megatron_trace.run.run import task_and_checkpoint
    from megatron_trace.trainer.actor import Actor
    from megatron_trace.trainer.parallel import destroy, init_distributed

    bound_kernel_caches()
    cfg = Config.load(args.config, args.overrides)
    tok, prompts, src, _ = task_and_checkpoint(cfg)  # the run's own: a tiny config's warm start too
    ckpt = first_layers(src, args.layers, Path(tempfile.mkdtemp(prefix="train_phase_"))) if args.layers else src
    arch = ModelArch.from_hf_config(ckpt)
    policy = cfg.quant.resolve(arch)
    max_new = args.max_new_tokens or cfg.rollout.max_new_tokens
    t = time.perf_counter()
    samples = rollout_batch(cfg, tok, prompts, ckpt, policy, args.samples, max_new)
    rollout_s = time.perf_counter() - t
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    init_distributed(seed=0)
    modes = args.modes.split(",")
    recomputes = args.recompute.split(",") if args.recompute else [cfg.trainer.recompute]
    variants = [(m, r) for m in modes for r in recomputes]
    runs = {v: [] for v in variants}
    # the config's trainer as a run builds it: trainer.optimizer_offload=disk keeps Adam's moments in a file
    offload_dir = tempfile.mkdtemp(prefix="train_phase_state_")
    try:
        actor = Actor(arch, policy, cfg.trainer, cfg.rollout, hf_path=ckpt, offload_dir=offload_dir)
        actor.qat.set_mode("guided")
        actor.train_step(samples[:2], cfg.algo)  # warm-up: kernels built, optimizer state allocated
        for _ in range(args.rounds):  # interleaved: every variant sees the same machine load
            for m, r in variants:
                actor.qat.set_mode(m)
                if args.recompute:
                    use_recompute(actor, r)
                before = reset_peak_rss()
                t = time.perf_counter()
                res = actor.train_step(samples, cfg.algo)
                wall = time.perf_counter() - t
                runs[(m, r)].append({"s": wall, "peak_gib": peak_rss() - before, **res.times})
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            out = Path(args.profile)
            out.mkdir(parents=True, exist_ok=True)
            for m, r in variants:
                actor.qat.set_mode(m)
                if args.recompute:
                    use_recompute(actor, r)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    actor.train_step(samples, cfg.algo)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                (out / (f"{m}.txt" if len(recomputes) == 1 else f"{m}_{r}.txt")).write_text(table)
    finally:
        destroy()
        shutil.rmtree(offload_dir, ignore_errors=True)
    rate = gemm_rate(arch.hidden_size, arch.intermediate_size)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items()}
    print(
        f"model: {src.name}, {arch.num_layers} of its layers, trainer {cfg.trainer.dtype}, "
        f"{cfg.trainer.max_tokens_per_microbatch}-token micro-batches; policy "
        f"{policy.format} W{policy.weights} A{policy.activations} K {policy.k_format} V {policy.v_format}, "
        f"guidance {cfg.guidance.mode}"
    )
    print(f"batch: {len(samples)} samples x {max_new} answer tokens, {tokens} tokens (rollout {rollout_s:.0f} s)")
    floors = {r: step_gflop(arch, samples, r) / rate for r in recomputes}
    for r in recomputes:
        print(
            f"recompute {r}: {step_gflop(arch, samples, r):.0f} GFLOP of matmuls a step; bf16 GEMM here "
            f"{rate:.0f} GFLOP/s -> floor {floors[r]:.1f} s"
        )
    print(
        "| mode | recompute | step s | forward + loss s | backward (+ recomputed forward) s | optimizer s "
        "| x matmul floor | x off | peak GiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (m, r), x in med.items():
        vs = x["s"] / med[("off", r)]["s"] if ("off", r) in med else float("nan")
        print(
            f"| {m} | {r} | {x['s']:.1f} | {x['recompute']:.1f} | {x['backward']:.1f} | {x['optimizer']:.1f} | "
            f"{x['s'] / floors[r]:.2f} | {vs:.2f} | {x['peak_gib']:.2f} |"
        )
    print(f"(median of {args.rounds} rounds, variants interleaved)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "gemm_gflops": rate,
                    "floor_s": floors,
                    "runs": {f"{m}/{r}": v for (m, r), v in runs.items()},
                    "median": {f"{m}/{r}": v for (m, r), v in med.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
