"""`python -m megatron_trace.train --config FILE [--resume] [section.key=value ...]`: one RL run.

    config ─► warm start (cached) ─► the policy resolved for the checkpoint ─► quality gate
           ─► Megatron actor + rollout backend + guidance store
           ─► for each step: rollout ─► reward ─► advantages ─► train ─► sync weights
              (hooks: heap trim, evals, logging, checkpoints)
           ─► summary (reward before/after, mismatch, time split)
The run itself is megatron_trace/run/ (run.py: its parts and its step). Multi-process
(`torchrun --nproc-per-node N -m megatron_trace.train ... trainer.tp=2`): rank 0 owns the rollout,
data, store and logs; every rank trains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_trace.kernels import cpu_alloc
from megatron_trace.run import console

cpu_alloc.bound_kernel_caches()  # before the first GEMM (the warm start, the gate) reads them
console.quiet_third_party()  # before the imports below pull in Megatron, which warns at import time

from megatron_trace.config import describe, parse_cli  # noqa: E402
from megatron_trace.run.run import Run  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m megatron_trace.train",
        description=__doc__.splitlines()[0],
        epilog="config keys:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--resume", action="store_true", help="continue from <run_dir>/checkpoints/latest")
    ap.add_argument(
        "--gate-only",
        action="store_true",
        help="run only the quality gate (BF16 vs the policy on quant.quality_prompts); writes <run_dir>/gate.json",
    )
    cfg, args = parse_cli(ap, argv)
    return cfg, args


def main(argv=None) -> int:
    cfg, args = parse_args(argv)
    resume = args.resume
    from megatron_trace.trainer.parallel import destroy

    if args.gate_only:
        from megatron_trace.run.run import gate_only

        result = gate_only(cfg)
        out = Path(cfg.logging.run_dir) / "gate.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"gate: {'pass' if result['passed'] else 'FAIL'}; written to {out}")
        return 0 if result["passed"] else 1
    try:
        run = Run(cfg, resume)
        summary = run.run()
        if run.rank0:
            console.print_summary(summary)
            (Path(cfg.logging.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
