#!/usr/bin/env python
"""Check and time the FP4 Triton kernels against their references and BF16 baselines.

On a GPU (default): every kernel is first checked against its torch reference on fresh random
inputs, then timed with CUDA events (L2 flushed before each call, median of --reps calls)
against the BF16 baseline:
  * W4A16 / W4A4 GEMM at M = 1, 8, 32, 128 and N x K = 8192x8192, 8192x29568, 29568x8192
    vs cuBLAS BF16 (torch.matmul);
  * paged decode attention (8 q heads / 1 kv head, head_dim 128) at 4K / 32K / 128K context,
    NVFP4 and MXFP4 pages, vs the same kernel on BF16 pages and vs SDPA on contiguous BF16 K/V;
  * NVFP4 quantize (+ guidance) and guided rounding of a bf16 [8192, 8192] activation vs a
    bf16 copy of it.
It prints one markdown table: time, the baseline's time, speedup, and achieved bandwidth as % of
the HBM peak (bytes the kernel must move / time / --peak-gbps) -- for quantize also as % of the
copy bandwidth measured in the same run.
Goals: GEMV (M <= 8) >= 2.5x cuBLAS on 8192x8192; FP4-KV attention at 32K >= 2.5x BF16;
quantize >= 60% of copy bandwidth.

--cpu-check runs every code path (kernels under TRITON_INTERPRET=1, checks, baselines, the table)
on tiny shapes on the CPU; its timings measure the interpreter, not the kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-check", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument("--reps", type=int, default=None, help="timed calls per case (default 50 GPU, 2 CPU)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak for the roofline column (H200: 4800)")
    p.add_argument("--only", default="gemm,attn,quant", help="comma list of sections")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    return p.parse_args(argv)


class Timer:
    def __init__(self, device, reps):
        import torch

        self.torch, self.device, self.reps = torch, device, reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        """Median seconds of one call."""
        torch = self.torch
        if self.flush is not None:
            fn()  # warm-up / compile (the interpreter has nothing to warm)
        times = []
        for _ in range(self.reps):
            if self.flush is not None:
                self.flush.zero_()  # evict L2 (50 MB) so weights and pages come from HBM
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def bench_gemm(cfg, timer, rows, dev):
    import torch

    from megatron_trace.kernels import dispatch

    for n, k in cfg["gemm_nk"]:
        w_src = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        w = dispatch.nvfp4_quantize(w_src, per_row_global=True, backend="triton")
        w_bf16 = w_src  # the BF16 baseline's weight: same shape, cuBLAS cost does not depend on values
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        for m in cfg["gemm_m"]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            extra = cfg.get("gemm_extra", {})
            err = _rel_err(
                dispatch.fp4_linear(x, w, bias, out_dtype=torch.float32, backend="triton", **extra),
                dispatch.fp4_linear_reference(x, w, bias, out_dtype=torch.float32),
            )
            err4 = _rel_err(
                dispatch.fp4_linear_w4a4(x, w, bias, out_dtype=torch.float32, backend="triton", **extra),
                dispatch.fp4_linear_w4a4_reference(x, w, bias, out_dtype=torch.float32),
            )
            t_bf16 = timer(lambda: torch.nn.functional.linear(x, w_bf16, bias))
            t_fp4 = timer(lambda: dispatch.fp4_linear(x, w, bias, backend="triton", **extra))
            t_a4 = timer(lambda: dispatch.fp4_linear_w4a4(x, w, bias, backend="triton", **extra))
            io = m * k * 2 + m * n * 2 + n * 2
            fp4_bytes = n * k * 0.5625 + n * 4 + io
            rows.append(("W4A16 GEMM", f"M={m} N={n} K={k}", err, 1e-5, t_fp4, t_bf16, fp4_bytes, "cuBLAS bf16"))
            rows.append(
                ("W4A4 GEMM", f"M={m} N={n} K={k}", err4, 1e-5, t_a4, t_bf16, fp4_bytes + m * k * 0.5625, "cuBLAS bf16")
            )
        w_src = w = w_bf16 = None  # free the device memory before the next shape


def _kv_pages(fmt, slots, kvh, d, gs, dev):
    import torch

    from megatron_trace.fp4 import mxfp4
    from megatron_trace.kernels import dispatch

    x = torch.randn(slots, kvh, d, device=dev, dtype=torch.bfloat16)
    if fmt == "nvfp4":
        q = dispatch.nvfp4_quantize(x, global_scale=gs, backend="triton")
        return q.data, q.scale
    if fmt == "mxfp4":
        q = mxfp4.quantize(x, rule="ceil", block=16)
        return q.data, q.scale
    return x, None


def bench_attention(cfg, timer, rows, dev):
    import torch

    from megatron_trace.kernels import dispatch

    h, kvh, d, ps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"]
    for ctx, bsz in cfg["attn_cases"]:
        slots = bsz * ctx
        perm = torch.randperm(slots // ps, device=dev)  # pages scattered through the pool
        t = torch.arange(ctx, device=dev)
        table = torch.stack([perm[(b * ctx + t) // ps] * ps + t % ps for b in range(bsz)]).to(torch.int32)
        lens = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(bsz, h, d, device=dev, dtype=torch.bfloat16)
        gk, gv = torch.tensor(200.0, device=dev), torch.tensor(150.0, device=dev)
        kb, _ = _kv_pages("bf16", slots, kvh, d, None, dev)
        vb, _ = _kv_pages("bf16", slots, kvh, d, None, dev)
        extra = cfg.get("attn_extra", {})
        t_paged = timer(
            lambda: dispatch.paged_decode_attention(
                q, kb, None, vb, None, None, None, table, lens, "bf16", backend="triton", **extra
            )
        )
        kc = kb[table.long()].permute(0, 2, 1, 3).contiguous()  # [B, kvh, L, D] contiguous for SDPA
        vc = vb[table.long()].permute(0, 2, 1, 3).contiguous()
        t_sdpa = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True))
        kc = vc = None
        base, base_name = min((t_paged, "paged bf16"), (t_sdpa, "SDPA bf16"))
        rows.append(
            (
                "BF16 paged attn",
                f"ctx={ctx} B={bsz}",
                float("nan"),
                None,
                t_paged,
                t_sdpa,
                4 * slots * kvh * d + 4 * slots,
                "SDPA bf16",
            )
        )
        nchk = min(bsz, cfg["attn_check_rows"])
        for fmt in ("nvfp4", "mxfp4"):
            k_p, k_s = _kv_pages(fmt, slots, kvh, d, gk, dev)
            v_p, v_s = _kv_pages(fmt, slots, kvh, d, gv, dev)
            args = (k_p, k_s, v_p, v_s, gk, gv)
            qf = q[:nchk].float()
            err = _rel_err(
                dispatch.paged_decode_attention(qf, *args, table[:nchk], lens[:nchk], fmt, backend="triton", **extra),
                dispatch.paged_decode_attention_reference(qf, *args, table[:nchk], lens[:nchk], fmt),
            )
            t_fp4 = timer(
                lambda: dispatch.paged_decode_attention(q, *args, table, lens, fmt, backend="triton", **extra)
            )
            rows.append(
                (
                    f"{fmt.upper()} paged attn",
                    f"ctx={ctx} B={bsz}",
                    err,
                    1e-5,
                    t_fp4,
                    base,
                    2 * slots * kvh * d * 0.5625 + 4 * slots,
                    base_name,
                )
            )
            del k_p, k_s, v_p, v_s
        kb = vb = None


def bench_quantize(cfg, timer, rows, dev):
    import torch

    from megatron_trace.fp4 import guided_quantize, mantissa_bits_packed, nvfp4
    from megatron_trace.kernels import dispatch

    m, k = cfg["quant_mk"]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_copy = timer(lambda: y.copy_(x))
    copy_bw = 2 * x.numel() * 2 / t_copy
    rows.append(("bf16 copy", f"{m}x{k}", float("nan"), None, t_copy, t_copy, 2 * x.numel() * 2, "copy"))
    gs = torch.tensor(10.0, device=dev)
    cases = [
        ("quantize per-token", dict(per_row_global=True), 0),
        ("quantize static S_enc", dict(global_scale=gs), 0),
        ("quantize+guidance full", dict(per_row_global=True, mode="full"), 0),
        ("quantize+guidance mantissa", dict(per_row_global=True, mode="mantissa"), m * k / 8),
    ]
    for name, kw, extra_bytes in cases:
        if "mode" in kw:

            def run(kw=kw):
                return dispatch.nvfp4_quantize_with_guidance(x, backend="triton", **kw)

            got, g = run()
            want, gw = dispatch.nvfp4_quantize_with_guidance_reference(x, **kw)
            ok = torch.equal(g, gw)
        else:

            def run(kw=kw):
                return dispatch.nvfp4_quantize(x, backend="triton", **kw)

            got, want = run(), nvfp4.quantize(x, **kw)
            ok = True
        ok = ok and torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
        t = timer(run)
        moved = m * k * 2 + m * k * 0.5625 + extra_bytes
        rows.append(
            (
                name,
                f"{m}x{k}",
                0.0 if ok else 1.0,
                0.0,
                t,
                t_copy,
                moved,
                f"copy ({100 * moved / t / copy_bw:.0f}% of copy BW)",
            )
        )
    # TRACE guided rounding (the trainer's QAT): the rollout's scales and codes / mantissa bits in.
    roll = nvfp4.quantize(x.float() * 1.01, per_row_global=True)
    for name, kw, guide_bytes in [
        ("guided rounding full", dict(codes=roll.data), m * k / 2),
        ("guided rounding mantissa", dict(mantissa=mantissa_bits_packed(roll.data)), m * k / 8),
    ]:

        def run(kw=kw):
            return dispatch.nvfp4_guided_quantize(x, roll.scale, roll.global_scale, backend="triton", **kw)

        want = guided_quantize(x, roll.scale, roll.global_scale, **kw)
        ok = torch.equal(run().data, want.data)
        t = timer(run)
        moved = m * k * 2 + m * k / 16 + guide_bytes + m * k / 2
        rows.append(
            (
                name,
                f"{m}x{k}",
                0.0 if ok else 1.0,
                0.0,
                t,
                t_copy,
                moved,
                f"copy ({100 * moved / t / copy_bw:.0f}% of copy BW)",
            )
        )


def table(rows, peak_gbps) -> str:
    out = [
        "| kernel | shape | check (max rel err) | time us | baseline us | speedup | % HBM peak | baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, shape, err, tol, t, base, moved, base_name in rows:
        if err != err:
            chk = "-"
        else:
            chk = f"{err:.1e} {'ok' if err <= tol else 'FAIL'}"
        roof = 100 * moved / t / (peak_gbps * 1e9)
        out.append(
            f"| {name} | {shape} | {chk} | {t * 1e6:.1f} | {base * 1e6:.1f} | {base / t:.2f}x | {roof:.1f}% "
            f"| {base_name} |"
        )
    return "\n".join(out)


GPU_CFG = dict(
    gemm_nk=[(8192, 8192), (8192, 29568), (29568, 8192)],
    gemm_m=[1, 8, 32, 128],
    heads=8,
    kv_heads=1,
    head_dim=128,
    page_size=16,
    attn_cases=[(4096, 128), (32768, 16), (131072, 4)],
    attn_check_rows=4,
    quant_mk=(8192, 8192),
)
CPU_CFG = dict(
    gemm_nk=[(40, 96)],
    gemm_m=[1, 3],
    gemm_extra=dict(split_k=2),
    heads=4,
    kv_heads=1,
    head_dim=32,
    page_size=4,
    attn_cases=[(24, 2)],
    attn_check_rows=2,
    attn_extra=dict(splits=2),
    quant_mk=(4, 64),
)


def main(argv=None) -> int:
    args = _args(argv)
    if args.cpu_check:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu-check needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # interpreter: masked lanes divide by 0
    if args.cpu_check:
        dev, cfg, reps = torch.device("cpu"), CPU_CFG, args.reps or 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu-check for the CPU code-path check")
        dev, cfg, reps = torch.device("cuda"), GPU_CFG, args.reps or 50
        torch.manual_seed(0)
    timer = Timer(dev, reps)
    rows: list = []
    sections = {"gemm": bench_gemm, "attn": bench_attention, "quant": bench_quantize}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        sections[name](cfg, timer, rows, dev)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    md = table(rows, args.peak_gbps)
    interp = "CPU (Triton interpreter; times are not kernel times)"
    where = torch.cuda.get_device_name() if dev.type == "cuda" else interp
    header = f"device: {where}, reps {reps}, peak {args.peak_gbps:.0f} GB/s"
    print(header + "\n\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + md + "\n")
    failed = [r for r in rows if r[2] == r[2] and r[3] is not None and r[2] > r[3]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
