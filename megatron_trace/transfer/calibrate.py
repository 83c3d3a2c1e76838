"""Static activation scales for a W4A4 export: amax of every FP4 linear's input over prompts.

    amax = calibrate_input_amax(hf_sd, hf_config, prompts, modules)   # {hf module: amax}
    export_checkpoint(..., input_amax=amax)   # input_scale = amax / (6*448), fused shards share one

Stock engines (SGLang's and vLLM's `modelopt_fp4`) quantize activations with the checkpoint's
static `input_scale`; a W4A4 checkpoint without one runs on uninitialised scales. This is the
calibration ModelOpt's PTQ does: the high-precision model (transformers' own implementation of
the architecture, fp32 here) runs over the prompts with a forward pre-hook on each FP4 linear,
recording the largest |input| seen (NaN ignored). The scale itself (and the max over fused q/k/v
or gate/up shards) is `transfer.quantize` + `fp4.modelopt.input_scale_from_amax`, the same code
the live transfer uses.

Routed experts (Qwen3-MoE) have no per-expert module in transformers 5: their inputs are
recomputed from the fused experts module's own input and HF's routing (`calibrate_experts`).

Prompts: `load_prompts(file, tokenizer_dir)` reads one prompt per line (megatron_trace/data/jsonl.py:
token ids, or text and chat messages through the checkpoint's tokenizer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

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
