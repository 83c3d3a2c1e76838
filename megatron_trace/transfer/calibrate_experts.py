"""Static activation amax of routed experts (Qwen3-MoE), from transformers' fp32 forward.

transformers 5 runs a layer's routed experts as one module (`mlp.experts`, weights fused as
gate_up_proj [E, 2I, H] and down_proj [E, H, I]), so there is no per-expert linear to hook. A
forward pre-hook on that module reads what HF's own router (`mlp.gate`: softmax over the router
logits, top-k; norm_topk_prob only rescales the weights, never the choice) hands it:
`hidden_states`, the post-attention-normed hidden state of every token, and `top_k_index`. From
those it recomputes, per expert e, the inputs of e's two linears exactly as HF's eager experts
forward forms them:

    gate_up input of e = hidden_states of the tokens routed to e (any of their top-k slots)
    down input of e    = act(gate) * up of those tokens, from e's slice of the fused gate_up weight

The routing weight scales the down output, not an input, so neither amax contains it (the
engine and the trainer's QAT quantize the unweighted rows too). gate and up read the same input:
one amax, and the fused shards share one input_scale per expert.

An expert that no calibration token reaches has no amax to give its input_scale; calibration
refuses, naming the layer and experts (more or other calibration prompts reach them). A made-up
scale (the layer's max, say) would quantize that expert's first real tokens with a scale nobody
measured.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

_EXPERT_MODULE_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_EXPERT_PARAM_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_expert_module(name: str) -> bool:
    """model.layers.L.mlp.experts.E.{gate,up,down}_proj: a routed expert's linear."""
    return _EXPERT_MODULE_RE.match(name) is not None


def fuse_hf_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> transformers-5 in-memory experts (`experts.gate_up_proj`
    [E, 2I, H] = gate rows then up rows, `experts.down_proj` [E, H, I]); the inverse of
    `models.unfuse_hf_experts`. Other entries pass through. Raises when an expert is missing."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _EXPERT_PARAM_RE.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, by_id in experts.items():
        n = max(by_id) + 1
        gaps = [
            f"{prefix}.{e}.{k}"
            for e in range(n)
            for k in ("gate_proj", "up_proj", "down_proj")
            if k not in by_id.get(e, {})
        ]
        if gaps:
            raise ValueError(f"checkpoint experts are incomplete: no weight for {gaps[:4]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_id[e]["gate_proj"], by_id[e]["up_proj"]]) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_id[e]["down_proj"] for e in range(n)])
    return out


class ExpertInputAmax:
    """Forward pre-hooks on the `mlp.experts` modules of the layers whose expert linears are asked
    for; `result()` gives {expert module: max |input|} after the forward passes."""

    def __init__(self, model: torch.nn.Module, modules: Sequence[str]):
        self.modules = list(modules)
        self.layers: dict[str, int] = {}  # experts module -> its number of experts
        for name in self.modules:
            m = _EXPERT_MODULE_RE.match(name)
            if m is None:
                raise ValueError(f"{name} is not a routed expert's linear (model.layers.L.mlp.experts.E.*_proj)")
            self.layers[m.group(1)] = 0
        self.amax: dict[str, torch.Tensor] = {}  # "<experts module>.<e>.<gate_up|down>" -> amax
        self.tokens: dict[str, torch.Tensor] = {}  # experts module -> [E] tokens routed to each
        self._hooks = []
        for prefix in self.layers:
            mod = model.get_submodule(prefix)
            if not (hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and hasattr(mod, "act_fn")):
                raise ValueError(
                    f"{prefix} ({type(mod).__name__}) is not transformers' fused experts module "
                    "(gate_up_proj, down_proj, act_fn): cannot recompute its experts' inputs"
                )
            self.layers[prefix] = mod.gate_up_proj.shape[0]
            self.tokens[prefix] = torch.zeros(mod.gate_up_proj.shape[0], dtype=torch.long)
            self._hooks.append(mod.register_forward_pre_hook(self._hook(prefix), with_kwargs=True))

    def _hook(self, prefix: str):
        def pre(mod, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self._record(prefix, mod, hidden.detach().float(), top_k_index)

        return pre

    @torch.no_grad()
    def _record(self, prefix: str, mod, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        for e in range(self.layers[prefix]):
            routed = (top_k_index == e).any(dim=-1)
            n = int(routed.sum())
            if n == 0:
                continue
            self.tokens[prefix][e] += n
            x = hidden[routed]
            gate, up = F.linear(x, mod.gate_up_proj[e].float()).chunk(2, dim=-1)
            h = mod.act_fn(gate) * up
            for kind, t in (("gate_up", x), ("down", h)):
                key = f"{prefix}.{e}.{kind}"
                v = torch.nan_to_num(t.abs(), nan=0.0).amax()
                self.amax[key] = torch.maximum(self.amax[key], v) if key in self.amax else v

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def result(self) -> dict[str, float]:
        """{expert module: amax}; raises naming the experts no calibration token was routed to."""
        unreached = {p: [e for e in range(n) if int(self.tokens[p][e]) == 0] for p, n in self.layers.items()}
        unreached = {p: es for p, es in unreached.items() if es}
        if unreached:
            where = "; ".join(f"{p}: experts {es}" for p, es in unreached.items())
            raise ValueError(
                f"static activation calibration routed no token to {sum(map(len, unreached.values()))} "
                f"expert(s) ({where}), so their input_scale has nothing to be calibrated from; use more or "
                "other calibration prompts (quant.calib_prompts in a run, --calib-prompts for an export)"
            )
        out = {}
        for name in self.modules:
            prefix, _, e, leaf = _EXPERT_MODULE_RE.match(name).groups()
            kind = "down" if leaf == "down_proj" else "gate_up"
            out[name] = float(self.amax.get(f"{prefix}.{e}.{kind}", torch.zeros(())))
        return out
