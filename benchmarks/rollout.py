"""Rollout benchmark of the embedded FP4 engine against HF transformers, side by side in one run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout.py            # default tiny qwen2, ~3-5 min on 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout.py --quick    # smoke test, a few seconds
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout.py --profile  # + cProfile of the FP4 batch decode

One random-init checkpoint (default: the project's tiny qwen2, the shape the main command trains:
hidden 64, MLP 128, 4 layers, 4 heads / 2 KV heads, head_dim 16, vocab 320; `--hidden`, `--layers`,
... change it, `--model-path` benchmarks an existing one) and one markdown table:

1. Throughput: generated tokens / wall time of one `generate` call (prefill + decode, checkpoint
   load excluded) at batch 1 and batch `--batch` (same-length prompts, `--new-tokens` new tokens each,
   ignore_eos), for the engine as BF16-equivalent (quantization None, kv auto) and as FP4 (nvfp4 W4A4
   + nvfp4 KV), each against HF `model.generate` on the same prompts (one left-padded batch with an
   attention mask; EOS disabled so every row generates exactly `--new-tokens`). Both sides run in
   `--dtype` (float32) and decode greedily (`--sampling greedy`, default) or both sample at
   temperature 1 with no top-k/top-p (`--sampling random`). The engine also returns logprobs
   (return_logprob=True, as a rollout does); HF does not. One warm-up, then `--runs` rounds in which
   every contender runs once in turn; the median per contender.
2. KV bytes per token (get_model_info()["kv_bytes_per_token"]) of dtype="bfloat16" engines: kv auto
   over nvfp4 and over mxfp4.
3. Guidance capture overhead: the FP4 engine on the batch workload with return_guidance=True (and
   every record fetched as the bytes a trainer receives) vs False, the median over 3 x `--runs`
   interleaved rounds of each round's extra time in % of its plain rollout, for guidance_mode mantissa and
   full; decoding the records into tensors (the trainer's side) timed apart; bytes per token.
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

from megatron_trace.perf.engine_vs_hf import hf_generate_fn, interleaved_times, make_prompts  # noqa: E402

GOAL_SPEEDUP = 3.0  # engine / HF at the batch size, both configs
GOAL_KV_RATIO = 3.5  # BF16 / NVFP4 KV bytes per token
GOAL_GUIDANCE_PCT = 10.0  # capture overhead, % of the rollout

QUICK = dict(
    hidden=32,
    intermediate=64,
    layers=2,
    heads=2,
    kv_heads=1,
    head_dim=16,
    vocab=64,
    prompt_len=4,
    new_tokens=8,
    batch=4,
    runs=1,
)

ROW_LABELS = (
    "throughput batch 1, BF16-equiv",
    "throughput batch 1, FP4",
    "throughput batch {B}, BF16-equiv",
    "throughput batch {B}, FP4",
    "KV bytes/token BF16 / NVFP4",
    "KV bytes/token BF16 / MXFP4",
    "guidance overhead, mantissa",
    "guidance overhead, full",
    "guidance decode (trainer side, over http), mantissa",
    "guidance decode (trainer side, over http), full",
    "guidance bytes/token, mantissa",
    "guidance bytes/token, full",
)

ENGINE_CONFIGS = {  # label -> Engine kwargs
    "BF16-equiv": dict(quantization=None, kv_cache_dtype="auto"),
    "FP4": dict(quantization="nvfp4", kv_cache_dtype="nvfp4"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 run: a smoke test")
    ap.add_argument("--model-path", help="benchmark this HF checkpoint instead of a random tiny one")
    ap.add_argument("--family", default="qwen2", choices=("qwen2", "qwen3", "qwen3_moe"))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--runs",
        type=int,
        default=11,
        help="timed rounds (median), after one warm-up; the guidance pairs run 3x as many",
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engine and HF")
    ap.add_argument("--sampling", default="greedy", choices=("greedy", "random"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-hf", action="store_true", help="engine rows only (no HF baseline)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the FP4 engine's batch rollout (driven in this thread) and print hotspots",
    )
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


# -- engines ----------------------------------------------------------------------------------
def engine_params(args) -> dict:
    sp = {"max_new_tokens": args.new_tokens, "ignore_eos": True}
    sp["temperature"] = 0.0 if args.sampling == "greedy" else 1.0
    return sp


def make_engine(path: Path, args, **kw):
    from sglang_backend.local.engine import Engine

    total = args.batch * (args.prompt_len + args.new_tokens) + 64 * 16
    kw.setdefault("dtype", args.dtype)
    return Engine(str(path), max_running_requests=max(args.batch, 1), max_total_tokens=total, **kw)


# -- 1. throughput -----------------------------------------------------------------------------
def throughput(path: Path, args, prompts) -> tuple[dict, dict | None]:
    """tok/s of every engine config and of HF at batch 1 and `--batch`: one warm-up each, then
    `--runs` rounds, each timing every contender once in turn (drift on a shared machine then
    hits all alike); the median per contender. Returns ({config: {b: (tok/s, ids)}}, HF's or None)."""
    engines = {name: make_engine(path, args, **cfg) for name, cfg in ENGINE_CONFIGS.items()}
    try:
        hf = None if args.skip_hf else hf_generate_fn(path, args)
        sp = engine_params(args)
        eng_out, hf_out = {name: {} for name in engines}, ({} if hf else None)
        for b in (1, args.batch):
            batch = prompts[:b]
            runs = {
                name: (lambda e=e: e.generate(input_ids=batch, sampling_params=sp, return_logprob=True))
                for name, e in engines.items()
            }
            if hf:
                runs["HF"] = lambda: hf(batch)
            times, last = interleaved_times(runs, args.runs)
            for name in engines:
                ids = [r["output_ids"] for r in last[name]]
                ntok = sum(len(i) for i in ids)
                assert ntok == b * args.new_tokens, f"engine generated {ntok} tokens, expected {b * args.new_tokens}"
                paired = statistics.median(h / e for h, e in zip(times["HF"], times[name])) if hf else None
                eng_out[name][b] = (ntok / statistics.median(times[name]), ids, paired)
            if hf:
                new = last["HF"]
                assert new.shape == (b, args.new_tokens), f"HF generated {tuple(new.shape)}"
                hf_out[b] = (new.numel() / statistics.median(times["HF"]), new.tolist())
    finally:
        for e in engines.values():
            e.shutdown()
    return eng_out, hf_out


# -- 2. KV bytes -------------------------------------------------------------------------------
def kv_bytes(path: Path, args) -> dict:
    out = {}
    for kv in ("auto", "nvfp4", "mxfp4"):
        eng = make_engine(path, args, dtype="bfloat16", kv_cache_dtype=kv)
        try:
            out[kv] = float(eng.get_model_info()["kv_bytes_per_token"])
        finally:
            eng.shutdown()
    return out


# -- 3. guidance overhead ----------------------------------------------------------------------
def guidance_overhead(path: Path, args, prompts, mode: str) -> dict:
    """Rollout time with return_guidance=True and every record fetched (the bytes a trainer
    receives) against the same rollout without guidance; decoding the records back into tensors is
    the trainer's work and timed apart."""
    from megatron_trace.guidance import GuidanceRecord

    eng = make_engine(path, args, quantization="nvfp4", kv_cache_dtype="nvfp4", guidance_mode=mode)
    sp = engine_params(args)
    batch = prompts[: args.batch]
    fetched: list[bytes] = []

    def plain():
        return eng.generate(input_ids=batch, sampling_params=sp, return_logprob=True)

    def guided():
        res = eng.generate(input_ids=batch, sampling_params=sp, return_logprob=True, return_guidance=True)
        fetched[:] = [eng.fetch_guidance(r["meta_info"]["guidance_handle"]) for r in res]
        return res

    try:
        plain(), guided()  # warm-up both paths
        t_plain, t_guided, t_decode = [], [], []
        # interleaved, so drift on a shared machine hits both alike; a few % is the signal, a burst
        # of noise on this shared box is tens of %, so this cheap pair gets 3x the rounds
        for _ in range(3 * args.runs):
            t0 = time.perf_counter()
            plain()
            t_plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            guided()
            t_guided.append(time.perf_counter() - t0)
            wire = [r.to_bytes() for r in fetched]  # what an SGLang server sends; in-process hands records over
            t0 = time.perf_counter()
            records = [GuidanceRecord.from_bytes(b) for b in wire]
            t_decode.append(time.perf_counter() - t0)
    finally:
        eng.shutdown()
    p, g, d = statistics.median(t_plain), statistics.median(t_guided), statistics.median(t_decode)
    pairs = statistics.median(100.0 * (b - a) / a for a, b in zip(t_plain, t_guided))
    return {
        "plain_s": p,
        "guided_s": g,
        "overhead_pct": pairs,
        "decode_s": d,
        "bytes_per_token": statistics.mean(r.bytes_per_token() for r in records) if records else float("nan"),
    }


# -- profile -----------------------------------------------------------------------------------
def profile_engine(path: Path, args, prompts, cfg: dict, top: int = 25) -> str:
    """cProfile one batch rollout, with the scheduler stepped in this thread (cProfile sees one thread)."""
    import cProfile
    import io
    import pstats

    from sglang_backend.api import GenerateRequest, SamplingParams
    from sglang_backend.local.scheduler import Group

    eng = make_engine(path, args, **cfg)
    eng.shutdown()  # stop the worker; drive its scheduler directly
    sp = SamplingParams.from_dict(engine_params(args))

    def rollout():
        for i, ids in enumerate(prompts[: args.batch]):
            eng.scheduler.add(Group(GenerateRequest(list(ids), sp, f"p{i}", True, False), [f"p{i}"]))
        while eng.scheduler.has_work():
            eng.scheduler.step()

    rollout()  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    rollout()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return buf.getvalue()


# -- report ------------------------------------------------------------------------------------
def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def build_table(args, eng_tp: dict, hf_tp: dict | None, kv: dict, guid: dict) -> list[str]:
    B = args.batch
    lines = ["| Metric | Engine | Baseline | Engine / baseline | Goal | Met |", "|---|---:|---:|---:|---:|:---:|"]
    for b in (1, B):
        for name in ENGINE_CONFIGS:
            e = eng_tp[name][b][0]
            label = f"throughput batch {b}, {name}"
            if hf_tp is None:
                lines.append(f"| {label} | {e:.0f} tok/s | (HF skipped) | - | - | - |")
                continue
            h, r = hf_tp[b][0], eng_tp[name][b][2]  # r: median over rounds of HF time / engine time
            goal = GOAL_SPEEDUP if b == B else None
            lines.append(
                f"| {label} | {e:.0f} tok/s | HF {h:.0f} tok/s | {r:.2f}x | "
                f"{'>= %.0fx' % goal if goal else '-'} | {_met(None if goal is None else r >= goal)} |"
            )
    for fmt in ("nvfp4", "mxfp4"):
        r = kv["auto"] / kv[fmt]
        goal = GOAL_KV_RATIO if fmt == "nvfp4" else None
        lines.append(
            f"| KV bytes/token BF16 / {fmt.upper()} | {kv[fmt]:g} B ({fmt}) | {kv['auto']:g} B (bf16) | "
            f"{r:.2f}x | {'>= %.1fx' % goal if goal else '-'} | {_met(None if goal is None else r >= goal)} |"
        )
    for mode in ("mantissa", "full"):
        g = guid[mode]
        lines.append(
            f"| guidance overhead, {mode} | {g['guided_s']:.3f} s with guidance | {g['plain_s']:.3f} s without | "
            f"{g['overhead_pct']:+.1f}% | <= {GOAL_GUIDANCE_PCT:.0f}% | "
            f"{_met(g['overhead_pct'] <= GOAL_GUIDANCE_PCT)} |"
        )
    for mode in ("mantissa", "full"):
        g = guid[mode]
        lines.append(
            f"| guidance decode (trainer side, over http), {mode} | {1000 * g['decode_s']:.1f} ms for all records | "
            f"{g['plain_s']:.3f} s rollout | {100 * g['decode_s'] / g['plain_s']:.1f}% | - | - |"
        )
    for mode in ("mantissa", "full"):
        lines.append(f"| guidance bytes/token, {mode} | {guid[mode]['bytes_per_token']:.1f} B | - | - | - | - |")
    return lines


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        if args.model_path:
            path = Path(args.model_path)
        else:
            from megatron_trace.models.tiny import make_tiny_checkpoint

            over = dict(
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads,
                vocab_size=args.vocab,
                max_position_embeddings=max(512, 2 * (args.prompt_len + args.new_tokens)),
            )
            if args.family != "qwen2" or args.head_dim != args.hidden // args.heads:
                over["head_dim"] = args.head_dim
            if args.family == "qwen3_moe":
                over["moe_intermediate_size"] = args.intermediate // 4
            path = make_tiny_checkpoint(Path(tmp) / "ckpt", args.family, seed=0, **over)
        from megatron_trace.models import ModelArch

        arch = ModelArch.from_hf_config(path)
        prompts = make_prompts(args.batch, args.prompt_len, arch.vocab_size)

        eng_tp, hf_tp = throughput(path, args, prompts)
        kv = kv_bytes(path, args)
        guid = {mode: guidance_overhead(path, args, prompts, mode) for mode in ("mantissa", "full")}
        prof = profile_engine(path, args, prompts, ENGINE_CONFIGS["FP4"]) if args.profile else None

    header = (
        f"{arch.family}: hidden {arch.hidden_size}, {arch.num_layers} layers, {arch.num_heads} heads / "
        f"{arch.num_kv_heads} KV heads, head_dim {arch.head_dim}, vocab {arch.vocab_size}; "
        f"{args.prompt_len} prompt + {args.new_tokens} new tokens (ignore_eos), batch 1 and {args.batch}; "
        f"{args.dtype} on both sides, {args.sampling} decoding on both sides, {args.threads} threads; "
        f"tok/s = generated tokens / wall time of one generate call (prefill included, load excluded); "
        f"median of {args.runs} rounds after 1 warm-up; ratios are the median of each round's "
        f"HF time / engine time; guidance overhead: median over {3 * args.runs} paired rounds."
    )
    notes = []
    if hf_tp is not None and args.sampling == "greedy":
        for name in ENGINE_CONFIGS:
            a, b = eng_tp[name][args.batch][1], hf_tp[args.batch][1]
            same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / max(sum(len(r) for r in b), 1)
            notes.append(f"greedy tokens equal to HF's, engine {name}: {100 * same:.1f}%")
    notes.append(f"total bench time {time.perf_counter() - t_start:.0f} s")
    report = "\n".join([header, "", *build_table(args, eng_tp, hf_tp, kv, guid), "", *notes])
    print(report)
    if prof:
        print("\n## cProfile: FP4 engine, batch rollout\n")
        print(prof)
    return report


if __name__ == "__main__":
    main()
