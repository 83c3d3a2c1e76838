"""What trainer.optimizer_offload=disk costs an optimizer step, side by side with Adam's own step:
Adam moments and grads shaped like the real Qwen2.5-Coder-0.5B's, the file on the disk that holds --dir.

    .venv/bin/python benchmarks/optimizer_offload.py [--dir runs] [--layers 24] [--rounds 3] [--keep-mb 2048]

The parameters are the untied embedding and head (151,936 x 896 each) and --layers layers' linears
(q/k/v/o and the three MLP projections), fp32 with fp32 grads and Adam's m and v; --layers 24 is the
whole model's 4.7 GiB of moments (~10 GiB in all). Each round times, interleaved: `resident` (torch
AdamW's step, the moments in memory: what a step costs without the offload), `whole` (read them all
back, step, write them all out: store + load) and `streamed` (what a run does: stepping(), a
parameter's moments read just before its update and written back after, the I/O overlapped) and
`streamed, kept` (trainer.optimizer_offload_keep_mb=--keep-mb: the first parameters' moments, whole,
stay in memory; 0 skips it).
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


def adam(layers: int, vocab: int = VOCAB) -> torch.optim.AdamW:
    """AdamW over the model's parameter shapes, one step taken (its moments made), grads in place."""
    shapes = [(vocab, HIDDEN)] * 2
    shapes += [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)] * layers
    shapes += [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)] * layers
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    opt.step()
    return opt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs", help="where the file goes (the run dir's disk)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="rows of the embedding and head")
    ap.add_argument("--keep-mb", type=float, default=2048.0, help="streamed with this much kept (0: skip)")
    args = ap.parse_args(argv)
    opt = adam(args.layers, args.vocab)
    gib = sum(t.numel() * 4 for st in opt.state.values() for k, t in st.items() if k != "step") / 2**30
    off = OptimizerStateOffload(_Megatron(opt), Path(args.dir) / "offload_bench.bin")
    print(f"{gib:.2f} GiB of moments, {Path(args.dir).resolve()} ({off.filesystem})")
    off.store()
    try:
        for r in range(args.rounds):
            took = {}
            off.load()
            t = time.perf_counter()
            opt.step()
            took["resident"] = time.perf_counter() - t
            off.store()
            t = time.perf_counter()
            with off.resident():
                opt.step()
            took["whole"] = time.perf_counter() - t
            off.take_seconds()
            t = time.perf_counter()
            with off.stepping():
                opt.step()
            took["streamed"] = time.perf_counter() - t
            waited = off.take_seconds()
            if args.keep_mb:
                off.load()
                off.keep_bytes = int(args.keep_mb * 2**20)
                off.store()
                off.take_seconds()
                t = time.perf_counter()
                with off.stepping():
                    opt.step()
                took["streamed, kept"] = time.perf_counter() - t
                kept, waited_kept = off.kept_bytes, off.take_seconds()
                off.load()
                off.keep_bytes = 0
                off.store()
            base = took["resident"]
            cells = ", ".join(f"{k} {v:.2f} s ({v / base:.2f}x)" for k, v in took.items())
            print(
                f"round {r}: {cells}; streamed waited on the disk {waited:.2f} s, "
                f"held {off.held_peak / 2**30:.2f} GiB; I/O {2 * gib / took['streamed']:.2f} GiB/s"
                + (f"; kept {kept / 2**20:.0f} MiB, waited {waited_kept:.2f} s" if args.keep_mb else "")
            )
    finally:
        off.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
