"""The probe's rollout half: its prompts, and the embedded engine generating them under the FP4
policy with every sample's full guidance recorded (static activation scales calibrated first).
The trainer half, the scoring and the report are in megatron_trace.quality.probe."""

from __future__ import annotations

import torch

from megatron_trace.models import ModelArch, QuantPolicy


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
    """Generate on this process's embedded engine; each sample carries its full guidance bytes.
    Static activation scales: calibrated on the probe's prompts first and pushed into the engine
    as a weight version with input_scale (what the RL loop's sync sends); returned with the samples."""
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
        outs = eng.generate(
            input_ids=prompts,
            sampling_params=params,
            return_logprob=True,
            return_guidance=guided,
            return_routed_experts=arch.is_moe,
        )
        samples = []
        for prompt, out in zip(prompts, outs):
            handle = out["meta_info"]["guidance_handle"] if guided else None
            samples.append(
                {
                    "prompt": prompt,
                    "response": out["output_ids"],
                    "logprobs": [t[0] for t in out["meta_info"]["output_token_logprobs"]],
                    "routed_experts": out["meta_info"].get("routed_experts"),
                    "guidance": eng.fetch_guidance(handle) if guided else b"",
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
