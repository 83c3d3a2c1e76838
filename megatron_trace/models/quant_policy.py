"""Which linears, activations and KV-cache entries run in FP4, decided over HF module names.

The rollout engine, the trainer's QAT and the checkpoint exporter all ask this one object, so
"is this module FP4?" has a single answer in the whole system.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, fields
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, ClassVar

from megatron_trace.fields import Section, opt
from megatron_trace.kernels import kv_codec

if TYPE_CHECKING:
    from .arch import ModelArch

FORMATS = ("nvfp4", "mxfp4", "bf16")
PRECISIONS = ("fp4", "bf16")
KV_FORMATS = kv_codec.FORMATS
# `kv` is the shorthand for both K and V; "auto" picks per model family (`QuantPolicy.resolve`).
KV_SHORTHANDS = ("auto", *KV_FORMATS)
# kv_k / kv_v: "" follows `kv`; a format overrides that side.
KV_SIDE_FORMATS = ("", *KV_FORMATS)
ACTIVATION_SCALES = ("per_token", "static")


def kv_side_bits(fmt: str, row: int, bf16_bits: float = 16.0) -> float:
    """Stored bits per K or V element in a cache format, scales included: FP8 E4M3 carries one fp32
    scale per token over its `row` elements (KV heads x head_dim of one rank), NVFP4/MXFP4 one 8-bit
    scale per 16; "bf16" is the unquantized cache, `bf16_bits` wide (32 where the model runs fp32)."""
    bits = {"bf16": bf16_bits, "fp8": 8 + 32 / row, "nvfp4": 4 + 8 / 16, "mxfp4": 4 + 8 / 16}
    if fmt not in bits:
        raise ValueError(f"KV format must be one of {', '.join(KV_FORMATS)}; got {fmt!r}")
    return bits[fmt]


# Attention projections are opt-in (e.g. "*.self_attn.*_proj"): FP4 attention costs the most accuracy.
DEFAULT_TARGETS = ("*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj", "*.mlp.experts.*")

# Only these leaves are GEMMs FP4 can replace; the MoE router is `mlp.gate` and is deliberately absent.
_LINEAR_LEAVES = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# Modules the rollout engines (ours, SGLang's packed_modules_mapping) fuse into one GEMM with one global
# (per-tensor) scale, in their shard order. The one declaration of these groups.
FUSED_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED = {leaf: group for group, leaves in FUSED_MEMBERS.items() for leaf in leaves}

# The policy's fields are `opt` fields of the config tree (megatron_trace/fields.py): the `quant`
# section is generated from them (megatron_trace/config.py), and the tree's one validator checks them.
_field = opt


def _module_name(name: str) -> str:
    # Callers often hold parameter names; the decision is per module.
    for suffix in (".weight", ".bias"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _layer_index(module: str) -> int | None:
    m = _LAYER_RE.match(module)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class QuantPolicy(Section):
    """Which linears, activations and KV-cache entries run in FP4.

    As written (a config's `quant` keys) it may say kv="auto"; `resolve(arch)` turns it into the
    policy that runs, once per run, after the checkpoint's architecture is known. Everything that
    quantizes (engine, trainer QAT, weight sync, exporter, gate, memory model) takes a resolved one and
    refuses "auto" (`check_resolved`): nothing downstream derives a default of its own."""

    SECTION: ClassVar[str] = "quant"

    format: str = _field("nvfp4", "FP4 format of the rollout", FORMATS)
    weights: str = _field("fp4", "weight precision of targeted linears", PRECISIONS)
    activations: str = _field("fp4", "activation precision (fp4 = W4A4, bf16 = W4A16)", PRECISIONS)
    kv: str = _field(
        "auto",
        "KV cache format of K and V (auto: de-biased FP8 K + NVFP4 V without q/k norm, i.e. Qwen2/2.5; "
        "NVFP4 K and V with it, i.e. Qwen3)",
        KV_SHORTHANDS,
    )
    kv_k: str = _field("", "K cache format; empty follows kv", KV_SIDE_FORMATS)
    kv_v: str = _field("", "V cache format; empty follows kv", KV_SIDE_FORMATS)
    targets: tuple[str, ...] = _field(DEFAULT_TARGETS, "module patterns that are FP4")
    bf16_layers_start: int = _field(0, "first N layers stay BF16", low=0)
    bf16_layers_end: int = _field(0, "last N layers stay BF16", low=0)
    activation_scale: str = _field(
        "per_token",
        "activation global scale (static: calibrated at start, synced with the weights)",
        ACTIVATION_SCALES,
    )
    # The K cache stores K minus its rotated k_proj bias (models/rope.py), 4.5 bits for NVFP4 K that
    # keep a Qwen2.5's outlier channels out of the blocks: Qwen2/2.5 only (they have the bias).
    kv_k_debias: bool = _field(
        False,
        "K cache holds K minus its rotated k_proj bias (Qwen2/2.5: K without its outlier channels; kv=auto sets it)",
    )

    def check(self) -> None:
        """Cross-field rules (each field's type and allowed values are checked by its declaration)."""
        if self.activations == "fp4" and self.weights == "bf16":
            raise ValueError(
                "quant.activations='fp4' requires quant.weights='fp4' (supported: W4A4, W4A16, or all bf16)"
            )
        for pattern in self.targets:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"quant.targets must hold non-empty strings; got {pattern!r}")

    # ----------------------------------------------------------------- serialization
    @classmethod
    def from_dict(cls, d: dict | None) -> QuantPolicy:
        """Build from a config mapping (e.g. the `quant:` YAML section); unknown keys are errors."""
        d = dict(d or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"unknown quant key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return cls(**d)

    def to_dict(self) -> dict:
        """Plain JSON/YAML-friendly dict; `from_dict(to_dict())` is the identity."""
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    def replace(self, **changes) -> QuantPolicy:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- decisions
    @property
    def enabled(self) -> bool:
        """Whether any linear can be FP4 at all."""
        return self.format != "bf16" and self.weights == "fp4"

    def _layer_in_bf16_band(self, layer: int, num_layers: int) -> bool:
        return layer < self.bf16_layers_start or layer >= num_layers - self.bf16_layers_end

    def linear_is_fp4(self, hf_module_name: str, num_layers: int) -> bool:
        """Whether the HF linear `hf_module_name` runs as an FP4 GEMM (weights FP4; activations per policy).

        Embeddings, norms, the MoE router (`mlp.gate`) and `lm_head` are never FP4, whatever
        the targets say.
        """
        if not self.enabled:
            return False
        module = _module_name(hf_module_name)
        if module.rsplit(".", 1)[-1] not in _LINEAR_LEAVES:
            return False
        layer = _layer_index(module)
        if layer is None or self._layer_in_bf16_band(layer, num_layers):
            return False
        return any(fnmatchcase(module, pattern) for pattern in self.targets)

    def weight_is_fp4(self, hf_module_name: str, num_layers: int) -> bool:
        """Whether the weight of this linear is stored/quantized as FP4."""
        return self.linear_is_fp4(hf_module_name, num_layers) and self.weights == "fp4"

    def activation_is_fp4(self, hf_module_name: str, num_layers: int) -> bool:
        """Whether the input activation of this linear is quantized to FP4 (W4A4)."""
        return self.linear_is_fp4(hf_module_name, num_layers) and self.activations == "fp4"

    # ----------------------------------------------------------------- KV cache
    # How kv, kv_k and kv_v combine: kv_k (kv_v) when set, otherwise kv. kv="auto" resolves per
    # model family in resolve(): families whose K has no per-head RMSNorm (Qwen2/2.5: q/k/v
    # biases, outlier channels in K up to ~200 on a real checkpoint) get de-biased FP8 K + NVFP4 V
    # (FP8 K with its bias in loses 6x more in bf16: docs/quality.md); families with q/k norm
    # (Qwen3, Qwen3-MoE) NVFP4 K and V. An explicit kv_k / kv_v still wins over auto, and an
    # explicit kv_k keeps kv_k_debias as set.
    def resolve(self, arch: ModelArch) -> QuantPolicy:
        """The policy as it runs on `arch`: kv="auto" made this family's K and V formats (kv_k and
        kv_v explicit, kv = V's; K de-biased where the family has a k_proj bias), then checked
        against the architecture (`check_resolved`). The one place a quantization default depends on
        the model; a resolved policy resolves to itself."""
        p = self
        if self.kv == "auto":
            k, v = auto_kv_formats(arch)
            debias = self.kv_k_debias or (not self.kv_k and arch.qkv_bias and k != "bf16")
            k, v = self.kv_k or k, self.kv_v or v
            p = self.replace(kv=v, kv_k=k, kv_v=v, kv_k_debias=debias)
        p.check_resolved(arch)
        return p

    def check_resolved(self, arch: ModelArch) -> None:
        """Refuse a policy that was not resolved (kv="auto") or does not fit `arch`: what every part
        that quantizes asks of the policy it is handed."""
        if self.kv == "auto":
            raise ValueError(
                "quant.kv='auto' reached a part that quantizes unresolved: the run resolves its policy once, "
                "after the checkpoint is known (QuantPolicy.resolve(arch)), and hands that object on"
            )
        if self.kv_k_debias and not arch.qkv_bias:
            raise ValueError(
                f"quant.kv_k_debias subtracts K's rotated k_proj bias, but {arch.family} has no q/k/v "
                "bias (Qwen2/2.5 have one); set quant.kv_k_debias=false"
            )
        self.quantized_linears(arch)  # targets cover whole fused groups

    def _side(self, which: str) -> str:
        if which not in ("k", "v"):
            raise ValueError(f"KV side must be 'k' or 'v'; got {which!r}")
        fmt = self.kv_k if which == "k" else self.kv_v
        fmt = fmt or self.kv
        if fmt == "auto":
            raise ValueError(
                f"quant.kv='auto' picks quant.kv_{which} per model family: resolve the policy first "
                "(QuantPolicy.resolve(arch))"
            )
        return fmt

    @property
    def k_format(self) -> str:
        """K cache format (one of KV_FORMATS): kv_k, or kv when kv_k is unset."""
        return self._side("k")

    @property
    def v_format(self) -> str:
        """V cache format (one of KV_FORMATS): kv_v, or kv when kv_v is unset."""
        return self._side("v")

    def kv_format(self, layer: int, num_layers: int, which: str) -> str:
        """Format of layer `layer`'s K (which="k") or V cache; the BF16 first/last layers keep BF16.

        Independent of `format`, so a KV-only experiment (format bf16, kv nvfp4) is expressible.
        """
        if not 0 <= layer < num_layers:
            raise IndexError(f"layer {layer} out of range for {num_layers} layers")
        return "bf16" if self._layer_in_bf16_band(layer, num_layers) else self._side(which)

    def kv_cache_quant_algo(self) -> str | None:
        """ModelOpt's `kv_cache_quant_algo` for an export: None (BF16), "FP8", "NVFP4" or "MXFP4".
        ModelOpt names one format for K and V; for a mix (FP8 K + NVFP4 V) it names the finer side,
        so a stock engine never caches K or V more coarsely than this policy (V then costs FP8 bytes).
        A de-biased FP4 K counts as FP8: a stock engine would quantize K with its bias in, which loses
        what the de-biasing keeps."""
        sides = {self.k_format, self.v_format}
        if self.kv_k_debias and self.k_format != "bf16":
            sides = {"fp8" if self.k_format in ("nvfp4", "mxfp4") else self.k_format, self.v_format}
        for fmt, algo in (("bf16", None), ("fp8", "FP8"), ("nvfp4", "NVFP4"), ("mxfp4", "MXFP4")):
            if fmt in sides:
                return algo
        raise AssertionError(sides)  # unreachable: both sides are validated KV_FORMATS

    def kv_is_fp4(self, layer: int, num_layers: int) -> bool:
        """Whether layer `layer`'s K or V cache is quantized at all (FP4 or FP8)."""
        return any(self.kv_format(layer, num_layers, w) != "bf16" for w in ("k", "v"))

    def guided_site_kinds(self) -> list[str]:
        """What TRACE guidance can record under this (resolved) policy: "activations" (NVFP4/MXFP4
        inputs of the FP4 linears), "K", "V" (any quantized cache side, FP4 or FP8). Empty: nothing is
        quantized where a record could pin it, so guided QAT would be plain QAT."""
        kinds = ["activations"] if self.format in ("nvfp4", "mxfp4") and self.activations == "fp4" else []
        return kinds + [side for side, fmt in (("K", self.k_format), ("V", self.v_format)) if fmt != "bf16"]

    def quantized_linears(self, arch: ModelArch) -> list[str]:
        """HF module names of every FP4 linear of `arch`, in parameter order."""
        names = [m for m in arch.hf_linear_modules() if self.linear_is_fp4(m, arch.num_layers)]
        self._check_fused_groups(names)
        return names

    def fused_groups(self, arch: ModelArch) -> dict[str, str]:
        """Map each FP4 module to its fusion group, the unit that shares one global scale.

        q/k/v of a layer -> `...self_attn.qkv_proj`; gate/up of a dense MLP or of one expert
        -> `...gate_up_proj`; any other module is its own group. Raises if targets quantize only
        part of a group, since the rollout engine runs the group as one GEMM.
        """
        return {m: fused_group_of(m) for m in self.quantized_linears(arch)}

    def _check_fused_groups(self, names: list[str]) -> None:
        chosen = set(names)
        members: dict[str, list[str]] = {}
        for m in names:
            parent, leaf = m.rsplit(".", 1)
            if leaf in _FUSED:
                members.setdefault(fused_group_of(m), fused_members(fused_group_of(m)))
        for group, expected in members.items():
            missing = [m for m in expected if m not in chosen]
            if missing:
                raise ValueError(
                    f"quant.targets quantize only part of fused group {group}: {', '.join(missing)} "
                    "stay bf16; the rollout engine runs the group as one GEMM, so target all or none"
                )


def fused_group_of(module: str) -> str:
    """The fused GEMM a linear runs in (…qkv_proj / …gate_up_proj), or the module itself."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED[leaf]}" if leaf in _FUSED else module


def fused_members(group: str) -> list[str]:
    """The linears of a fused GEMM in the engine's shard order ([group] for an unfused module)."""
    parent, _, leaf = group.rpartition(".")
    return [f"{parent}.{x}" for x in FUSED_MEMBERS[leaf]] if leaf in FUSED_MEMBERS else [group]


def auto_kv_formats(arch: ModelArch) -> tuple[str, str]:
    """(K, V) cache formats kv="auto" picks for `arch` (resolve also de-biases K where it has a
    k_proj bias). Without per-head q/k RMSNorm (Qwen2/2.5) K carries outlier channels and NVFP4 K
    damages a real checkpoint (BENCHMARKS.md, Qwen2.5-Coder-0.5B: NVFP4 K +0.26 nats/token, FP8 K
    +0.003 in fp32), FP8 K does not; V is benign (+0.001). In bf16 FP8 K needs the bias out (W4A4:
    +0.126 biased on 16 GSM8K-style problems at 200 tokens; +0.022 de-biased on 16 word problems at
    256 tokens, where de-biased NVFP4 K costs +0.035 and its layer-0 MLP input agrees with the
    trainer on 99.7%, below the 99.9% the probe asks). Qwen3's choice is
    not measured on a real checkpoint here (docs/quality.md)."""
    return ("nvfp4", "nvfp4") if arch.qk_norm else ("fp8", "nvfp4")
