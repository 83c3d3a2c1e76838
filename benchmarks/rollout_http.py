"""The embedded rollout engine over loopback HTTP (server + RolloutClient) against in-process calls.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_http.py --threads 1
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_http.py --quick      # smoke test, a few seconds

The project's tiny qwen2 (the shape bench_rollout.py uses), 16 prompt + 64 new tokens, greedy,
fp32, return_logprob=True. For each engine config (BF16-equivalent; NVFP4 W4A4 + NVFP4 KV), one
engine serves both sides: `Engine.generate` of the whole batch in-process, and the same batch as
one `/generate` per prompt through `RolloutClient` (parallel, as the loop's http backend sends it)
to `serve(engine)` on 127.0.0.1. Rounds are interleaved (drift on the shared box hits both alike);
tok/s = generated tokens / median wall time; HTTP overhead = median over rounds of the paired
(HTTP - in-process) / in-process. Guidance over HTTP: the FP4 engine (guidance_mode mantissa) with
return_guidance=True and every record fetched through `/get_guidance` vs the same requests without
guidance, median of the paired extra time in % (bench_rollout.py measures it in-process).

Uses only `serve`, `RolloutClient`, `Engine` and the tiny checkpoint, so the same file measures an
older checkout: copy it there and run it with that checkout's root on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

CONFIGS = {
    "BF16-equiv": {"quantization": None, "kv_cache_dtype": "auto"},
    "FP4": {"quantization": "nvfp4", "kv_cache_dtype": "nvfp4"},
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 4, 8 tokens, 2 rounds: a smoke test")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=11, help="interleaved rounds after a warm-up")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.new_tokens, args.runs = 4, 8, 2
    return args


def paired_pct(base: list[float], other: list[float]) -> float:
    return statistics.median(100.0 * (b - a) / a for a, b in zip(base, other))


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from megatron_trace.models.tiny import make_tiny_checkpoint
    from sglang_backend.api import GenerateRequest, SamplingParams
    from sglang_backend.client import RolloutClient
    from sglang_backend.local.engine import Engine
    from sglang_backend.local.server import serve

    path = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="bench_http_")) / "m", "qwen2", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 320, (args.batch, args.prompt_len), generator=g).tolist()
    sp = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    total = args.batch * (args.prompt_len + args.new_tokens) + 64 * 16
    out: dict = {}
    for name, cfg in CONFIGS.items():
        eng = Engine(
            str(path), max_running_requests=args.batch, max_total_tokens=total, guidance_mode="mantissa", **cfg
        )
        srv = serve(eng, api_key="bench")
        client = RolloutClient(srv.url, api_key="bench", max_workers=args.batch)
        try:

            def in_process(eng=eng):
                return eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)

            def over_http(guided=False, client=client):
                res = client.generate(
                    [
                        GenerateRequest(p, SamplingParams(**sp), return_logprob=True, return_guidance=guided)
                        for p in prompts
                    ]
                )
                if guided:
                    for r in res:
                        client.fetch_guidance(r.guidance_handle)
                return res

            runs = {"in-process": in_process, "HTTP": over_http}
            if name == "FP4":
                runs["HTTP + guidance"] = lambda: over_http(guided=True)
            times = {k: [] for k in runs}
            for f in runs.values():
                f()  # warm-up
            for _ in range(args.runs):
                for k, f in runs.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            ntok = args.batch * args.new_tokens
            row = {k: ntok / statistics.median(v) for k, v in times.items()}
            row["http_overhead_pct"] = paired_pct(times["in-process"], times["HTTP"])
            if "HTTP + guidance" in times:
                row["guidance_overhead_pct"] = paired_pct(times["HTTP"], times["HTTP + guidance"])
            out[name] = row
        finally:
            client.close()
            srv.shutdown()
            eng.shutdown()
    print(
        f"| engine | in-process tok/s | HTTP tok/s | HTTP overhead | guidance over HTTP | "
        f"(batch {args.batch}, {args.new_tokens} new tokens, {args.runs} rounds, {args.threads} threads) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, r in out.items():
        gpct = f"+{r['guidance_overhead_pct']:.1f}%" if "guidance_overhead_pct" in r else ""
        print(f"| {name} | {r['in-process']:.0f} | {r['HTTP']:.0f} | {r['http_overhead_pct']:+.1f}% | {gpct} | |")
    return out


if __name__ == "__main__":
    main()
