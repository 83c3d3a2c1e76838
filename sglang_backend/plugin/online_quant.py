"""Online FP4 quantization of a BF16/FP32 checkpoint inside SGLang: `--quantization trace_nvfp4`
(NVFP4 W4A4) and `trace_mxfp4` (MXFP4 W4A4).

The RL loop starts from a BF16 checkpoint, so the rollout server must quantize at load time,
with the same rules as the embedded engine (`sglang_backend.local.layers.EngineLinear`): the
project's `QuantPolicy` decides which linears are FP4 (default: the MLP), a fused group (q/k/v,
gate/up) shares one global amax, activations are quantized per token. At TP > 1 that amax is the
FULL weight's (a MAX all-reduce over the TP group), so every rank holds exactly the bytes the
trainer's exporter (`to_modelopt_fused`) gives its slice (tests/test_sglang_tp2.py). `trace_fp4` stays the
loader of exported ModelOpt NVFP4 checkpoints (claimed without any flag).

SGLang builds a config without arguments when a method names no config file
(`get_config_filenames() == []`, model_loader/weight_utils.py get_quant_config), so the policy
comes from the environment the launcher sets: TRACE_QUANT_POLICY = JSON
`{"policy": QuantPolicy.to_dict(), "num_layers": N}` (without it: the default policy).
"""

from __future__ import annotations

import json

import torch
from torch import nn

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode
from megatron_trace.models.quant_policy import QuantPolicy

from .. import plugin_settings as settings
from .layer_tp import set_derived, sglang_attr, tp_all_max
from .moe_method import TraceFP4MoEMethod, expert_linears, experts_are_fp4, is_fused_moe
from .quant_config import PACKED_MODULES, TraceFP4Config
from .quant_method import TraceFP4LinearMethod

POLICY_ENV = settings.env_name("quant_policy")


def policy_from_env(fmt: str) -> tuple[QuantPolicy, int | None]:
    raw = settings.current().quant_policy
    if not raw:
        return QuantPolicy(format=fmt, kv="bf16"), None  # linears only: the KV method has its own settings
    try:
        d = json.loads(raw)
        policy, num_layers = QuantPolicy.from_dict(d["policy"]), d.get("num_layers")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{POLICY_ENV} must be JSON {{'policy': {{...}}, 'num_layers': N}}; got {raw!r}: {e}"
        ) from None
    if policy.format != fmt:
        raise ValueError(f"{POLICY_ENV} says format {policy.format!r} but the server quantizes to {fmt!r}")
    return policy, num_layers


class TracePolicyConfig(TraceFP4Config):
    """Online quantization by the project's QuantPolicy (given in POLICY_ENV): get_quant_method makes
    a linear or the routed experts FP4 where the policy says, SGLang's default elsewhere. The two
    formats below differ in their name, their FP4 format and their linear method."""

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # quantized at load time from a BF16 checkpoint

    @classmethod
    def override_quantization_method(cls, *_, **__) -> str | None:
        return None  # never claims a checkpoint: asked for by name only

    def _policy(self):
        if getattr(self, "_trace_policy", None) is None:
            self._trace_policy = policy_from_env(self.FMT)
        return self._trace_policy

    def is_fp4_prefix(self, prefix: str) -> bool:
        policy, num_layers = self._policy()
        if policy.bf16_layers_end and num_layers is None:
            raise ValueError(f"quant.bf16_layers_end needs the layer count: set num_layers in {POLICY_ENV}")
        head, _, last = prefix.rpartition(".")
        members = self.packed_modules_mapping.get(last, PACKED_MODULES.get(last, [last]))
        hits = [policy.linear_is_fp4(f"{head}.{m}" if head else m, num_layers or 1 << 30) for m in members]
        if any(hits) and not all(hits):
            raise ValueError(f"{prefix}: the quant policy makes only part of the fused shards {members} FP4")
        return bool(hits) and all(hits)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if is_fused_moe(layer):
            return self.experts_method(layer, prefix)
        linear_base = sglang_attr("sglang.srt.layers.linear", "LinearBase")
        if linear_base is not None and not isinstance(layer, linear_base):
            return None
        if not self.is_fp4_prefix(prefix) or self.is_layer_excluded(prefix):
            unquant = sglang_attr("sglang.srt.layers.quantization.unquant", "UnquantizedLinearMethod")
            return unquant() if unquant is not None else None
        return self.linear_method(site=prefix)

    def experts_method(self, layer: nn.Module, prefix: str):
        """The routed experts of one FusedMoE: FP4 (plugin/moe_method.py) where the policy says, as the
        engine runs them; SGLang's BF16 method (None) where it keeps them BF16."""
        policy, num_layers = self._policy()
        n = num_layers or 1 << 30
        if not experts_are_fp4(prefix, layer.num_experts, lambda m: policy.linear_is_fp4(m, n)):
            return None
        if policy.activations != "fp4":
            raise NotImplementedError(f"{prefix}: {self.NAME} serves W4A4 routed experts only; the policy asks W4A16")
        if policy.activation_scale != "per_token":  # no input_scale ever reaches a FusedMoE here
            raise NotImplementedError(
                f"{prefix}: {self.NAME}'s routed experts quantize their inputs per token; the policy asks "
                f"activation_scale={policy.activation_scale} (per-expert static scales: --backend local)"
            )
        if any(self.is_layer_excluded(m) for m in expert_linears(prefix, layer.num_experts)):
            raise ValueError(f"{prefix}: exclude_modules keeps routed experts BF16 that the quant policy makes FP4")
        return TraceFP4MoEMethod(self.FMT, prefix, mx_rule=self.mx_rule)


