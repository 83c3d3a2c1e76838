"""HF-named trainer tensors -> rollout tensors, per the QuantPolicy.

    units = quantize_units(group_units(iter_hf_params(chunks, arch)), arch, policy, input_amax=amax)

A *unit* is the list of tensors that must travel together: one fused group (q/k/v of a layer,
gate/up of a dense MLP or of one expert) or one module (its weight and bias). FP4 linears
become the ModelOpt NVFP4 tensors (`weight` uint8 [N, K/2], `weight_scale` E4M3 [N, K/16],
`weight_scale_2` fp32, `input_scale` fp32 for static activation scales); fused shards share one
global amax (`to_modelopt_fused`), because the rollout runs the group as one GEMM with one scale
and loaders take the max of the shards' scales. Everything else keeps the model dtype (or
`dtype`). The fp4/ code used here is the same the trainer's QAT and the engine use, so rollout
weights are bit-identical to quantizing the exported HF checkpoint.

MXFP4 policies send the weights unquantized (the model dtype): ModelOpt has no MXFP4 layout
and the engine quantizes MXFP4 from high-precision weights itself, with the same fp4/ code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from ..fp4.modelopt import to_modelopt_fused
from ..kernels.dispatch import all_finite, nvfp4_weight_quantize
from ..models import ModelArch, QuantPolicy
from ..models.quant_policy import fused_group_of, fused_members

Unit = list[tuple[str, torch.Tensor]]

MODELOPT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class NonFiniteWeightError(ValueError):
    """A tensor holds NaN or Inf; raised before anything of that version is sent."""

    def __init__(self, name: str):
        super().__init__(f"refusing to send {name!r}: it holds NaN or Inf (nothing of this version was committed)")
        self.param = name


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise NonFiniteWeightError naming `name` if a floating tensor holds NaN/Inf (meta: skipped)."""
    if not all_finite(t):
        raise NonFiniteWeightError(name)


def module_of(name: str) -> tuple[str, str]:
    """('model.layers.0.mlp.gate_proj', 'weight') from a parameter name."""
    module, _, kind = name.rpartition(".")
    return module, kind


def group_key(name: str) -> str:
    """The fused group (…qkv_proj / …gate_up_proj) or the module a parameter belongs to."""
    return fused_group_of(module_of(name)[0])


def group_units(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Unit]:
    """Group consecutive tensors of one fused group / module. The gather yields q/k/v (and
    gate/up) from one Megatron parameter, so a group's members are always consecutive."""
    unit: Unit = []
    key = None
    for name, t in stream:
        k = group_key(name)
        if unit and k != key:
            yield unit
            unit = []
        key = k
        unit.append((name, t))
    if unit:
        yield unit


def _amax_for(modules: list[str], group: str, input_amax: Mapping[str, float] | None) -> torch.Tensor:
    """One activation amax for a fused group: the max over its members (loaders take the max too)."""
    if input_amax is None:
        raise KeyError(
            "the policy uses static activation scales (activation_scale='static') but no "
            "calibrated input_amax was passed to the transfer"
        )
    vals = [input_amax[m] for m in modules if m in input_amax]
    if not vals and group in input_amax:
        vals = [input_amax[group]]
    if not vals:
        raise KeyError(
            f"no calibrated input amax for {group} (modules {modules}); static activation "
            "scales need one per FP4 linear"
        )
    return torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in vals]).amax()


def _modelopt_shapes(w: torch.Tensor, with_input: bool) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if k % 16:
        raise ValueError(f"NVFP4 needs in_features divisible by 16; got {k}")
    out = {
        "weight": torch.empty(n, k // 2, dtype=torch.uint8, device="meta"),
        "weight_scale": torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device="meta"),
        "weight_scale_2": torch.empty((), dtype=torch.float32, device="meta"),
    }
    if with_input:
        out["input_scale"] = torch.empty((), dtype=torch.float32, device="meta")
    return out


def quantize_unit(
    unit: Unit,
    arch: ModelArch,
    policy: QuantPolicy,
    *,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype | None = None,
) -> Unit:
    """One unit's rollout tensors (meta tensors in, meta tensors out: the shapes/dtypes only)."""
    for name, t in unit:
        check_finite(name, t)  # before quantizing: FP4 codes cannot show a NaN any more
    weights = {module_of(n)[0]: t for n, t in unit if module_of(n)[1] == "weight"}
    fp4 = [m for m in weights if policy.format == "nvfp4" and policy.weight_is_fp4(m, arch.num_layers)]
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    if fp4:
        group = group_key(fp4[0] + ".weight")
        members = fused_members(group)
        missing = [m for m in members if m not in fp4]
        if missing:  # the policy refuses partial groups; this catches an out-of-order stream
            raise ValueError(f"fused group {group} arrived without {missing}: cannot share one global scale")
        static = policy.activation_scale == "static" and policy.activation_is_fp4(members[0], arch.num_layers)
        amax = _amax_for(members, group, input_amax) if static else None
        ws = [weights[m] for m in members]
        if ws[0].device.type == "meta":
            outs = [_modelopt_shapes(w, static) for w in ws]
        else:
            outs = to_modelopt_fused(ws, input_amax=amax, quantizer=nvfp4_weight_quantize)
        quantized = dict(zip(members, outs))
    result: Unit = []
    for name, t in unit:
        module, kind = module_of(name)
        if kind == "weight" and module in quantized:
            result += [(f"{module}.{k}", v) for k, v in quantized[module].items()]
        else:
            result.append((name, t.to(dtype) if dtype is not None and t.is_floating_point() else t))
    return result


def quantize_units(
    units: Iterable[Unit],
    arch: ModelArch,
    policy: QuantPolicy,
    *,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[Unit]:
    """Streaming `quantize_unit` over units (one unit alive at a time)."""
    for unit in units:
        yield quantize_unit(unit, arch, policy, input_amax=input_amax, dtype=dtype)


def rollout_tensors(
    stream: Iterable[tuple[str, torch.Tensor]],
    arch: ModelArch,
    policy: QuantPolicy,
    *,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[Unit]:
    """HF (name, tensor) stream -> units of rollout tensors."""
    return quantize_units(group_units(stream), arch, policy, input_amax=input_amax, dtype=dtype)


def manifest(
    hf_shapes: Iterable[tuple[str, tuple[int, ...]]],
    arch: ModelArch,
    policy: QuantPolicy,
    *,
    model_dtype: torch.dtype,
    static: bool | None = None,
    dtype: torch.dtype | None = None,
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every rollout tensor, in send order, without any data: the
    distributed transport must announce all names/dtypes/shapes before the first broadcast."""
    meta = ((n, torch.empty(s, dtype=model_dtype, device="meta")) for n, s in hf_shapes)
    amax = _AnyAmax() if (static if static is not None else policy.activation_scale == "static") else None
    out = []
    for unit in rollout_tensors(meta, arch, policy, input_amax=amax, dtype=dtype):
        out += [(n, t.dtype, tuple(t.shape)) for n, t in unit]
    return out


class _AnyAmax(dict):
    """Stand-in amax table for shape planning: every module 'has' an amax."""

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key):
        return 1.0
