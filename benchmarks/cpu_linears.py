"""One linear at the real Qwen2.5-0.5B widths, per path the engine may take, across batch rows.

    .venv/bin/python benchmarks/cpu_linears.py --threads 2            # gate_up, down, qkv
    .venv/bin/python benchmarks/cpu_linears.py --rows 32 --shapes 9728x896
    MEGATRON_TRACE_CPU_ISA=avx2 .venv/bin/python benchmarks/cpu_linears.py   # as an AVX2-only CPU

Contenders for y = x . W^T (W [N, K]), each on --layers distinct weight copies cycled in turn
(a decode step meets each layer's weights once, so they come from memory, not cache):
  torch bf16      F.linear over bf16 weights (oneDNN reorders the weight every call)
  onednn packed   the same GEMM over the weight packed once (megatron_trace/kernels/onednn_linear.py): what the
                  engine's BF16 linears, W4A16 and the LM head run above decode widths
  w4a4 tiles      megatron_trace/kernels/cpu_gemv_w4a4.c: the decode row tiles, codes x codes in integers, weights
                  read as stored (the engine's W4A4 up to run_plan.W4A4_STREAM_MAX_ROWS)
  bf16 gemv       megatron_trace/kernels/cpu_gemv.c over the bf16 weight as stored (the engine's BF16 decode
                  widths, run_plan.STREAM_MAX_ROWS)
  fp32 up-cast    F.linear over the fp32 up-casts of x and the whole weight, rounded to bf16
  fp32 tiles      kernels/cpu_routes.mm_fp32: the weight up-cast tile by tile (--tile elements), what the
                  engine's bf16 GEMMs run where the CPU has no bf16 GEMM (cpu_routes.py)
"packed" is the reference column where oneDNN packs bf16 here, else "fp32 tiles".
Rounds are interleaved (--runs), the median per contender; GMAC/s = rows x N x K / time. (An
exact-integer W4A4 panel GEMM for 17-64 rows, rows in the vector lanes, was tried and removed: it
ran at 0.5-0.7x the packed oneDNN GEMM; see BENCHMARKS.md.)
Activations are quantized once outside the timing: what is timed is the linear alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch  # noqa: E402

SHAPES = ("9728x896", "896x4864", "1152x896")  # gate_up, down, qkv of Qwen2.5-0.5B (N x K)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="N x K")
    p.add_argument("--layers", type=int, default=24, help="distinct weight copies cycled")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--tile", type=int, default=None, help="fp32 tiles' elements (default cpu_routes.TILE_ELEMENTS)")
    return p.parse_args(argv)


def contenders(n: int, k: int, rows: int, layers: int, tile: int | None = None):
    from megatron_trace.fp4 import nvfp4
    from megatron_trace.kernels import cpu_gemv, cpu_routes, onednn_linear
    from megatron_trace.kernels.dispatch import nvfp4_quantize_dequantize

    lib = cpu_gemv._lib()
    if lib is None:
        raise SystemExit(f"the CPU kernels are not built: {cpu_gemv.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    qw = [nvfp4.quantize(torch.randn(n, k, generator=g).bfloat16() / 30) for _ in range(layers)]
    wd = [nvfp4.dequantize(q, torch.bfloat16) for q in qw]
    gdec = [nvfp4.decode_scale(q.global_scale).float().reshape(-1).expand(n).contiguous() for q in qw]
    x = torch.randn(rows, k, generator=g).bfloat16()
    qa, xq = nvfp4_quantize_dequantize(x, per_row_global=True, dequant_dtype=torch.bfloat16)
    adec = nvfp4.decode_scale(qa.global_scale).float().reshape(-1).expand(rows).contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)

    def torch_bf16(i):
        torch.nn.functional.linear(xq, wd[i])

    packed = [onednn_linear.PackedWeight() for _ in range(layers)]

    def onednn(i):
        packed[i].linear(xq, wd[i], None, key=0)

    def tiles(i):
        lib.gemv_w4a4(qa.data, qa.scale, adec, qw[i].data, qw[i].scale, gdec[i], None, out)

    def gemv(i):
        cpu_gemv.bf16_linear(xq, wd[i])

    def up_cast(i):
        torch.nn.functional.linear(xq.float(), wd[i].float()).bfloat16()

    def fp32_tiles(i):
        cpu_routes.mm_fp32(xq, wd[i].t(), tile_elements=tile)

    fns = {"torch bf16": torch_bf16}
    if onednn_linear.available():
        fns["onednn packed"] = onednn
    fns.update({"fp32 up-cast": up_cast, "fp32 tiles": fp32_tiles, "bf16 gemv": gemv, "w4a4 tiles": tiles})
    return fns


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from megatron_trace.kernels import cpu_gemv, cpu_routes

    print(
        f"threads {args.threads}, {args.layers} weight copies cycled, {args.runs} interleaved rounds, "
        f"kernels {cpu_gemv.isa()}\n{cpu_routes.routes().describe()}\n"
    )
    header = None
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for rows in args.rows:
            fns = contenders(n, k, rows, args.layers, args.tile)
            if header is None:
                header = list(fns)
                print("| N x K | rows | " + " | ".join(f"{c} ms" for c in header) + " | ref GMAC/s | each vs ref |")
                print("|---|---:|" + "---:|" * (len(header) + 2))
            times = {name: [] for name in fns}
            for f in fns.values():  # warm-up
                for i in range(args.layers):
                    f(i)
            for _ in range(args.runs):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    for i in range(args.layers):
                        f(i)
                    times[name].append((time.perf_counter() - t0) / args.layers)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            ref = "onednn packed" if "onednn packed" in med else "fp32 tiles"
            rate = rows * n * k / (med[ref] * 1e-3) / 1e9
            ratios = " ".join(f"{name.split()[0]}:{med[ref] / t:.2f}x" for name, t in med.items() if name != ref)
            cells = " | ".join(f"{med[c]:.3f}" for c in header)
            print(f"| {n} x {k} | {rows} | {cells} | {rate:.0f} | {ratios} |")


if __name__ == "__main__":
    main()
