"""SGLang's routed experts (FusedMoE) in FP4 for `trace_nvfp4` / `trace_mxfp4`: W4A4 per expert, as the
embedded engine runs Qwen3-MoE (`sglang_backend.local.model._Layer._moe`), with expert-site guidance.

Targets SGLang 0.5.23: `FusedMoE.__init__` asks `quant_config.get_quant_method(layer, prefix)` (prefix
`model.layers.{i}.mlp.experts`) and then calls `create_weights(layer, num_experts, hidden_size,
intermediate_size_per_partition, params_dtype, weight_loader=FusedMoE.weight_loader, ...)`,
`create_moe_runner`, and per forward `apply(layer, StandardDispatchOutput(hidden_states [T, H],
topk_output=(topk_weights [T, k], topk_ids [T, k], router_logits)))`, which returns a
StandardCombineInput. The method derives from UnquantizedFusedMoEMethod, so the checkpoint loads
into the same `w13_weight` [E, 2I, H] (gate rows, then up rows) and `w2_weight` [E, H, I] through
FusedMoE's own loader and SGLang picks the same dispatcher and top-k format as for BF16 experts.
What it changes:

* process_weights_after_loading quantizes each expert from the checkpoint values: NVFP4 with ONE
  global amax per expert over gate and up together (the engine's fused gate_up EngineLinear, the
  exporter's shared S_enc), down on its own; MXFP4 by 32-blocks with the config's rule. SGLang's
  CPU AMX repacking and the Triton SwiGLU row interleave are NOT run: nothing here reads them.
* apply computes the experts in torch, expert by expert in id order, exactly as the engine does:
  the input quantized per token (NVFP4) or per 32-block (MXFP4), dequantized, times the
  dequantized weight; SiLU(gate) * up; the down input quantized the same way; each slot's output
  scaled by its top-k weight (in the activation dtype) and summed with index_add_.
* guidance: `...mlp.experts.gate_up_proj` is one row per token [T, H] (per-token scaling quantizes a
  token's input alike for every expert), `...mlp.experts.down_proj` one row per routed slot
  [T, top_k, I], the engine's record layout (megatron_trace/guidance/record.py).

Weight updates (BF16 rows, or the trainer's ModelOpt NVFP4 expert tensors) go through FusedMoE's
loader, wrapped by moe_packed.py, which also marks the layer for re-quantization before its next forward.
Expert or tensor parallelism over the experts (moe_ep_size / moe_tp_size > 1) is refused at
create_weights: the per-expert amax and the down input's per-token scale would need the full rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.kernels.dispatch import nvfp4_quantize_dequantize

from ..routed_experts import routed_experts, slot_record
from . import capture, moe_packed
from .layer_tp import set_derived, sglang_attr

try:  # SGLang's BF16 experts method when it is installed; a plain object otherwise (CPU tests)
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as _MoEBase
except Exception:  # noqa: BLE001 - a broken SGLang install must not break the import
    _MoEBase = object

FUSED_MOE = ("sglang.srt.layers.moe.fused_moe_triton.layer", "FusedMoE")
EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def is_fused_moe(layer: nn.Module) -> bool:
    cls = sglang_attr(*FUSED_MOE)
    return cls is not None and isinstance(layer, cls)


def expert_linears(prefix: str, num_experts: int) -> list[str]:
    """The checkpoint linears a FusedMoE at `prefix` (`model.layers.{i}.mlp.experts`) holds."""
    return [f"{prefix}.{e}.{leaf}" for e in range(num_experts) for leaf in EXPERT_LEAVES]


def experts_are_fp4(prefix: str, num_experts: int, is_fp4) -> bool:
    """Whether `is_fp4(module)` holds for every expert linear of the layer (False: for none); a layer
    whose experts are partly FP4 is refused, as one FusedMoE computes all its experts one way."""
    hits = [bool(is_fp4(m)) for m in expert_linears(prefix, num_experts)]
    if any(hits) and not all(hits):
        some = [m for m, h in zip(expert_linears(prefix, num_experts), hits) if h][:3]
        raise ValueError(f"{prefix}: the quant policy makes only some routed-expert linears FP4 (e.g. {some})")
    return bool(hits) and all(hits)


class TraceFP4MoEMethod(_MoEBase):
    """W4A4 routed experts of one FusedMoE layer; `fmt` "nvfp4" or "mxfp4"."""

    def __init__(self, fmt: str, site: str, mx_rule: str = "floor"):
        if fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"FP4 experts are nvfp4 or mxfp4; got {fmt!r}")
        if _MoEBase is not object:
            super().__init__()  # no Triton kernels / FlashInfer / DeepGEMM layouts: torch reads the weights
        self.fmt, self.site, self.mx_rule = fmt, site, mx_rule
        self.block = nvfp4.BLOCK if fmt == "nvfp4" else mxfp4.BLOCK

    # -- weights -------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        check_layer_supported(layer, self.site, hidden_size, intermediate_size_per_partition, self.block)
        loader = extra_weight_attrs.get("weight_loader")
        if loader is not None:
            loader = extra_weight_attrs["weight_loader"] = functools.partial(
                moe_packed.load, loader, layer, self.site, self.fmt
            )
        extra_weight_attrs.pop("with_bias", None)
        super().create_weights(
            layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra_weight_attrs
        )
        if self.fmt == "nvfp4":  # the trainer's ModelOpt expert tensors (MXFP4 policies send BF16)
            moe_packed.add_update_params(layer, num_experts, hidden_size, intermediate_size_per_partition, loader)
        layer.trace_site, layer._trace_dirty = self.site, True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.refresh(layer)

    def refresh(self, layer: nn.Module) -> None:
        """The dequantized FP4 weights of every expert: its update's packed NVFP4 tensors as sent, else
        its BF16/FP32 rows (w13_weight / w2_weight) quantized."""
        dtype = layer.w13_weight.dtype
        for weight in ("w13", "w2"):
            rows = getattr(layer, f"{weight}_weight").data
            deq = []
            for e in range(rows.shape[0]):
                packed = moe_packed.packed_expert_weight(layer, weight, e, self.site) if self.fmt == "nvfp4" else None
                deq.append(
                    nvfp4.dequantize(packed, dtype)
                    if packed is not None
                    else self.quantize_dequantize_weight(rows[e], dtype)
                )
            set_derived(layer, f"trace_{weight}_dequant", torch.stack(deq))
        layer._trace_dirty = False

    def quantize_weight(self, w: torch.Tensor) -> nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor:
        """One expert's [rows, K] weight: NVFP4 with one global amax over all its rows (gate and up
        together for w13), as EngineLinear.finalize; MXFP4 by 32-blocks."""
        if self.fmt == "mxfp4":
            return mxfp4.quantize(w.float(), rule=self.mx_rule)
        q = nvfp4.quantize(w.float())
        return nvfp4.NVFP4Tensor(q.data, q.scale, q.global_scale.expand(w.shape[0]).clone())

    def quantize_dequantize_weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = self.quantize_weight(w)
        return mxfp4.dequantize(q, dtype) if self.fmt == "mxfp4" else nvfp4.dequantize(q, dtype)

    # -- forward -------------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor):
        """(quantized x, its dequantized values in x's dtype): EngineLinear._matmul_input's bits."""
        if self.fmt == "mxfp4":
            q = mxfp4.quantize(x, rule=self.mx_rule)
            return q, mxfp4.dequantize(q, x.dtype)
        if x.device.type == "cpu":
            return nvfp4_quantize_dequantize(x, per_row_global=True, dequant_dtype=x.dtype)
        q = nvfp4.quantize(x, per_row_global=True)
        return q, nvfp4.dequantize(q, x.dtype)

    def apply(self, layer: nn.Module, dispatch_output):
        if layer._trace_dirty:
            self.refresh(layer)
        topk = dispatch_output.topk_output
        checker = sglang_attr("sglang.srt.layers.moe.topk", "TopKOutputChecker")
        if checker is not None and not checker.format_is_standard(topk):
            raise NotImplementedError(
                f"{self.site}: trace FP4 experts take SGLang's standard top-k output; got {type(topk).__name__}"
            )
        if getattr(dispatch_output, "hidden_states_scale", None) is not None:
            raise NotImplementedError(f"{self.site}: trace FP4 experts take unquantized dispatched hidden states")
        out = self.experts_forward(
            dispatch_output.hidden_states, topk[0], topk[1], layer.trace_w13_dequant, layer.trace_w2_dequant
        )
        combine = sglang_attr("sglang.srt.layers.moe.token_dispatcher", "StandardCombineInput")
        return combine(hidden_states=out) if combine is not None else out

    def experts_forward(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        """x [T, H] through the routed experts: w13 [E, 2I, H] and w2 [E, H, I] dequantized FP4."""
        weights, ids = topk_weights.to(x.dtype), topk_ids.to(torch.long)
        top_k = ids.shape[1]
        q_in, x_deq = self.quantize_input(x)  # per-row scaling: row t's bits do not depend on the other rows
        capture.record(self.site + ".gate_up_proj", q_in)
        down_parts = [] if capture.get_capture_buffer() is not None else None  # record() is a no-op without one

        def down(e, h, tok, slot):
            q_h, h_deq = self.quantize_input(h)
            if down_parts is not None:
                down_parts.append((tok, slot, q_h))
            return F.linear(h_deq, w2[e])

        out = routed_experts(x_deq, weights, ids, w13.shape[0], lambda e, rows, tok, slot: F.linear(rows, w13[e]), down)
        if down_parts:
            capture.record(self.site + ".down_proj", slot_record(down_parts, x.shape[0], top_k))
        return out


def check_layer_supported(layer: nn.Module, site: str, hidden: int, inter: int, block: int) -> None:
    """Refuse, by name, every FusedMoE configuration apply() does not compute exactly."""
    problems = []
    for name in ("moe_tp_size", "moe_ep_size"):
        if int(getattr(layer, name, 1)) != 1:
            problems.append(f"{name}={getattr(layer, name)} (the per-expert amax and the down input's per-token scale)")
    if int(getattr(layer, "num_fused_shared_experts", 0)):
        problems.append("fused shared experts")
    if getattr(layer, "with_bias", False):
        problems.append("expert biases")
    cfg = getattr(layer, "moe_runner_config", None)
    if cfg is not None:
        if cfg.activation != "silu" or not cfg.is_gated or cfg.gemm1_alpha is not None:
            problems.append(f"activation {cfg.activation!r} (gated={cfg.is_gated}, alpha={cfg.gemm1_alpha})")
        if cfg.apply_router_weight_on_input:
            problems.append("apply_router_weight_on_input")
        if cfg.routed_scaling_factor not in (None, 1.0):
            problems.append(f"routed_scaling_factor={cfg.routed_scaling_factor}")
    for what, k in (("hidden_size", hidden), ("intermediate_size_per_partition", inter)):
        if k % block:
            problems.append(f"{what} {k} not a multiple of the {block}-block")
    if problems:
        raise NotImplementedError(
            f"{site}: trace FP4 routed experts (plugin/moe_method.py) do not support {'; '.join(problems)}; "
            "serve this model with BF16 experts in the quant policy, or with --backend local"
        )
