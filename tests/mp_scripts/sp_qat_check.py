"""torchrun worker (2 processes) for tests/test_trainer_sequence_parallel.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/mp_scripts/sp_qat_check.py \
        --ckpt DIR --samples FILE.json --records DIR --out DIR

For TP1 (DP2), TP2 and TP2 with sequence parallelism, the actor recomputes the samples' logprobs
in QAT modes off / rtn / guided (full records), then takes one guided training step and recomputes
them again; rank 0 writes --out/<config>.json (logprobs, agreement, unguided rows, step metrics).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from megatron_trace.config import AlgoConfig, TrainerConfig  # noqa: E402
from megatron_trace.guidance import GuidanceRecord  # noqa: E402
from megatron_trace.models import ModelArch, QuantPolicy  # noqa: E402
from megatron_trace.rl import Sample  # noqa: E402
from megatron_trace.trainer.actor import Actor  # noqa: E402
from megatron_trace.trainer.parallel import destroy, init_distributed  # noqa: E402

POLICY = QuantPolicy(kv="nvfp4", targets=("*.self_attn.*", "*.mlp.*"))
CONFIGS = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--samples", required=True)
    ap.add_argument("--records", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    arch = ModelArch.from_hf_config(args.ckpt)
    raw = json.loads(Path(args.samples).read_text())
    recs = [GuidanceRecord.from_bytes((Path(args.records) / f"{i}.bin").read_bytes()) for i in range(len(raw))]
    samples = [
        Sample(f"s{i}", s["prompt"], s["response"], s["logprobs"], s["advantage"], recs[i]) for i, s in enumerate(raw)
    ]
    try:
        for name, (tp, sp) in CONFIGS.items():
            init_distributed(tp=tp, pp=1, seed=0)  # re-initializes the model-parallel groups
            actor = Actor(
                arch,
                POLICY,
                TrainerConfig(qat_mode="off", micro_batch_size=2, sequence_parallel=sp, lr=1e-3),
                hf_path=args.ckpt,
            )
            res = {}
            for mode in ("off", "rtn", "guided"):
                actor.qat.set_mode(mode)
                res[mode] = [t.tolist() for t in actor.compute_logprobs(samples)]
                res[mode + "_agreement"] = actor.qat.agreement()
                res[mode + "_unguided"] = actor.qat.unguided_rows()
            metrics = actor.train_step(samples, AlgoConfig()).metrics
            res["step"] = {k: float(v) for k, v in metrics.items()}
            res["after_step"] = [t.tolist() for t in actor.compute_logprobs(samples)]
            if dist.get_rank() == 0:
                Path(args.out, f"{name}.json").write_text(json.dumps(res))
    finally:
        destroy()


if __name__ == "__main__":
    main()