class TraceNVFP4OnlineLinearMethod(TraceFP4LinearMethod):
    """BF16/FP32 `weight` loaded as is; after load, NVFP4 with one global amax over the fused shards.

    The trainer's weight updates arrive in the ModelOpt layout (the rollout tensors it quantized with
    the same fp4 code as its QAT): packed uint8 `weight` rows go to `trace_packed_weight`, the scales
    to `weight_scale` / `weight_scale_2` / `input_scale` (0 = per-token), and the layer then serves
    those bits (as an NVFP4 export would) until a BF16 weight is loaded again."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        k, parts = input_size_per_partition, len(output_partition_sizes)
        self._common(layer, k, output_partition_sizes, input_size, params_dtype)
        rows = sum(output_partition_sizes)
        self._param(layer, "weight", torch.zeros(rows, k, dtype=params_dtype))
        self.modelopt_scales(layer, rows, k, parts)
        packed = nn.Parameter(torch.zeros(rows, k // 2, dtype=torch.uint8), requires_grad=False)
        packed.trace_name = "weight"  # the rows _load_rows writes; not a checkpoint name of its own
        layer.trace_packed_weight = packed.data
        layer._trace_packed_param, layer._trace_packed = packed, False

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.trace_name != "weight":  # the ModelOpt scales of an update
            return TraceFP4LinearMethod.load_shard(self, layer, param, loaded, shard_id)
        if loaded.dtype == torch.uint8:
            self._load_rows(layer, layer._trace_packed_param, loaded, shard_id)
            layer._trace_packed = True
            return None
        self._load_rows(layer, param, loaded.to(param.dtype), shard_id)
        layer._trace_packed = False
        return None

    def refresh(self, layer: nn.Module) -> None:
        if getattr(layer, "_trace_packed", False):
            return self._refresh_packed(layer)
        w = layer.weight.data.float()
        q = nvfp4.quantize(w, global_amax=self.full_weight_amax(layer, w))
        gs = q.global_scale.reshape(()).expand(q.data.shape[0]).clone()
        set_derived(layer, "trace_weight_codes", q.data)
        set_derived(layer, "trace_weight_scales", q.scale)
        set_derived(layer, "trace_weight_global_scale", gs)
        set_derived(layer, "trace_input_global_scale", None)
        set_derived(layer, "trace_weight_dequant", nvfp4.dequantize(self.quantized_weight(layer), layer.params_dtype))
        layer._trace_dirty = False

    @staticmethod
    def full_weight_amax(layer: nn.Module, w: torch.Tensor) -> torch.Tensor:
        """The amax of the FULL checkpoint weight of this (fused) layer, whose shard this rank holds:
        the exporter (`to_modelopt_fused`) sets the one S_enc of q/k/v or gate/up from it, so at TP > 1
        the rank's amax is MAX-reduced over the TP group (every rank calls refresh for the same layers
        in the same order: process_weights_after_loading, or the first forward after a weight update).
        Rows and row-parallel K chunks are whole 16-blocks, so codes and E4M3 scales then equal the
        exporter's on this rank's slice."""
        amax = nvfp4.nan_free_amax(w).to(torch.float32)
        all_max = tp_all_max(layer)
        return amax if all_max is None else all_max(amax.reshape(1)).reshape(())

    def _refresh_packed(self, layer: nn.Module) -> None:
        """Serve an update's ModelOpt tensors: the export path's rules (one S_enc per fused shard from
        weight_scale_2, input_scale 0 = per-token activations)."""
        s2, si = layer.weight_scale_2.data, layer.input_scale.data
        if not bool((s2 > 0).all()):
            raise ValueError(
                f"{layer.trace_site}: a packed FP4 weight update without weight_scale_2 for partitions "
                f"{(s2 <= 0).nonzero().flatten().tolist()}"
            )
        gs = torch.cat([encode_scale_from_decode(s2[i].cpu()).expand(w) for i, w in enumerate(layer.logical_widths)])
        set_derived(layer, "trace_weight_codes", layer.trace_packed_weight.clone())
        set_derived(layer, "trace_weight_scales", layer.weight_scale.data.view(torch.uint8).clone())
        set_derived(layer, "trace_weight_global_scale", gs.to(s2.device))
        static = bool((si > 0).all())
        set_derived(
            layer,
            "trace_input_global_scale",
            encode_scale_from_decode(si.max().cpu()).to(si.device) if static else None,
        )
        set_derived(layer, "trace_weight_dequant", nvfp4.dequantize(self.quantized_weight(layer), layer.params_dtype))
        layer._trace_dirty = False

    def quantized_weight(self, layer) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(layer.trace_weight_codes, layer.trace_weight_scales, layer.trace_weight_global_scale)

    @staticmethod
    def update_alternates(spec: dict, policy: QuantPolicy, num_layers: int) -> dict:
        """For weight_check: the ModelOpt tensors an update may carry for each FP4 linear's `weight`."""
        out = {}
        for name, shapes in spec.items():
            module, _, last = name.rpartition(".")
            (shape, dtype) = shapes[0]
            if last != "weight" or len(shape) != 2 or shape[1] % 16 or not policy.linear_is_fp4(module, num_layers):
                continue
            rows, k = shape
            out[name] = [((rows, k // 2), torch.uint8)]
            out[module + ".weight_scale"] = [((rows, k // 16), torch.float8_e4m3fn)]
            # routed experts (moe_packed.py) take no input_scale: they quantize per token (SGLang would
            # skip the tensor without a word, so the check refuses it)
            for s in ("weight_scale_2",) if ".mlp.experts." in module else ("weight_scale_2", "input_scale"):
                out[f"{module}.{s}"] = [((), torch.float32), ((1,), torch.float32)]
        return out

    @staticmethod
    def _native(layer) -> bool:
        return False  # the dequantized weight (CPU) or the FP4-weight kernel (CUDA) serve it


class TraceNVFP4OnlineConfig(TracePolicyConfig):
    NAME, FMT = "trace_nvfp4", "nvfp4"

    def linear_method(self, site: str | None = None):
        return TraceNVFP4OnlineLinearMethod(self, site=site)

    def weight_update_alternates(self, spec: dict) -> dict:
        """name -> extra (shape, dtype) a weight update may bring (weight_check.py asks the model's config)."""
        policy, num_layers = self._policy()
        return TraceNVFP4OnlineLinearMethod.update_alternates(spec, policy, num_layers or 1 << 30)


class TraceMXFP4OnlineConfig(TracePolicyConfig):
    """trace_mxfp4 with the policy's targets (the engine's MXFP4 rollout quantizes the same linears):
    W4A4 MXFP4 (OCP blocks of 32) quantized at load time from a BF16 checkpoint."""

    NAME, FMT = "trace_mxfp4", "mxfp4"
