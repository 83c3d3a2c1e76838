"""Per-parameter weight loaders: HF names (BF16 or ModelOpt NVFP4 tensors) -> engine parameters.

model.layers.{i}.self_attn.{q,k,v}_proj.*   -> qkv shard q/k/v        (fused, one global scale)
model.layers.{i}.mlp.{gate,up}_proj.*       -> gate_up shard gate/up  (fused, one global scale)
...experts.{e}.{gate,up,down}_proj.*        -> that expert's linears
*.weight (uint8) + weight_scale + weight_scale_2 [+ input_scale]: ModelOpt NVFP4
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_trace.kernels.dispatch import all_finite
from megatron_trace.models.quant_policy import FUSED_MEMBERS

from .layers import EngineLinear
from .model import QwenEngineModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MODELOPT_KINDS = ("weight_scale_2", "weight_scale", "input_scale")
# HF linear -> (the engine layer's attribute, its shard): a fused group (FUSED_MEMBERS) is one
# attribute named like the group, each member a shard of it
_LINEARS = {
    f"{parent}.{leaf}": (group.removesuffix("_proj"), leaf.removesuffix("_proj"))
    for parent, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"))
    for group, leaf in ((fused, m) for m in FUSED_MEMBERS[fused])
} | {"self_attn.o_proj": ("o_proj", "o"), "mlp.down_proj": ("down", "down")}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
_NORMS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate.weight": "router",
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "k_scale", "v_scale")


def _split_kind(rest: str) -> tuple[str, str]:
    for kind in _MODELOPT_KINDS + ("weight", "bias"):
        if rest.endswith("." + kind):
            return rest[: -len(kind) - 1], kind
    return rest, ""


def _linear_target(model: QwenEngineModel, layer: int, module: str) -> tuple[EngineLinear, str] | None:
    blk = model.layers[layer]
    if module in _LINEARS:
        attr, shard = _LINEARS[module]
        return (getattr(blk, attr), shard) if hasattr(blk, attr) else None
    m = _EXPERT.match(module)
    if m and blk.moe:
        e, which = int(m.group(1)), m.group(2)
        if e >= len(blk.experts_down):
            return None
        return (blk.experts_down[e], "down") if which == "down" else (blk.experts_gate_up[e], which)
    return None


def load_tensor(model: QwenEngineModel, name: str, tensor: torch.Tensor, check_only: bool = False):
    """Route one HF-named tensor to its parameter; returns the linear to finalize, if any.
    check_only: raise what loading it would raise (no such parameter, another shape, NaN), write nothing;
    returns (the linear, its shard, the kind) for a linear's tensor."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if name == "model.embed_tokens.weight":
        return _copy(model.embed, tensor, name, check_only)
    if name == "lm_head.weight":
        if model.arch.tie_word_embeddings:
            return None  # tied: the embedding is the head
        return _copy(model.lm_head, tensor, name, check_only)
    if name == "model.norm.weight":
        return _copy(model.final_norm, tensor, name, check_only)
    m = _LAYER.match(name)
    if m and int(m.group(1)) < len(model.layers):
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _NORMS and hasattr(model.layers[layer], _NORMS[rest]):
            return _copy(getattr(model.layers[layer], _NORMS[rest]), tensor, name, check_only)
        module, kind = _split_kind(rest)
        target = _linear_target(model, layer, module)
        if target is not None and kind:
            linear, shard = target
            if kind == "weight" and tensor.dtype == torch.uint8:
                kind = "weight_packed"  # ModelOpt NVFP4: packed codes
            linear.load_shard(shard, tensor, kind, check_only)
            return (linear, shard, kind) if check_only else linear
    raise ValueError(f"checkpoint tensor {name!r} does not belong to a {model.arch.family} model of this shape")


def check_update(model: QwenEngineModel, named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise, naming the first tensor at fault, what loading `named` would raise, before anything is
    written: each tensor has a parameter of its shape and is finite, and a linear given FP4 tensors
    gets every shard's packed weight and scales. The engine's updates are all or nothing this way,
    without keeping a copy of the model to roll back to."""
    fp4: dict[int, tuple[EngineLinear, dict[str, set[str]]]] = {}
    for name, t in named:
        if not all_finite(t):
            raise ValueError(f"{name} holds NaN or Inf")
        hit = load_tensor(model, name, t, check_only=True)
        if isinstance(hit, tuple) and hit[2] not in ("weight", "bias"):
            linear, shard, kind = hit
            fp4.setdefault(id(linear), (linear, {}))[1].setdefault(shard, set()).add(kind)
    for linear, shards in fp4.values():
        if linear.weight_fmt is None:
            raise ValueError(f"{linear.site}: the update holds FP4 tensors but the policy keeps it BF16")
        for shard in linear.shards:
            kinds = shards.get(shard, set())
            if not {"weight_packed", "weight_scale", "weight_scale_2"} <= kinds:
                raise ValueError(
                    f"{linear.site}:{shard} needs weight, weight_scale and weight_scale_2; got {sorted(kinds)}"
                )


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor, name: str, check_only: bool = False) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    if not all_finite(tensor):
        raise ValueError(f"{name}: checkpoint tensor holds NaN or Inf")
    if check_only:
        return None
    with torch.no_grad():  # in place on the parameter itself: bumps its version, which caches key on
        param.copy_(tensor.to(param.dtype))
    return None


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_checkpoint(model: QwenEngineModel, path: str | Path) -> int:
    """Load every tensor of an HF checkpoint directory; returns how many were loaded."""
    touched: dict[int, EngineLinear] = {}
    seen = set()
    for f in checkpoint_files(path):
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:
            raise ValueError(f"cannot read safetensors file {f}: {e}") from None
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ValueError(
                        f"{f}: tensor {name!r} is unreadable ({e}); the file is corrupt or truncated"
                    ) from None
                linear = load_tensor(model, name, tensor)
                if linear is not None:
                    touched[id(linear)] = linear
                seen.add(name)
    _check_complete(model, seen)
    for linear in touched.values():
        linear.finalize()
    return len(seen)


def _check_complete(model: QwenEngineModel, seen: set[str]) -> None:
    expected = model.arch.hf_param_shapes()
    have = {n.removesuffix(".weight_scale").removesuffix(".weight_scale_2") for n in seen}
    missing = [n for n in expected if n not in have and not n.endswith("inv_freq")]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
