"""Throughput of the FP4 reference quantizers on CPU, as GB/s of input and as a ratio to
torch.clone of the same tensor measured in the same run (this machine is shared and noisy).

    .venv/bin/python benchmarks/fp4.py [--size 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.fp4.guided import guided_quantize, mantissa_bits


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    q = nvfp4.quantize(x, per_row_global=True)
    bits = mantissa_bits(q.codes())
    x_train = x * (1 + 1e-3 * torch.randn_like(x))
    cases = {
        "torch.clone (baseline)": lambda: x.clone(),
        "nvfp4.quantize per-tensor": lambda: nvfp4.quantize(x),
        "nvfp4.quantize per-row": lambda: nvfp4.quantize(x, per_row_global=True),
        "nvfp4.quantize 4-over-6": lambda: nvfp4.quantize(x, four_over_six=True),
        "nvfp4.dequantize": lambda: nvfp4.dequantize(q),
        "mxfp4.quantize floor": lambda: mxfp4.quantize(x),
        "guided_quantize full": lambda: guided_quantize(x_train, q.scale, q.global_scale, codes=q.data),
        "guided_quantize mantissa": lambda: guided_quantize(x_train, q.scale, q.global_scale, mantissa=bits),
    }
    gbytes = x.numel() * x.element_size() / 1e9
    print(
        f"fp32 input {args.size}x{args.size} ({gbytes * 1e3:.0f} MB), {args.threads} threads, median of {args.repeats}"
    )
    print("| operation | ms | GB/s of fp32 input | ratio to clone |")
    print("|---|---:|---:|---:|")
    base = None
    for name, fn in cases.items():
        t = median_seconds(fn, args.repeats)
        base = base or t
        print(f"| {name} | {t * 1e3:.1f} | {gbytes / t:.2f} | {base / t:.3f} |")


if __name__ == "__main__":
    main()
