"""What trainer.optimizer_offload=disk costs a step: one store (write + free) and one load (read back)
of Adam moments shaped like the real Qwen2.5-Coder-0.5B's, on the disk that holds --dir.

    .venv/bin/python benchmarks/optimizer_offload.py [--dir runs] [--layers 24] [--rounds 3]

The moments are fp32 m and v of the untied embedding and head (151,936 x 896 each) and --layers
layers' linears (q/k/v/o and the three MLP projections); --layers 24 is the whole model's 4.7 GiB.
Prints each round's seconds and GiB/s; a step pays one store and one load. Round 0 stores Adam's own
tensors (through the bounce buffer, as a run's first step does); later rounds store what load made.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from megatron_trace.trainer.offload import OptimizerStateOffload

HIDDEN, VOCAB, FFN, KV = 896, 151_936, 4_864, 128


class _Megatron:
    """The shape the offload reads: a torch optimizer under `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def moments(layers: int, vocab: int = VOCAB) -> torch.optim.Adam:
    shapes = [(vocab, HIDDEN)] * 2
    shapes += [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)] * layers
    shapes += [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)] * layers
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    opt = torch.optim.Adam(params)
    g = torch.Generator().manual_seed(0)
    for p in params:
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(p.shape, generator=g),
            "exp_avg_sq": torch.rand(p.shape, generator=g),
        }
    return opt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs", help="where the file goes (the run dir's disk)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="rows of the embedding and head")
    args = ap.parse_args(argv)
    opt = moments(args.layers, args.vocab)
    gib = sum(t.numel() * 4 for st in opt.state.values() for k, t in st.items() if k != "step") / 2**30
    off = OptimizerStateOffload(_Megatron(opt), Path(args.dir) / "offload_bench.bin")
    print(f"{gib:.2f} GiB of moments, {Path(args.dir).resolve()} ({off.filesystem})")
    try:
        for r in range(args.rounds):
            t = time.perf_counter()
            off.store()
            stored = time.perf_counter() - t
            t = time.perf_counter()
            off.load()
            loaded = time.perf_counter() - t
            print(
                f"round {r}: store {stored:.2f} s ({gib / stored:.2f} GiB/s), load {loaded:.2f} s "
                f"({gib / loaded:.2f} GiB/s), a step's {stored + loaded:.2f} s"
            )
    finally:
        off.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
