"""Peak RSS growth of one `compute_logprobs` + `train_step` on one long sample (one process).

    python tests/mp_scripts/trainer_memory.py --ckpt DIR --policy JSON --record F \
        --runs rtn:1536,rtn:6144,guided:6144 [--recompute none|selective|full] [--chunk-mb MB]

Builds the actor, warms it up on a 64-token sample (optimizer state, kernels, allocator pools);
then per run (QAT mode : tokens) resets the kernel's peak-RSS mark (VmHWM, /proc/self/clear_refs)
and reads it after the step, less the RSS before it. Prints one JSON line per run:
{"tokens", "mode", "growth_gb", "seconds"}. `--record`: a guidance record (full codes) of any
length, tiled along positions to each sample's length (memory, not agreement, is measured here).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megatron_trace.config import AlgoConfig, TrainerConfig
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.guidance.record import SiteRecord
from megatron_trace.kernels.cpu_alloc import peak_rss, reset_peak_rss
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.rl import Sample
from megatron_trace.trainer.actor import Actor
from megatron_trace.trainer.parallel import destroy, init_distributed


def tiled(rec: GuidanceRecord, positions: int, sample_id: str) -> GuidanceRecord:
    def tile(t):
        reps = -(-positions // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:positions].contiguous()

    sites = {
        name: SiteRecord(
            tile(s.scale), s.global_scale if s.global_scale.dim() == 0 else tile(s.global_scale), tile(s.payload)
        )
        for name, s in rec.sites.items()
    }
    return GuidanceRecord(sample_id, rec.mode, positions, sites)


def sample(arch: ModelArch, tokens: int, name: str, rec: GuidanceRecord | None) -> Sample:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, arch.vocab_size, (tokens + 1,), generator=g).tolist()
    prompt = 16
    r = None if rec is None else tiled(rec, tokens, name)
    return Sample(name, ids[:prompt], ids[prompt:], [-3.0] * (tokens + 1 - prompt), 1.0, r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--runs", required=True, help="comma-separated MODE:TOKENS (rtn or guided)")
    ap.add_argument("--record", required=True)
    ap.add_argument("--policy", required=True, help="QuantPolicy.to_dict() as JSON (the rollout's)")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--chunk-mb", type=float, default=128.0, help="trainer.logprob_chunk_mb")
    args = ap.parse_args()
    torch.set_num_threads(2)
    init_distributed(seed=0)
    try:
        arch = ModelArch.from_hf_config(args.ckpt)
        policy = QuantPolicy.from_dict(json.loads(args.policy))
        cfg = TrainerConfig(qat_mode="guided", lr=1e-4, recompute=args.recompute, logprob_chunk_mb=args.chunk_mb)
        actor = Actor(arch, policy, cfg, hf_path=args.ckpt)
        with open(args.record, "rb") as f:
            rec = GuidanceRecord.from_bytes(f.read())
        warm = [sample(arch, 64, "warm", rec)]
        actor.compute_logprobs(warm)
        actor.train_step(warm, AlgoConfig())
        for run in args.runs.split(","):
            mode, tokens = run.split(":")
            actor.qat.set_mode(mode)
            batch = [sample(arch, int(tokens), "long", rec if mode == "guided" else None)]
            before, t0 = reset_peak_rss(), time.perf_counter()
            actor.compute_logprobs(batch)
            actor.train_step(batch, AlgoConfig())
            grown = peak_rss() - before
            took = time.perf_counter() - t0
            print(json.dumps({"tokens": int(tokens), "mode": mode, "growth_gb": grown, "seconds": took}), flush=True)
    finally:
        destroy()


if __name__ == "__main__":
    main()
