"""Static activation scales, all of them: calibration, the run's modules, the trainer's site S_enc.

    amax = calibrate_static_amax(model_path, arch, policy, prompt_ids)   # {HF module: input amax}
    push_weights(..., input_amax=amax)                                   # buckets carry input_scale
    qat.set_static_activation_scales(static_site_scales(amax, arch, policy))
    export_checkpoint(..., input_amax=calibrate_input_amax(hf_sd, hf_config, prompts, modules))

Stock engines (SGLang's and vLLM's `modelopt_fp4`) quantize activations with the checkpoint's
static `input_scale`; a W4A4 checkpoint without one runs on uninitialised scales. The calibration
is ModelOpt's PTQ: the high-precision model of the starting checkpoint (transformers' own
implementation, fp32) runs over the prompts with a forward pre-hook on each FP4 linear, recording
the largest |input| seen (NaN ignored). The scale itself (max over fused q/k/v or gate/up shards,
amax / (6*448)) is `fp4.modelopt.input_scale_from_amax`, the same code the live transfer uses.

Not the trainer's Megatron forward: under TP the inputs of row-parallel linears (o_proj,
down_proj) are sharded and every rank would need a max-reduce, and its fused q/k/v / gate/up
modules hide the per-member names the checkpoint's input_scale is keyed by. Not the engine: it
quantizes its activations itself, so it would calibrate on the rollout's own rounding. One
definition of amax on the weights every side starts from keeps the exported, synced and trained
scales identical; a resumed run recalibrates the same amax from the same checkpoint and prompts.

Routed experts (Qwen3-MoE) have no per-expert module in transformers 5: their inputs are recomputed
from the fused experts module's own input and HF's routing (`calibrate_experts`), one amax per
expert (gate/up shared, down its own); the trainer and the engine use one S_enc per expert.

Prompts: `load_prompts(file, tokenizer_dir)` reads one prompt per line (megatron_trace/data/jsonl.py:
token ids, or text and chat messages through the checkpoint's tokenizer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..fp4.modelopt import encode_scale_from_decode, input_scale_from_amax
from ..models import ModelArch, QuantPolicy
from ..models.quant_policy import fused_members
from .calibrate_experts import ExpertInputAmax, fuse_hf_experts, is_expert_module

log = logging.getLogger(__name__)


def load_prompts(path: str | Path, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Token-id prompts from a JSON-lines file (data/jsonl.py's prompt lines; text needs the
    checkpoint's tokenizer files in `tokenizer_dir`)."""
    from megatron_trace.data.jsonl import prompt_ids, read_lines

    tok = {}

    def tokenizer(where: str):
        if "t" not in tok:
            tok["t"] = _tokenizer(tokenizer_dir, where)
        return tok["t"]

    return [prompt_ids(item, lambda w=where: tokenizer(w), where)[0] for where, item in read_lines(path)]


def _tokenizer(tokenizer_dir, where: str):
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer_config.json").exists():
        raise ValueError(
            f"{where}: text prompts need the checkpoint's tokenizer files (none in {tokenizer_dir}); "
            "write token ids instead"
        )
    from transformers import AutoTokenizer  # lazy: seconds of imports

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _hf_model(hf_sd: Mapping[str, torch.Tensor], hf_config: dict):
    import transformers

    cfg = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = fuse_hf_experts({k: v.to(torch.float32) for k, v in hf_sd.items()})  # per-expert names -> HF's fused
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(
            f"calibration model does not match the checkpoint: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return model.eval()


def _forward(model, prompts: Sequence[Sequence[int]]) -> None:
    with torch.no_grad():
        for ids in prompts:
            model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)


def calibrate_input_amax(
    hf_sd: Mapping[str, torch.Tensor], hf_config: dict, prompts: Sequence[Sequence[int]], modules: Sequence[str]
) -> dict[str, float]:
    """{HF module name: max |input|} of each module in `modules` over the prompts (fp32 forward)."""
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    model = _hf_model(hf_sd, hf_config)
    experts = [m for m in modules if is_expert_module(m)]
    amax = {m: torch.zeros((), dtype=torch.float32) for m in modules if m not in experts}
    hooks = []
    for m in amax:

        def pre(_mod, args, m=m):
            x = args[0].detach().float().abs()
            amax[m] = torch.maximum(amax[m], torch.nan_to_num(x, nan=0.0).amax())

        hooks.append(model.get_submodule(m).register_forward_pre_hook(pre))
    expert_amax = ExpertInputAmax(model, experts) if experts else None
    try:
        _forward(model, prompts)
        if expert_amax is not None and expert_amax.unreached():
            unrouted = expert_amax.begin_unrouted_pass()
            log.warning(
                "static activation calibration: no calibration token was routed to %d routed expert(s) (%s); "
                "their input_scale is calibrated as if every calibration token of their layer were routed to "
                "them (transfer/calibrate_experts.py). More or other calibration prompts reach them.",
                sum(map(len, unrouted.values())),
                "; ".join(f"{p}: experts {es}" for p, es in unrouted.items()),
            )
            _forward(model, prompts)
    finally:
        for h in hooks:
            h.remove()
        if expert_amax is not None:
            expert_amax.remove()
    found = {m: float(v) for m, v in amax.items()}
    if expert_amax is not None:
        found.update(expert_amax.result())
    zero = [m for m in modules if not found[m] > 0]
    if zero:
        raise ValueError(f"calibration saw no non-zero input for {zero[:4]}; use more or longer prompts")
    return {m: found[m] for m in modules}


