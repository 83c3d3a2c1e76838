"""Qwen3-MoE's routed experts as both rollout stacks compute them: the embedded engine
(`local/model._Layer._moe`) and the SGLang plugin's FP4 FusedMoE method (`plugin/moe_method`).

    x [T, H] --for e in 0..E-1, rows (tok, slot) routed to e-->  gate_up(e, x[tok]) -> SwiGLU
             --> down(e, h) * weights[tok, slot] --> out[tok] +=
    each expert's quantized inputs [(tok, slot, q)] --slot_record--> one [T, top_k, K] guidance site

Experts run one by one in id order, so a token's contributions are summed in the same order on
both stacks and their outputs and guidance records agree bit for bit. Each stack supplies only its
linears (`gate_up`/`down`: the engine's EngineLinear, the plugin's dequantized FP4 weights).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megatron_trace.fp4 import MXFP4Tensor, NVFP4Tensor

# (expert id, its rows of the input, their token indices, their top-k slots) -> the linear's output
ExpertLinear = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] fused gate|up -> [n, I]."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]) * gate_up[:, half:]


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    gate_up: ExpertLinear,
    down: ExpertLinear,
) -> torch.Tensor:
    """x [T, H] through the experts `ids` [T, top_k] names, each weighted by `weights` [T, top_k] (x's dtype)."""
    out = torch.zeros_like(x)
    for e in range(num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = swiglu(gate_up(e, x[tok], tok, slot))
        out.index_add_(0, tok, down(e, h, tok, slot) * weights[tok, slot, None])
    return out


def slot_record(parts: list, num_tokens: int, top_k: int) -> NVFP4Tensor | MXFP4Tensor:
    """Per-expert quantized rows [(tok, slot, q)] -> one [T, top_k, K] site in the guidance record's
    layout: NVFP4 with each row's S_enc [T, top_k] (a static scale is repeated), MXFP4 with its E8M0
    32-block scales. A slot no expert filled (a padded token) keeps zero codes and S_enc 1."""
    q0 = parts[0][2]
    dev = q0.data.device
    data = torch.zeros(num_tokens, top_k, q0.data.shape[-1], dtype=torch.uint8, device=dev)
    scale = torch.zeros(num_tokens, top_k, q0.scale.shape[-1], dtype=torch.uint8, device=dev)
    for tok, slot, q in parts:
        data[tok, slot], scale[tok, slot] = q.data, q.scale
    if isinstance(q0, MXFP4Tensor):
        return MXFP4Tensor(data, scale, q0.block)
    gs = torch.ones(num_tokens, top_k, dtype=torch.float32, device=dev)
    for tok, slot, q in parts:
        gs[tok, slot] = q.global_scale.to(torch.float32).reshape(-1).expand(tok.numel())
    return NVFP4Tensor(data, scale, gs)
