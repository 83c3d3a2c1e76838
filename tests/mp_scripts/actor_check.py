"""torchrun worker: the Actor's recompute and one QAT train step under each given TPxPP layout
(one launch, the model-parallel groups re-initialized per layout: imports dominate on CPU).

Writes out/<tag>.json on rank 0: per-sample logprobs (before the step), the step's grad norm and
loss, and the logprobs after the step; then saves a checkpoint, perturbs nothing, reloads it and
checks the reloaded model gives the same logprobs.
"""

import argparse
import gc
import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trace.config import AlgoConfig, TrainerConfig  # noqa: E402
from megatron_trace.models import ModelArch, QuantPolicy  # noqa: E402
from megatron_trace.rl import Sample  # noqa: E402
from megatron_trace.trainer.actor import Actor  # noqa: E402
from megatron_trace.trainer.parallel import destroy, init_distributed  # noqa: E402


def samples(arch):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(5, 7), (3, 9), (8, 4), (6, 6)]):
        ids = torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist()
        out.append(Sample(f"s{i}", ids[:p], ids[p:], [-2.0] * r, advantage=(-1.0) ** i))
    return out


def _finish(actor, batch) -> dict:
    """finish_training: the optimizer's state is freed, the weights still compute, a step refuses."""
    state = [t for st in actor.optimizer.optimizer.state.values() for t in st.values()]  # torch Adam's
    refs = [weakref.ref(t) for t in state if isinstance(t, torch.Tensor)]
    del state
    actor.finish_training()
    gc.collect()
    try:
        actor.train_step(batch, AlgoConfig())
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {
        "state_tensors": len(refs),
        "state_alive": sum(r() is not None for r in refs),
        "after_finish": [t.tolist() for t in actor.compute_logprobs(batch)],
        "step_refused": refused,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="1x1", help="comma-separated TPxPP")
    ap.add_argument("--mode", default="rtn")
    args = ap.parse_args()
    for layout in args.layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        run_layout(args, tp, pp)
        dist.barrier()
    destroy()


def run_layout(args, tp: int, pp: int) -> None:
    init_distributed(tp=tp, pp=pp, seed=0)
    arch = ModelArch.from_hf_config(args.ckpt)
    policy = QuantPolicy(kv="nvfp4")
    actor = Actor(arch, policy, TrainerConfig(qat_mode=args.mode, lr=1e-3, micro_batch_size=2), hf_path=args.ckpt)
    batch = samples(arch)
    before = actor.compute_logprobs(batch)
    for s, lp in zip(batch, before):
        s.rollout_logprobs = [float(x) + 0.01 for x in lp]
    step = actor.train_step(batch, AlgoConfig())
    metrics, step_lp = step.metrics, step.logprobs
    after = actor.compute_logprobs(batch)
    tag = f"{args.mode}_tp{tp}_pp{pp}"
    root = Path(args.out) / f"ckpt_{tag}"
    actor.save_checkpoint(root, step=0, extra={"version": 1})
    actor.load_checkpoint(root)
    reloaded = actor.compute_logprobs(batch)
    finished = _finish(actor, batch)
    if dist.get_rank() == 0:
        res = {
            "before": [t.tolist() for t in before],
            "step": [t.tolist() for t in step_lp],
            "after": [t.tolist() for t in after],
            "reloaded": [t.tolist() for t in reloaded],
            "grad_norm": metrics["grad_norm"],
            "loss": metrics["loss"],
            **finished,
        }
        (Path(args.out) / f"{tag}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
