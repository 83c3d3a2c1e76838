"""Decode throughput of the embedded engine with a de-biased K cache against the same K format plain.

    .venv/bin/python benchmarks/kv_debias.py --model-path HF_DIR      # a Qwen2/2.5 (it has a k_proj bias)

Every contender is NVFP4 W4A4 + NVFP4 V in bfloat16, greedy with EOS off, --batch prompts of
--prompt-len tokens decoding --new-tokens: K as NVFP4 or FP8, plain or de-biased (quant.kv_k_debias:
the page kernels add RoPE_pos(k_proj bias) to the K rows they decode). One warm-up each, then --runs
rounds in which each contender runs once in turn (a shared machine's drift hits all alike); the
median tok/s of a whole `generate` (prefill included) and its ratio to plain NVFP4 K.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_trace.models import ModelArch, QuantPolicy
from sglang_backend.local import Engine

CONTENDERS = {
    "NVFP4 K": dict(kv_k="nvfp4"),
    "NVFP4 K de-biased": dict(kv_k="nvfp4", kv_k_debias=True),
    "FP8 K": dict(kv_k="fp8"),
    "FP8 K de-biased": dict(kv_k="fp8", kv_k_debias=True),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20000, (args.batch, args.prompt_len), generator=g).tolist()
    sp = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    engines = {
        name: Engine(
            args.model_path,
            dtype="bfloat16",
            quant_policy=QuantPolicy(kv_v="nvfp4", **kw).resolve(ModelArch.from_hf_config(args.model_path)),
            guided_layers="none",
        )
        for name, kw in CONTENDERS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for e in engines.values():
            e.generate(input_ids=prompts, sampling_params=sp)  # warm-up: kernels built, pages touched
        for _ in range(args.runs):
            for name, e in engines.items():
                t0 = time.perf_counter()
                e.generate(input_ids=prompts, sampling_params=sp)
                times[name].append(time.perf_counter() - t0)
    finally:
        for e in engines.values():
            e.shutdown()
    tokens = args.batch * args.new_tokens
    base = tokens / statistics.median(times["NVFP4 K"])
    shape = f"batch {args.batch}, {args.prompt_len} prompt + {args.new_tokens} new tokens"
    print(f"{shape}, {torch.get_num_threads()} threads")
    print("| K cache | tok/s (median) | vs NVFP4 K | runs (s) |\n|---|---:|---:|---|")
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        print(f"| {name} | {tps:.1f} | {tps / base:.2f} | {', '.join(f'{t:.1f}' for t in ts)} |")


if __name__ == "__main__":
    main()
