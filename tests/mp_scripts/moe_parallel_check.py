"""torchrun worker: routing-replayed, guided QAT recompute and one train step of a tiny Qwen3-MoE
under each given TPxEP layout (one launch; the groups are re-initialized per layout).

Reads the rollout's samples (JSON + guidance record bytes, written by the test); writes
out/tp<T>_ep<E>[_sp].json on rank 0: logprobs before the step, and at TP1 or with sequence
parallelism (layout suffix "sp") the step's own forward, the logprobs after it, grad norm and loss;
every rank's codeword agreement per site, unguided rows and routing agreement.
"""

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megatron_trace.config import AlgoConfig, TrainerConfig  # noqa: E402
from megatron_trace.guidance import GuidanceRecord, decode_routed_experts  # noqa: E402
from megatron_trace.models import ModelArch, QuantPolicy  # noqa: E402
from megatron_trace.rl import Sample  # noqa: E402
from megatron_trace.trainer.actor import Actor  # noqa: E402
from megatron_trace.trainer.comm import all_gather_json  # noqa: E402
from megatron_trace.trainer.parallel import destroy, init_distributed  # noqa: E402

POLICY = QuantPolicy(format="nvfp4", weights="fp4", activations="fp4", kv="nvfp4")


def load_samples(root: Path, arch: ModelArch) -> list[Sample]:
    out = []
    for i, s in enumerate(json.loads((root / "samples.json").read_text())):
        t = len(s["prompt"]) + len(s["response"]) - 1
        routed = decode_routed_experts(
            s["routed_experts"], t, arch.num_layers, arch.num_experts_per_tok, arch.num_experts
        )
        rec = GuidanceRecord.from_bytes((root / f"guidance_{i}.bin").read_bytes())
        out.append(Sample(f"s{i}", s["prompt"], s["response"], s["logprobs"], (-1.0) ** i, rec, routed))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--samples", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="1x1", help="comma-separated TPxEP")
    args = ap.parse_args()
    for layout in args.layouts.split(","):
        sp = layout.endswith("sp")  # e.g. 2x1sp: TP2 with sequence parallelism
        tp, ep = (int(x) for x in layout.removesuffix("sp").split("x"))
        run_layout(args, tp, ep, sp)
        dist.barrier()
    destroy()


def run_layout(args, tp: int, ep: int, sp: bool) -> None:
    init_distributed(tp=tp, ep=ep, seed=0)
    arch = ModelArch.from_hf_config(args.ckpt)
    actor = Actor(
        arch,
        POLICY,
        TrainerConfig(qat_mode="guided", routing_replay="on", lr=1e-3, micro_batch_size=2, sequence_parallel=sp),
        hf_path=args.ckpt,
    )
    batch = load_samples(Path(args.samples), arch)
    actor.qat.clear_counters()
    actor.routing.clear_counters()
    before = actor.compute_logprobs(batch)
    agreement, unguided, routing = actor.qat.agreement(), dict(actor.qat.unguided), actor.routing_agreement()
    res = {"before": [t.tolist() for t in before]}
    # Megatron's MoELayer refuses to train with TP > 1 unless sequence parallelism is on
    if tp == 1 or sp:
        step = actor.train_step(batch, AlgoConfig())
        metrics, step_lp = step.metrics, step.logprobs
        after = actor.compute_logprobs(batch)
        res.update(
            {
                "step": [t.tolist() for t in step_lp],
                "after": [t.tolist() for t in after],
                "grad_norm": metrics["grad_norm"],
                "loss": metrics["loss"],
            }
        )
    ranks = all_gather_json({"agreement": agreement, "unguided": unguided, "routing": routing})
    if dist.get_rank() == 0:
        res["ranks"] = ranks
        (Path(args.out) / f"tp{tp}_ep{ep}{'_sp' if sp else ''}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
