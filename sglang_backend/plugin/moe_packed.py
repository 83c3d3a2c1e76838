"""Weight updates of FP4 routed experts (moe_method.py): BF16 weights, or the trainer's ModelOpt NVFP4 tensors.

The trainer sends an NVFP4 policy's expert linears as ModelOpt tensors (megatron_trace/transfer/
quantize.py: `experts.{e}.{gate,up,down}_proj.weight` uint8 codes [N, K/2], `.weight_scale` E4M3
[N, K/16], `.weight_scale_2` fp32, gate and up with one S_enc; no `input_scale`, the experts being
per-token). SGLang's Qwen3-MoE loader maps `experts.{e}.gate_proj.X` to the FusedMoE parameter
`experts.w13_X` and calls its `weight_loader(param, tensor, name, shard_id=w1|w3|w2, expert_id=e)`;
a name with no parameter is SKIPPED without a word. So the layer gets parameters for every form:
`w13_weight_scale` [E, 2I, H/16] and `w2_weight_scale` [E, H, I/16] (E4M3 bytes, FusedMoE's group-
scale path), `w13_weight_scale_2` [E, 2] and `w2_weight_scale_2` [E] (its per-tensor path), and the
packed codes, which arrive under the BF16 weight's own name, are redirected by `load` into
`trace_w13_packed` [E, 2I, H/2] / `trace_w2_packed` [E, H, I/2] through the same loader (so gate rows
land first, up rows second, as w13_weight's). Per (expert, shard) the layer remembers which form it
holds last; `expert_weight` then serves the codes as sent (the engine's EngineLinear does the same
with ModelOpt rows) or quantizes the BF16 rows, and refuses an expert whose gate and up disagree.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode

# param name -> (shape of [E, H, I], dtype, FusedMoE's scale kind: FusedMoeWeightScaleSupported values)
UPDATE_PARAMS = {
    "w13_weight_scale": (lambda e, h, i: (e, 2 * i, h // 16), torch.uint8, "group"),
    "w2_weight_scale": (lambda e, h, i: (e, h, i // 16), torch.uint8, "group"),
    "w13_weight_scale_2": (lambda e, h, i: (e, 2), torch.float32, "tensor"),
    "w2_weight_scale_2": (lambda e, h, i: (e,), torch.float32, "tensor"),
}
_SHARD = {"w1": 0, "w3": 1, "w2": 0}


def add_update_params(layer: nn.Module, num_experts: int, hidden: int, inter: int, weight_loader) -> None:
    """The ModelOpt scale parameters and the packed-code buffers of an NVFP4 experts layer."""
    for name, (shape, dtype, kind) in UPDATE_PARAMS.items():
        p = nn.Parameter(torch.zeros(shape(num_experts, hidden, inter), dtype=dtype), requires_grad=False)
        p.weight_loader, p.quant_method = weight_loader, kind
        layer.register_parameter(name, p)
    # plain tensors, not parameters: the update's codes come under the BF16 `w13_weight` name (load())
    layer.trace_w13_packed = torch.zeros(num_experts, 2 * inter, hidden // 2, dtype=torch.uint8)
    layer.trace_w2_packed = torch.zeros(num_experts, hidden, inter // 2, dtype=torch.uint8)
    # per (expert, shard: gate/up, or down): whether its rows hold the update's packed codes
    layer.trace_packed = {
        "w13": torch.zeros(num_experts, 2, dtype=torch.bool),
        "w2": torch.zeros(num_experts, 1, dtype=torch.bool),
    }


def load(loader, layer: nn.Module, site: str, fmt: str, param, loaded: torch.Tensor, *args, **kwargs) -> None:
    """FusedMoE.weight_loader for every expert tensor of an update or the first load; marks the layer
    for re-quantization before its next forward."""
    weight = "w13" if param is layer.w13_weight else "w2" if param is layer.w2_weight else None
    if weight is not None and loaded.dtype == torch.uint8:
        if fmt != "nvfp4":
            raise TypeError(f"{site}: MXFP4 experts are quantized from BF16 weights; got packed uint8 {weight}")
        param = getattr(layer, f"trace_{weight}_packed")
    elif weight is None and loaded.dtype == torch.float8_e4m3fn:
        loaded = loaded.view(torch.uint8)  # E4M3 bytes kept as uint8 (the FusedMoE copy would convert values)
    loader(param, loaded, *args, **kwargs)
    if weight is not None and fmt == "nvfp4":  # MXFP4 layers hold BF16 rows only
        shard, expert = kwargs.get("shard_id", args[1] if len(args) > 1 else None), kwargs.get("expert_id")
        if expert is None or shard not in _SHARD:
            raise ValueError(f"{site}: an expert weight without expert_id/shard_id ({shard!r}, {expert!r})")
        layer.trace_packed[weight][int(expert), _SHARD[shard]] = loaded.dtype == torch.uint8
    layer._trace_dirty = True


def packed_expert_weight(layer: nn.Module, weight: str, e: int, site: str) -> nvfp4.NVFP4Tensor | None:
    """Expert e's w13 / w2 as the trainer sent it (ModelOpt NVFP4), or None when its rows are BF16."""
    packed = layer.trace_packed[weight][e]
    if not bool(packed.any()):
        return None
    if not bool(packed.all()):
        raise ValueError(f"{site}: expert {e}'s gate and up arrived one packed FP4, one BF16; send both alike")
    s2 = getattr(layer, f"{weight}_weight_scale_2").data[e].reshape(-1)
    if not bool((s2 > 0).all()):
        raise ValueError(f"{site}: expert {e}'s packed FP4 {weight} came without weight_scale_2")
    codes = getattr(layer, f"trace_{weight}_packed")[e]
    rows = codes.shape[0] // s2.numel()
    gs = torch.cat([encode_scale_from_decode(s.cpu()).expand(rows) for s in s2]).to(codes.device)
    return nvfp4.NVFP4Tensor(codes.clone(), getattr(layer, f"{weight}_weight_scale").data[e].clone(), gs)