def static_amax_modules(arch: ModelArch, policy: QuantPolicy) -> list[str]:
    """The HF linears whose input the policy quantizes to FP4: the ones that need a static scale."""
    return [m for m in policy.quantized_linears(arch) if policy.activation_is_fp4(m, arch.num_layers)]


def calibrate_static_amax(
    model_path: str | Path, arch: ModelArch, policy: QuantPolicy, prompts: Sequence[Sequence[int]]
) -> dict[str, float]:
    """{HF module: max |input|} of every FP4-activation linear over `prompts` (token ids), from the
    fp32 forward of the checkpoint at `model_path`. Raises when the policy is not static or a site
    saw nothing (calibrate_input_amax names zero-amax modules)."""
    from .export import load_hf_dir

    modules = check_calibratable(arch, policy)
    _, hf_sd, hf_config = load_hf_dir(model_path)
    amax = calibrate_input_amax(hf_sd, hf_config, [list(p) for p in prompts], modules)
    missing = [m for m in modules if not amax.get(m, 0.0) > 0.0]
    if missing:
        raise ValueError(f"static activation calibration gave no amax for {missing[:4]}")
    return amax


def check_calibratable(arch: ModelArch, policy: QuantPolicy) -> list[str]:
    """The modules to calibrate, or a ValueError saying why this policy/model cannot be (cheap: every
    rank of a run calls it, so none is left waiting for a rank 0 that refused)."""
    if policy.activation_scale != "static":
        raise ValueError(
            f"calibrating static activation scales for a policy with activation_scale={policy.activation_scale!r}"
        )
    modules = static_amax_modules(arch, policy)
    if not modules:
        raise ValueError(
            "activation_scale='static' but the policy quantizes no linear's input to FP4 "
            f"(format {policy.format}, activations {policy.activations}): nothing to calibrate"
        )
    if policy.format != "nvfp4":
        raise ValueError(f"static activation scales are NVFP4's input_scale; format {policy.format} has none")
    return modules


def _sites(arch: ModelArch) -> list[str]:
    """The trainer's input sites of one layer (under model.layers.N.). A routed expert E has its own
    input_scale, so its sites are mlp.experts.E.gate_up_proj / down_proj (what `ExpertRows.expert_site`
    names; every layer of a Qwen3-MoE is an MoE layer)."""
    attn = ["self_attn.qkv_proj", "self_attn.o_proj"]
    if not arch.is_moe:
        return [*attn, "mlp.gate_up_proj", "mlp.down_proj"]
    return attn + [f"mlp.experts.{e}.{leaf}" for e in range(arch.num_experts) for leaf in ("gate_up_proj", "down_proj")]


def static_site_scales(input_amax: dict[str, float], arch: ModelArch, policy: QuantPolicy) -> dict[str, torch.Tensor]:
    """{HF module: calibrated input amax} (what the exporter and the transfer take) -> the static
    S_enc of each FP4-activation site: the max over a fused group's members, through the
    checkpoint's decode-direction input_scale, exactly as the engine reads it back
    (EngineLinear.finalize); per routed expert for MoE layers."""
    out = {}
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        for site in _sites(arch):
            names = [m for m in fused_members(prefix + site) if policy.activation_is_fp4(m, arch.num_layers)]
            if not names:
                continue
            missing = [n for n in names if n not in input_amax]
            if missing:
                raise KeyError(
                    f"no calibrated input amax for {missing[:3]}: static activation scales need one "
                    f"per FP4-activation linear"
                )
            amax = max(float(input_amax[n]) for n in names)
            out[prefix + site] = encode_scale_from_decode(input_scale_from_amax(amax))
    return out
