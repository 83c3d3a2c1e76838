"""`trace_fp4` / `trace_mxfp4`: the SGLang quantization configs of TRACE's FP4 linears.

Targets SGLang 0.5.23 (`QuantizationConfig` in python/sglang/srt/layers/quantization/base_config.py;
without SGLang the configs derive from `object`). A config reads the checkpoint's quant config
(ModelOpt `hf_quant_config.json` for NVFP4; none for MXFP4, quantized at load), decides which
linears stay unquantized (`exclude_modules`, all fused shards or none) and hands the others the
linear methods of `quant_method.py`. While the plugin is registered (`set_active`), `trace_fp4`
claims ModelOpt NVFP4 checkpoints unless `modelopt_fp4` was asked for by name.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from megatron_trace.fp4 import mxfp4
from megatron_trace.models.quant_policy import FUSED_MEMBERS

from .layer_tp import sglang_attr
from .moe_method import experts_are_fp4, is_fused_moe
from .quant_method import TraceFP4LinearMethod, TraceMXFP4LinearMethod

try:  # SGLang's base when it is installed; a plain object otherwise (CPU tests, trainer nodes)
    from sglang.srt.layers.quantization.base_config import QuantizationConfig as _ConfigBase
except Exception:  # noqa: BLE001 - a broken SGLang install must not break the import
    _ConfigBase = object

# SGLang's packed_modules_mapping: the fused groups the policy declares (one global scale each)
PACKED_MODULES = {group: list(members) for group, members in FUSED_MEMBERS.items()}
_ACTIVE = {"on": False}  # set by register(): claim `modelopt` NVFP4 checkpoints


def set_active(on: bool = True) -> None:
    _ACTIVE["on"] = bool(on)


def is_modelopt_nvfp4(cfg) -> bool:
    """True for a ModelOpt NVFP4 quant config (config.json's or hf_quant_config.json's)."""
    if not isinstance(cfg, dict):
        return False
    q = cfg.get("quantization", cfg) if isinstance(cfg.get("quantization"), dict) else cfg
    method = str(q.get("quant_method", cfg.get("quant_method", "modelopt"))).lower()
    algo = str(q.get("quant_algo", "")).upper()
    return method in ("modelopt_fp4", "trace_fp4") or (method == "modelopt" and "FP4" in algo)


class TraceFP4Config(_ConfigBase):
    NAME, FMT = "trace_fp4", "nvfp4"

    def __init__(
        self,
        *,
        group_size: int | None = None,
        exclude_modules=(),
        trace_targets=(),
        activation_scale: str = "per_token",
        kv_cache_quant_algo: str | None = None,
        packed_modules_mapping: dict | None = None,
        mx_rule: str = "floor",
    ):
        if _ConfigBase is not object:
            super().__init__()
        block = 16 if self.FMT == "nvfp4" else mxfp4.BLOCK
        group_size = block if group_size is None else group_size
        if group_size != block:
            raise ValueError(f"{self.NAME} needs group_size {block}; the checkpoint says {group_size}")
        self.group_size, self.exclude_modules = group_size, list(exclude_modules or [])
        self.trace_targets, self.activation_scale = list(trace_targets or []), activation_scale
        self.kv_cache_quant_algo, self.mx_rule = kv_cache_quant_algo, mx_rule
        self.packed_modules_mapping = dict(packed_modules_mapping or PACKED_MODULES)

    # -- QuantizationConfig --------------------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return cls.NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the dequantizing fallback runs anywhere; the native FP4 GEMM needs SM100

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["hf_quant_config.json"]

    @classmethod
    def from_config(cls, config: dict) -> TraceFP4Config:
        q = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
        if cls.FMT == "nvfp4" and q.get("quant_algo") is not None and "FP4" not in str(q["quant_algo"]).upper():
            raise ValueError(f"{cls.NAME} loads NVFP4 checkpoints; quant_algo is {q['quant_algo']!r}")
        return cls(
            group_size=int(q.get("group_size", 16 if cls.FMT == "nvfp4" else mxfp4.BLOCK)),
            exclude_modules=q.get("exclude_modules") or q.get("ignore") or [],
            trace_targets=q.get("trace_targets") or [],
            activation_scale=q.get("activation_scale", "per_token"),
            kv_cache_quant_algo=q.get("kv_cache_quant_algo"),
            packed_modules_mapping=config.get("packed_modules_mapping"),
            mx_rule=q.get("mx_rule", "floor"),
        )

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, *_, **__) -> str | None:
        """Claim `modelopt` NVFP4 checkpoints while the plugin is active, unless modelopt_fp4 was asked for."""
        if cls.FMT != "nvfp4" or not is_modelopt_nvfp4(hf_quant_cfg):
            return None
        if user_quant == cls.NAME or (_ACTIVE["on"] and user_quant in (None, "modelopt")):
            return cls.NAME
        return None

    def get_scaled_act_names(self) -> list[str]:
        return []

    def is_layer_excluded(self, prefix: str) -> bool:
        head, _, last = prefix.rpartition(".")
        members = self.packed_modules_mapping.get(last, [last])
        names = [f"{head}.{m}" if head else m for m in members]

        def cands(n):
            return (n, n.removeprefix("language_model."), n.removeprefix("model."))

        hits = [any(fnmatch.fnmatchcase(c, p) for c in cands(n) for p in self.exclude_modules) for n in names]
        if any(hits) and not all(hits):
            raise ValueError(f"{prefix}: fused shards {members} are partly excluded from FP4; quantize all or none")
        return bool(hits) and all(hits)

    def linear_method(self, site: str | None = None):
        return (TraceFP4LinearMethod if self.FMT == "nvfp4" else TraceMXFP4LinearMethod)(self, site=site)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if is_fused_moe(layer):
            return self.experts_method(layer, prefix)
        linear_base = sglang_attr("sglang.srt.layers.linear", "LinearBase")
        if linear_base is not None and not isinstance(layer, linear_base):
            return None  # attention/MoE/embeddings keep SGLang's defaults (the KV path is kv_capture)
        if self.is_layer_excluded(prefix):
            unquant = sglang_attr("sglang.srt.layers.quantization.unquant", "UnquantizedLinearMethod")
            return unquant() if unquant is not None else None
        return self.linear_method(site=prefix)

    def experts_method(self, layer: nn.Module, prefix: str):
        """An exported checkpoint's routed experts: BF16 when exclude_modules leaves them out (SGLang's
        method, None), else refused: no FusedMoE method loads ModelOpt NVFP4 experts here, and SGLang's
        BF16 one would take their packed bytes for weights."""
        if not experts_are_fp4(prefix, layer.num_experts, lambda m: not self.is_layer_excluded(m)):
            return None
        raise NotImplementedError(
            f"{self.NAME}: {prefix} holds ModelOpt NVFP4 routed experts, and the plugin has no FusedMoE method "
            "that loads exported FP4 experts (plugin/moe_method.py quantizes BF16 experts online: serve the BF16 "
            "checkpoint with --quantization nvfp4, or this export with --backend local)"
        )


class TraceMXFP4Config(TraceFP4Config):
    """W4A4 MXFP4 (OCP blocks of 32) quantized at load time from a BF16 checkpoint."""

    NAME, FMT = "trace_mxfp4", "mxfp4"

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []
