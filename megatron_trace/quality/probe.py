"""How far apart are the FP4 rollout and the trainer? Run this before trusting FP4 rollout.

    python -m megatron_trace.quality.probe --model-path HF_DIR [--prompts FILE.jsonl | --dataset long_addition]
        [--quantization nvfp4|mxfp4|w4a16_nvfp4|w4a16_mxfp4|none] [--kv-cache-dtype nvfp4|mxfp4|fp8|bf16]
        [--json OUT.json] [--plot OUT.png]
    torchrun --nproc-per-node 2 -m megatron_trace.quality.probe --model-path HF_DIR --tp 2

    prompts ─► rollout engine (FP4 policy, --rollout-dtype, full guidance recorded)
            ─► trainer recompute on Megatron (TP/PP) in modes off | rtn | guided-full | guided-mantissa
            ─► per mode: |Δlogp| mean/max, K3 KL, IS ratio mean/max, codeword agreement per site,
               guidance bytes per token, mean |Δlogp| by response position
The rollout half (prompts, the engine generating them under the FP4 policy with every sample's full
guidance recorded, static activation scales calibrated first) comes first below, then the trainer
half, the scoring and the report. The engine runs in bfloat16 by default while the trainer runs
fp32: real deployments differ at that level (other GEMM kernels, fused ops), and with
bitwise-identical sides plain QAT would already be perfect and nothing could be shown.

Prompts: `--prompts` JSONL lines {"prompt": text} or {"messages": [...]} (the checkpoint
tokenizer's chat template) or {"input_ids": [...]}; `--dataset` one of the project's tasks
(its eval split, in the checkpoint's tokenizer); neither: random token ids (numerics only).
Real prompts stop at EOS, so the gap is reported position by position out to the longest answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from megatron_trace.data import BUILTIN_PROMPTS
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.guidance.routing import sample_routed_experts
from megatron_trace.models import ModelArch, QuantPolicy
from megatron_trace.models.quant_policy import KV_FORMATS, KV_SHORTHANDS
from megatron_trace.rl import mismatch_metrics
from megatron_trace.trainer.comm import all_gather_json, broadcast_blobs, broadcast_json

PROBE_MODES = ("off", "rtn", "guided-full", "guided-mantissa")  # the trainer roundings the probe scores
# --quantization -> (quant.format, quant.weights, quant.activations), SGLang's spellings
QUANTIZATIONS = {
    "nvfp4": ("nvfp4", "fp4", "fp4"),
    "mxfp4": ("mxfp4", "fp4", "fp4"),
    "w4a16_nvfp4": ("nvfp4", "fp4", "bf16"),
    "w4a16_mxfp4": ("mxfp4", "fp4", "bf16"),
    "none": ("bf16", "bf16", "bf16"),
}
NO_REPLAY = "guided-full-no-replay"  # MoE with replay: what guided-full is without it


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_trace.quality.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument(
        "--quantization",
        default="nvfp4",
        choices=list(QUANTIZATIONS),
        help="linears: W4A4 or W4A16 in NVFP4 or MXFP4, or none (BF16 linears: a KV-only run)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_SHORTHANDS),
        help="K and V cache format; auto: the model family's, as quant.kv=auto (Qwen2/2.5: de-biased FP8 K + NVFP4 V)",
    )
    ap.add_argument(
        "--activation-scale",
        default="per_token",
        choices=["per_token", "static"],
        help="NVFP4 activations' global scale: per token, or static (calibrated on the probe's prompts "
        "by the fp32 HF forward, sent to the engine as input_scale, given to the trainer's QAT)",
    )
    ap.add_argument("--kv-k", default="", choices=["", *KV_FORMATS], help="K cache format (default: --kv-cache-dtype)")
    ap.add_argument("--kv-v", default="", choices=["", *KV_FORMATS], help="V cache format (default: --kv-cache-dtype)")
    ap.add_argument(
        "--kv-k-debias",
        action="store_true",
        help="the K cache holds K minus its rotated k_proj bias (quant.kv_k_debias; Qwen2/2.5)",
    )
    ap.add_argument("--targets", default=None, help="comma-separated module patterns (default: MLP + experts)")
    # All layers by default: an unguided layer's round-to-nearest flips cascade into every later
    # layer, so "last_half" (the RL default, for memory) shows how much the early flips cost.
    ap.add_argument("--guided-layers", default="all", help="all | last_half | none | N (last N)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", default=None, help="JSONL: {prompt | messages | input_ids} per line")
    src.add_argument("--dataset", default=None, choices=list(BUILTIN_PROMPTS), help="a built-in task's eval split")
    ap.add_argument("--plot", default=None, help="write mean |dlogp| by response position, per mode, as a PNG")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rollout-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    ap.add_argument(
        "--routing-replay",
        default="auto",
        choices=["auto", "on", "off"],
        help="MoE: replay the rollout's routed experts in every mode (auto: on for MoE); an MoE "
        "probe also runs guided-full without replay, to show what replay buys",
    )
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "num_prompts", "prompt_len", "tp", "pp", "ep", "micro_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (the logprobs compared are those of a sampling policy)")
    if args.activation_scale == "static" and args.quantization != "nvfp4":
        ap.error(f"--activation-scale static needs --quantization nvfp4 (W4A4 NVFP4); got {args.quantization}")
    if args.guided_layers.isdigit():
        args.guided_layers = int(args.guided_layers)
    return args


def synthetic_prompts(arch: ModelArch, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, arch.vocab_size, (n, length), generator=g).tolist()


def probe_prompts(args, arch: ModelArch) -> list[list[int]]:
    """The prompt token ids: a user's JSONL, a built-in task's eval split, or random ids."""
    if args.prompts:
        from megatron_trace.quality.measure import load_prompts

        return [p["ids"] for p in load_prompts(args.prompts, args.model_path)][: args.num_prompts]
    if args.dataset:
        from megatron_trace.data import load_tokenizer, prompt_source

        tok = load_tokenizer(str(args.model_path))
        task = prompt_source(args.dataset, seed=0, tokenizer=tok)
        return [tok.encode_prompt(p.text) for p in task.eval_set(args.num_prompts)]
    return synthetic_prompts(arch, args.num_prompts, args.prompt_len, args.seed)


def rollout(args, policy: QuantPolicy) -> tuple[list[dict], dict[str, float] | None]:
    """Generate on this process's embedded engine; each sample carries its full guidance record.
    Static activation scales: calibrated on the probe's prompts first and pushed into the engine
    as a weight version with input_scale (what the RL loop's sync sends); returned with the samples."""
    from sglang_backend.api import check_answered
    from sglang_backend.local import Engine

    arch = ModelArch.from_hf_config(args.model_path)
    eng = Engine(
        args.model_path,
        dtype=args.rollout_dtype,
        quant_policy=policy,
        guidance_mode="full",
        guided_layers=args.guided_layers,
        random_seed=args.seed,
    )
    try:
        prompts = probe_prompts(args, arch)
        amax = _push_static_scales(args, arch, policy, eng, prompts) if policy.activation_scale == "static" else None
        real = bool(args.prompts or args.dataset)  # real prompts end their answers; random ones never would
        params = [
            {
                "temperature": args.temperature,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": not real,
                "sampling_seed": args.seed * 10_000 + i,
            }
            for i in range(len(prompts))
        ]
        guided = guidance_skipped(policy) is None
        outs = check_answered(
            eng.generate(
                input_ids=prompts,
                sampling_params=params,
                return_logprob=True,
                return_guidance=guided,
                return_routed_experts=arch.is_moe,
            ),
            "the probe's rollout",
        )
        samples = []
        for prompt, out in zip(prompts, outs):
            handle = out["meta_info"]["guidance_handle"] if guided else None
            samples.append(
                {
                    "prompt": prompt,
                    "response": out["output_ids"],
                    "logprobs": [t[0] for t in out["meta_info"]["output_token_logprobs"]],
                    "routed_experts": out["meta_info"].get("routed_experts"),  # SGLang's dict: base64
                    "guidance": eng.fetch_guidance(handle) if guided else None,
                }
            )
        return samples, amax
    finally:
        eng.shutdown()


def _push_static_scales(args, arch: ModelArch, policy: QuantPolicy, eng, prompts) -> dict[str, float]:
    from megatron_trace.transfer.export import load_hf_dir
    from megatron_trace.transfer.pipeline import push_hf_state_dict
    from megatron_trace.transfer.static_scales import calibrate_static_amax
    from megatron_trace.transfer.transports import InProcessTransport
    from sglang_backend.local import InProcessBackend

    amax = calibrate_static_amax(args.model_path, arch, policy, prompts)
    _, hf_sd, _ = load_hf_dir(args.model_path)
    push_hf_state_dict(hf_sd, arch, policy, InProcessTransport(InProcessBackend(eng)), 1, input_amax=amax)
    return amax


def guidance_skipped(policy: QuantPolicy) -> str | None:
    """Why this policy's probe has no guided modes, or None (`QuantPolicy.guided_site_kinds`)."""
    if not policy.guided_site_kinds():
        return (
            f"no guided modes: guidance records quantized activations and K/V, and this run has "
            f"none (format {policy.format}, activations {policy.activations}, K {policy.k_format}, "
            f"V {policy.v_format}), so the trainer has no rollout codes to follow"
        )
    return None


def _share(samples: list[dict] | None) -> list[dict]:
    """Rank 0's samples to every rank, as JSON + record bytes (no pickle between processes); a
    single process keeps its records as they are."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return samples
    meta = broadcast_json([{k: v for k, v in s.items() if k != "guidance"} for s in samples] if samples else None)
    blobs = broadcast_blobs([s["guidance"].to_bytes() if s["guidance"] else b"" for s in samples] if samples else None)
    for s, g in zip(meta, blobs):
        s["guidance"] = GuidanceRecord.from_bytes(g) if g else None
    return meta


def probe(args) -> dict:
    from megatron_trace.config import RolloutConfig, TrainerConfig
    from megatron_trace.rl import Sample
    from megatron_trace.trainer.actor import Actor
    from megatron_trace.trainer.parallel import destroy, init_distributed
    from megatron_trace.trainer.routing_replay import replay_enabled

    arch = ModelArch.from_hf_config(args.model_path)
    targets = tuple(args.targets.split(",")) if args.targets else QuantPolicy().targets
    fmt, weights, acts = QUANTIZATIONS[args.quantization]
    policy = QuantPolicy(
        format=fmt,
        weights=weights,
        activations=acts,
        kv=args.kv_cache_dtype,
        kv_k=args.kv_k,
        kv_v=args.kv_v,
        targets=targets,
        kv_k_debias=args.kv_k_debias,
        activation_scale=args.activation_scale,
    ).resolve(arch)
    if policy.activation_scale == "static":  # every rank, before rank 0 calibrates and the others wait
        from megatron_trace.transfer.static_scales import check_calibratable

        check_calibratable(arch, policy)
    init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, seed=args.seed)
    try:
        t0 = time.perf_counter()
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        samples, amax = rollout(args, policy) if rank0 else (None, None)
        samples, amax = _share(samples), broadcast_json(amax)
        t_rollout = time.perf_counter() - t0
        skipped = guidance_skipped(policy)
        if skipped and rank0:
            print(f"WARNING: {skipped}", flush=True)
        full = [s["guidance"] for s in samples]
        records = {"full": full, "mantissa": [r.to_mantissa() for r in full] if not skipped else full}
        actor = Actor(
            arch,
            policy,
            TrainerConfig(qat_mode="off", micro_batch_size=args.micro_batch_size, routing_replay=args.routing_replay),
            RolloutConfig(temperature=args.temperature),
            hf_path=args.model_path,
        )
        if amax is not None:  # the S_enc the engine quantized with, per site (per expert for MoE)
            from megatron_trace.transfer.static_scales import static_site_scales

            actor.qat.set_static_activation_scales(static_site_scales(amax, arch, policy))
        replay = replay_enabled(args.routing_replay, arch)
        routed = [
            sample_routed_experts(s["routed_experts"], len(s["prompt"]), len(s["response"]), arch, f"s{i}")
            for i, s in enumerate(samples)
        ]
        rollout_lp = [s["logprobs"] for s in samples]
        results = {}
        modes = ("off", "rtn") if skipped else PROBE_MODES + ((NO_REPLAY,) if replay else ())
        for mode in modes:
            kind = "mantissa" if mode == "guided-mantissa" else "full"
            actor.routing.set_replay(replay and mode != NO_REPLAY)
            actor.routing.clear_counters()
            actor.qat.set_mode(mode.split("-")[0])
            # Mantissa mode rounds with only the mantissa bits of the full records, so its agreement
            # is measured against the rollout's full codes (bytes are the mantissa records').
            actor.qat.mantissa_from_codes = mode == "guided-mantissa"
            batch = [
                Sample(f"s{i}", s["prompt"], s["response"], s["logprobs"], 0.0, full[i], routed[i])
                for i, s in enumerate(samples)
            ]
            train_lp = actor.compute_logprobs(batch)
            m = mismatch_metrics(rollout_lp, [t.tolist() for t in train_lp])
            m["dlogp_by_position"] = dlogp_by_position(rollout_lp, train_lp)
            m["agreement"] = _reduce_agreement(actor.qat.agreement())
            m["override"] = _reduce_agreement(actor.qat.override_rate())
            m.update(actor.routing_agreement())  # MoE: routing_agreement, routing_replayed
            m["guidance_bytes_per_token"] = (
                0.0
                if skipped
                else (sum(r.nbytes() for r in records[kind]) / sum(r.num_positions for r in records[kind]))
            )
            results[mode] = m
        if not rank0:
            return {}  # only rank 0 reports (and writes --json): the others return before destroy()
        return {
            "model_path": str(args.model_path),
            "policy": policy.to_dict(),
            "rollout_dtype": args.rollout_dtype,
            "trainer_dtype": "float32",
            "tp": args.tp,
            "pp": args.pp,
            "ep": args.ep,
            "routing_replay": replay,
            "guided_skipped": skipped,
            "num_prompts": len(samples),
            "prompts": args.prompts or args.dataset or "random token ids",
            "response_lengths": [len(s["response"]) for s in samples],
            "max_new_tokens": args.max_new_tokens,
            "rollout_seconds": t_rollout,
            "static_scales": static_scales_by_site(actor.qat.static_scales, full, routed) if amax is not None else None,
            "total_seconds": time.perf_counter() - t0,
            "modes": results,
        }
    finally:
        destroy()


def static_scales_by_site(
    trainer: dict[str, torch.Tensor], records: list, routed: list[torch.Tensor | None]
) -> dict[str, dict[str, list[float]]]:
    """Static S_enc per linear site as the trainer rounds with it and as each rollout record carries
    it (one 0-d value per record and site; a per-token scale reads -1): the two must be the same
    numbers. Routed experts' records hold one S_enc per (token, slot); the rollout's routed expert
    ids say whose it is, so they are listed per expert site (model.layers.L.mlp.experts.E.*)."""
    rollout: dict[str, set[float]] = {}
    for r, ids in zip(records, routed):
        for site, rec in r.sites.items():
            gs = rec.global_scale
            if site in trainer:
                rollout.setdefault(site, set()).add(float(gs) if gs.dim() == 0 else -1.0)
            elif ".mlp.experts." in site:
                _expert_scales(rollout, site, gs, ids)
    return {
        "trainer": {k: [float(v)] for k, v in sorted(trainer.items())},
        "rollout": {k: sorted(v) for k, v in sorted(rollout.items())},
    }


def _expert_scales(rollout: dict[str, set[float]], site: str, gs: torch.Tensor, ids: torch.Tensor | None) -> None:
    """One routed-expert site's per-(token, slot) S_enc [T, top_k] -> rollout[expert site] sets."""
    if ids is None or gs.dim() != 2:  # not per slot: the rollout did not use per-expert static scales
        rollout.setdefault(site, set()).add(-1.0)
        return
    layer = int(site.split(".")[2])
    experts = ids[:, layer, :].long()
    if experts.shape != gs.shape:
        raise ValueError(f"{site}: per-slot scales {tuple(gs.shape)} but routed experts {tuple(experts.shape)}")
    head, leaf = site.rsplit(".", 1)
    for e in experts.unique().tolist():
        rollout.setdefault(f"{head}.{e}.{leaf}", set()).update(gs[experts == e].tolist())


def dlogp_by_position(rollout_lp: list[list[float]], train_lp: list[torch.Tensor]) -> list[float]:
    """Mean |Δlogp| at each response position, over the samples that reach it (out to the longest)."""
    longest = max((len(r) for r in rollout_lp), default=0)
    sums, counts = torch.zeros(longest, dtype=torch.float64), torch.zeros(longest, dtype=torch.float64)
    for r, t in zip(rollout_lp, train_lp):
        d = (t.double() - torch.tensor(r, dtype=torch.float64)).abs()
        sums[: len(d)] += d
        counts[: len(d)] += 1
    return (sums / counts).tolist()


def plot_by_position(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, m in res["modes"].items():
        curve = m["dlogp_by_position"]
        ax.plot(range(len(curve)), [max(v, 1e-9) for v in curve], label=mode)
    ax.set_yscale("log")
    ax.set_xlabel("response position (tokens)")
    ax.set_ylabel("mean |logp_rollout - logp_train|")
    ax.set_title(f"{res['prompts']}: {res['num_prompts']} prompts, longest answer {max(res['response_lengths'])}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _reduce_agreement(local: dict[str, float]) -> dict[str, float]:
    """Every rank counted its own sites (its pipeline stage, its TP slice); merge them."""
    merged: dict[str, list[float]] = {}
    for part in all_gather_json(local):
        for site, v in part.items():
            merged.setdefault(site, []).append(v)
    return {site: sum(v) / len(v) for site, v in sorted(merged.items())}


def _expert_agreement(m: dict) -> float:
    """The lowest codeword agreement over the routed-expert sites of one mode (nan: none counted)."""
    vals = [v for site, v in m["agreement"].items() if ".mlp.experts." in site]
    return min(vals) if vals else float("nan")


def format_table(res: dict) -> str:
    lines = [
        "| mode | mean abs dlogp | max abs dlogp | K3 KL | ratio mean | ratio max | min site agreement "
        "| guidance B/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in res["modes"].items():
        agree = min(m["agreement"].values()) if m["agreement"] else float("nan")
        lines.append(
            f"| {mode} | {m['mean_abs_dlogp']:.4g} | {m['max_abs_dlogp']:.4g} | {m['k3_kl']:.3g} | "
            f"{m['ratio_mean']:.4f} | {m['ratio_max']:.4f} | {agree:.4%} | {m['guidance_bytes_per_token']:.0f} |"
        )
    if any("routing_agreement" in m for m in res["modes"].values()):
        lines += [
            "",
            "| mode (MoE) | min expert-site agreement | routing agreement (own router) | rollout routing used |",
            "|---|---:|---:|---:|",
        ]
        for mode, m in res["modes"].items():
            lines.append(
                f"| {mode} | {_expert_agreement(m):.4%} | {m.get('routing_agreement', float('nan')):.4%} | "
                f"{m.get('routing_replayed', float('nan')):.4%} |"
            )
    pos = [k for k in res["modes"]["off"] if k.startswith("dlogp_pos_")]
    lines += [
        "",
        "| mode | " + " | ".join(p.removeprefix("dlogp_pos_").replace("_", "-") for p in pos) + " |",
        "|---|" + "---:|" * len(pos),
    ]
    for mode, m in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{m[p]:.4g}" for p in pos) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = probe(args)
    if res:  # rank 0
        kv = f"K {args.kv_k or args.kv_cache_dtype} V {args.kv_v or args.kv_cache_dtype}"
        print(
            f"rollout {args.quantization} + KV {kv} in {args.rollout_dtype}; trainer fp32 "
            f"TP{args.tp} PP{args.pp}{f' EP{args.ep}' if args.ep > 1 else ''}; {res['num_prompts']} prompts "
            f"({res['prompts']}), answers of "
            f"{min(res['response_lengths'])}-{max(res['response_lengths'])} tokens; "
            f"{res['total_seconds']:.1f} s"
        )
        print(format_table(res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        if args.plot:
            plot_by_position(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
