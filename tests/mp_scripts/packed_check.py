"""torchrun worker for tests/test_trainer_packed.py: one family's samples under each named layout.

    python -m torch.distributed.run --nproc-per-node N tests/mp_scripts/packed_check.py \
        --ckpt DIR --samples DIR --out DIR --layouts padded,packed,...

Per layout the actor recomputes the samples' logprobs in QAT modes off / rtn / guided, takes one
guided training step and recomputes them again; rank 0 writes out/<layout>.json with the
logprobs, the step's metrics, codeword agreement and the raw counts behind it (so a recomputed
forward that counted twice shows), and routing agreement for MoE. Run with the repository on
PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import megatron.core
import torch.distributed as dist

from megatron_trace.config import AlgoConfig, TrainerConfig
from megatron_trace.guidance import GuidanceRecord, decode_routed_experts
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.rl import Sample
from megatron_trace.trainer.actor import Actor
from megatron_trace.trainer.parallel import destroy, init_distributed

# name -> (tp, pp, ep, cp, trainer overrides). Small budgets: several micro-batches per step.
LAYOUTS = {
    "padded": (1, 1, 1, 1, {"packing": False, "micro_batch_size": 2}),
    "packed": (1, 1, 1, 1, {}),
    "packed_selective": (1, 1, 1, 1, {"recompute": "selective"}),
    "packed_full": (1, 1, 1, 1, {"recompute": "full"}),
    "tp2_sp": (2, 1, 1, 1, {"sequence_parallel": True}),
    "pp2": (1, 2, 1, 1, {}),
    "pp2_full": (1, 2, 1, 1, {"recompute": "full"}),
    "cp2": (1, 1, 1, 2, {}),
    "dp2": (1, 1, 1, 1, {}),
    "ep2": (1, 1, 2, 1, {}),
}
BUDGET = 40  # tokens per packed micro-batch (the samples have 14-22)


def load(root: Path, arch: ModelArch) -> tuple[QuantPolicy, list[Sample]]:
    meta = json.loads((root / "samples.json").read_text())
    out = []
    for i, s in enumerate(meta["samples"]):
        t = len(s["prompt"]) + len(s["response"]) - 1
        routed = (
            None
            if s.get("routed_experts") is None
            else decode_routed_experts(
                s["routed_experts"], t, arch.num_layers, arch.num_experts_per_tok, arch.num_experts
            )
        )
        rec = GuidanceRecord.from_bytes((root / f"guidance_{i}.bin").read_bytes())
        out.append(Sample(f"s{i}", s["prompt"], s["response"], s["logprobs"], (-1.0) ** i * (1 + i / 4), rec, routed))
    return QuantPolicy.from_dict(meta["policy"]), out


def run(args, name: str) -> None:
    tp, pp, ep, cp, over = LAYOUTS[name]
    init_distributed(tp=tp, pp=pp, ep=ep, cp=cp, seed=0)
    arch = ModelArch.from_hf_config(args.ckpt)
    policy, samples = load(Path(args.samples), arch)
    cfg = TrainerConfig(
        qat_mode="off",
        lr=1e-3,
        max_tokens_per_microbatch=BUDGET,
        max_tokens_per_logprob_microbatch=BUDGET,
        **over,
    )
    actor = Actor(arch, policy, cfg, hf_path=args.ckpt)
    if actor.head is not None:  # 3 rows of logits per chunk: the loss runs through several chunks
        actor.vocab = dataclasses.replace(actor.vocab, chunk_bytes=3 * 4 * actor.head.output_size_per_partition)
    res = {}
    for mode in ("off", "rtn", "guided"):
        actor.qat.set_mode(mode)
        res[mode] = [t.tolist() for t in actor.compute_logprobs(samples)]
        res[mode + "_agreement"] = actor.qat.agreement()
    actor.qat.set_mode("guided")
    actor.routing.clear_counters()
    step = actor.train_step(samples, AlgoConfig())
    metrics, step_lp = step.metrics, step.logprobs
    res["step"] = {k: float(v) for k, v in metrics.items()}
    res["step_lp"] = [t.tolist() for t in step_lp]
    res["step_counts"] = {k: list(v) for k, v in actor.qat.agree.items()}
    res["step_routing"] = actor.routing_agreement()
    res["after_step"] = [t.tolist() for t in actor.compute_logprobs(samples)]
    res["megatron_core"] = megatron.core.__version__
    if dist.get_rank() == 0:
        (Path(args.out) / f"{name}.json").write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--samples", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True)
    args = ap.parse_args()
    try:
        for name in args.layouts.split(","):
            run(args, name)
            dist.barrier()
    finally:
        destroy()


if __name__ == "__main__":
    main()
