"""Train-step throughput and peak memory on a long-tailed batch: packed THD micro-batches vs the
right-padded layout, side by side in one process (a benchmark, not a test).

    .venv/bin/python benchmarks/trainer_packing.py [--samples 64] [--min-len 100] [--max-len 4000]
        [--rounds 2] [--hidden 256] [--layers 4] [--vocab 32000] [--json out.json]

The batch: `--samples` sequences whose lengths follow a long tail (log-uniform between --min-len
and --max-len, one at the maximum); each is a 32-token prompt plus its response. The model is a
random-init Qwen2 of the given shape, fp32 on CPU, plain QAT (W4A4 MLP + NVFP4 KV, rtn). Per
layout and round: one `train_step` after a warm-up step, its wall time, the response tokens per
second, and the peak RSS growth (the kernel's VmHWM mark reset before the step). The padded layout
uses trainer.micro_batch_size rows per micro-batch (Megatron's unfused attention, S x S scores);
the packed one trainer.max_tokens_per_microbatch tokens per stream (flash SDPA per sample).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time

from megatron_trace.config import AlgoConfig, TrainerConfig
from megatron_trace.kernels.cpu_alloc import peak_rss, reset_peak_rss
from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
from megatron_trace.rl import Sample
from megatron_trace.trainer.actor import Actor
from megatron_trace.trainer.parallel import destroy, init_distributed

POLICY = QuantPolicy(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4")
PROMPT = 32


def batch(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[Sample]:
    r = random.Random(seed)
    lengths = [int(math.exp(r.uniform(math.log(lo), math.log(hi)))) for _ in range(n - 1)] + [hi]
    out = []
    for i, length in enumerate(lengths):
        ids = [r.randrange(vocab) for _ in range(PROMPT + length)]
        out.append(Sample(f"s{i}", ids[:PROMPT], ids[PROMPT:], [-4.0] * length, (-1.0) ** i))
    return out


def step(actor: Actor, samples: list[Sample]) -> dict:
    before = reset_peak_rss()
    t = time.perf_counter()
    metrics = actor.train_step(samples, AlgoConfig()).metrics
    took = time.perf_counter() - t
    tokens = sum(len(s.response_ids) for s in samples)
    return {"s": took, "tok_s": tokens / took, "peak_gb": peak_rss() - before, "mb": metrics["micro_batches"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="padded layout: rows per micro-batch")
    ap.add_argument("--budget", type=int, default=8192, help="packed layout: tokens per micro-batch")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 2),
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_len + PROMPT + 1,
    )
    ckpt = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen2", seed=0, **shape)
    arch = ModelArch.from_hf_config(ckpt)
    samples = batch(args.samples, args.min_len, args.max_len, args.vocab, seed=0)
    init_distributed(seed=0)
    layouts = {
        "padded": TrainerConfig(qat_mode="rtn", packing=False, micro_batch_size=args.micro_batch_size),
        "packed": TrainerConfig(qat_mode="rtn", max_tokens_per_microbatch=args.budget),
    }
    actors = {k: Actor(arch, POLICY, cfg, hf_path=ckpt) for k, cfg in layouts.items()}
    warm = samples[:2]
    for a in actors.values():
        a.train_step(warm, AlgoConfig())
    runs = {k: [] for k in actors}
    for _ in range(args.rounds):  # interleaved: both layouts see the same machine load
        for k, a in actors.items():
            runs[k].append(step(a, samples))
    destroy()
    tokens = sum(len(s.response_ids) for s in samples)
    print(f"batch: {len(samples)} samples, {tokens} response tokens, lengths {args.min_len}..{args.max_len}")
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, CPU, QAT rtn")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("s", "tok_s", "peak_gb", "mb")} for k, v in runs.items()}
    print(f"{'layout':<8} {'micro-batches':>13} {'step s':>8} {'tokens/s':>9} {'peak GiB':>9}")
    for k, m in med.items():
        print(f"{k:<8} {m['mb']:>13.0f} {m['s']:>8.1f} {m['tok_s']:>9.0f} {m['peak_gb']:>9.2f}")
    print(f"packed / padded tokens/s: {med['packed']['tok_s'] / med['padded']['tok_s']:.2f}x (median of {args.rounds})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
