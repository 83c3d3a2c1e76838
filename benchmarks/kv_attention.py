"""Decode attention over BF16 pages against NVFP4 / MXFP4 pages: time and bytes read, one run.

    .venv/bin/python benchmarks/kv_attention.py                    # 4K context, batch 8, Qwen2.5-0.5B heads
    .venv/bin/python benchmarks/kv_attention.py --layers 24         # every layer of a decode step
    .venv/bin/python benchmarks/kv_attention.py --context 512 --quick

A decode step's attention in --layers layers (default 1), each over its own pages, so with 24 the
pages of the whole step (403 MB of BF16 at the defaults) come from memory as in decode instead of
one layer's 17 MB staying in cache; times are per layer. Each layer: --batch sequences of
--context cached tokens each (slots scattered over the cache as a paged allocator leaves them),
one query row per sequence, --heads query heads over --kv-heads KV heads of --head-dim.
Contenders (the engine's kernels, megatron_trace/kernels/cpu_attention.py): BF16 pages (`paged_attention`),
NVFP4 pages decoded in registers (`paged_attention_nvfp4`), and MXFP4 pages in the engine's KV
layout (E8M0 per 16, ceil rule) decoded in registers (`paged_attention_kv`). All three are one
threaded C kernel (megatron_trace/kernels/cpu_attention_typed.h). --runs interleaved rounds, the median each
(wall and process CPU time: on a shared box the wall clock also counts time the threads sat
descheduled); the page bytes one layer reads are K + V of batch x context tokens (NVFP4: codes +
E4M3 scales; MXFP4: codes + E8M0 scales).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch  # noqa: E402

GOAL = 2.0  # NVFP4 pages vs BF16 pages at 4K context, batch 8 (the byte ceiling is 3.56x)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--layers", type=int, default=1, help="layers, each with its own pages, timed as one pass")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quick", action="store_true", help="512 context, 3 runs: a smoke test")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    if args.quick:
        args.context, args.runs = 512, 3
    return args


def layer_pages(slots: int, hkv: int, d: int, g: torch.Generator) -> dict:
    """One layer's K and V pages in each format, from the same random values."""
    from megatron_trace.fp4 import mxfp4, nvfp4

    k, v = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    qk, qv = nvfp4.quantize(k), nvfp4.quantize(v)
    mk, mv = (mxfp4.quantize(x, rule=mxfp4.KV_RULE, block=mxfp4.KV_BLOCK) for x in (k, v))
    return dict(
        kb=k.bfloat16(),
        vb=v.bfloat16(),
        qk=qk,
        qv=qv,
        sk=float(nvfp4.decode_scale(qk.global_scale)),
        sv=float(nvfp4.decode_scale(qv.global_scale)),
        mk=mk,
        mv=mv,
    )


def main(argv=None) -> str:
    from megatron_trace.fp4 import mxfp4
    from megatron_trace.kernels import cpu_attention

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    b, n, hkv, d = args.batch, args.context, args.kv_heads, args.head_dim
    slots = b * n
    table = torch.randperm(slots, generator=g).view(b, n).contiguous()  # scattered pages
    q = torch.randn(b, args.heads, d, generator=g).bfloat16()
    row_seq, row_len, scale = torch.arange(b), torch.full((b,), n), d**-0.5
    pages = [layer_pages(slots, hkv, d, g) for _ in range(args.layers)]

    def bf16_pages():
        for p in pages:
            cpu_attention.paged_attention(q, p["kb"], p["vb"], table, row_seq, row_len, scale)

    def nvfp4_pages():
        for p in pages:
            qk, qv = p["qk"], p["qv"]
            cpu_attention.paged_attention_nvfp4(
                q, qk.data, qk.scale, qv.data, qv.scale, p["sk"], p["sv"], table, row_seq, row_len, scale
            )

    def mx_pages():
        for p in pages:
            mk, mv = p["mk"], p["mv"]
            cpu_attention.paged_attention_kv(
                q, "mxfp4", (mk.data, mk.scale), 1.0, "mxfp4", (mv.data, mv.scale), 1.0, table, row_seq, row_len, scale
            )

    runs = {  # per layer: the page bytes one layer's step reads
        "BF16 pages": (bf16_pages, 2 * slots * hkv * d * 2),
        "NVFP4 pages (in registers)": (nvfp4_pages, 2 * slots * hkv * (d // 2 + d // 16)),
        "MXFP4 pages (in registers)": (mx_pages, 2 * slots * hkv * (d // 2 + d // mxfp4.KV_BLOCK)),
    }
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}  # process CPU time, all threads: what a descheduled wall clock hides
    for f, _ in runs.values():
        f()
    for _ in range(args.runs):
        for name, (f, _) in runs.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) / args.layers)  # per layer
            cpu[name].append((time.process_time() - c0) / args.layers)
    base = statistics.median(times["BF16 pages"])
    lines = [
        f"decode attention, batch {b}, context {n}, {args.heads}/{hkv} heads x {d}, threads {args.threads}, "
        f"{args.layers} layer(s) of own pages a pass, median of {args.runs} interleaved rounds, per layer",
        "",
        "| pages | ms/layer | vs BF16 pages | CPU ms/layer | page MB read | GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (_, nbytes) in runs.items():
        t, c = statistics.median(times[name]), statistics.median(cpu[name])
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {base / t:.2f}x | {c * 1e3:.2f} | {nbytes / 1e6:.3f} | "
            f"{nbytes / t / 1e9:.1f} |"
        )
    lines.append(f"goal: NVFP4 pages >= {GOAL}x BF16 pages at 4K context, batch 8")
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
