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

An expert that no calibration token reaches (dead on the calibration distribution: 16 training
prompts reach neither of two experts of the warm-started tiny MoE, 4 reach neither) is calibrated as if every
calibration token of its layer had been routed to it: a second pass over the same prompts
records its gate_up input (the layer's whole MoE input: its amax is the layer's max over the
other experts' gate_up amax) and its own act(gate) * up of those tokens for down. Measured with
its own weights and an upper bound of any routed subset of those tokens; `calibrate_input_amax`
logs a WARNING naming those experts.
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
    for. Pass 1 (the calibration forwards) records each expert's routed tokens; when it leaves
    experts without a token, `begin_unrouted_pass()` and the same forwards again record those
    experts on every token of their layer. `result()`: {expert module: max |input|}."""

    def __init__(self, model: torch.nn.Module, modules: Sequence[str]):
        self.modules = list(modules)
        self.wanted: dict[str, set[int]] = {}  # experts module -> the expert ids asked for
        for name in self.modules:
            m = _EXPERT_MODULE_RE.match(name)
            if m is None:
                raise ValueError(f"{name} is not a routed expert's linear (model.layers.L.mlp.experts.E.*_proj)")
            self.wanted.setdefault(m.group(1), set()).add(int(m.group(3)))
        self.amax: dict[str, torch.Tensor] = {}  # "<experts module>.<e>.<gate_up|down>" -> amax
        self.tokens: dict[str, torch.Tensor] = {}  # experts module -> [E] tokens routed to each
        self.unrouted: dict[str, list[int]] | None = None  # pass 2: experts recorded on every token
        self._hooks = []
        for prefix in self.wanted:
            mod = model.get_submodule(prefix)
            if not (hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and hasattr(mod, "act_fn")):
                raise ValueError(
                    f"{prefix} ({type(mod).__name__}) is not transformers' fused experts module "
                    "(gate_up_proj, down_proj, act_fn): cannot recompute its experts' inputs"
                )
            self.tokens[prefix] = torch.zeros(mod.gate_up_proj.shape[0], dtype=torch.long)
            self._hooks.append(mod.register_forward_pre_hook(self._hook(prefix), with_kwargs=True))

    def _hook(self, prefix: str):
        def pre(mod, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            hidden = hidden.detach().float().reshape(-1, hidden.shape[-1])
            if self.unrouted is None:
                for e in sorted(self.wanted[prefix]):
                    routed = (top_k_index == e).any(dim=-1)
                    self.tokens[prefix][e] += int(routed.sum())
                    if routed.any():
                        self._record(f"{prefix}.{e}", mod.gate_up_proj[e], mod.act_fn, hidden[routed])
            else:
                for e in self.unrouted.get(prefix, ()):
                    self._record(f"{prefix}.{e}", mod.gate_up_proj[e], mod.act_fn, hidden)

        return pre

    @torch.no_grad()
    def _record(self, expert: str, gate_up: torch.Tensor, act_fn, x: torch.Tensor) -> None:
        """Expert `expert`'s gate_up input x and down input act(gate) * up, into the running maxima."""
        gate, up = F.linear(x, gate_up.float()).chunk(2, dim=-1)
        for kind, t in (("gate_up", x), ("down", act_fn(gate) * up)):
            key = f"{expert}.{kind}"
            v = torch.nan_to_num(t.abs(), nan=0.0).amax()
            self.amax[key] = torch.maximum(self.amax[key], v) if key in self.amax else v

    def unreached(self) -> dict[str, list[int]]:
        """{experts module: expert ids asked for that no calibration token was routed to}."""
        out = {p: [e for e in sorted(es) if int(self.tokens[p][e]) == 0] for p, es in self.wanted.items()}
        return {p: es for p, es in out.items() if es}

    def begin_unrouted_pass(self) -> dict[str, list[int]]:
        """Switch the hooks to pass 2 (the unreached experts on all tokens); returns those experts."""
        self.unrouted = self.unreached()
        return self.unrouted

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def result(self) -> dict[str, float]:
        """{expert module: amax} of every module asked for; raises when an expert has none (no
        token reached it and the unrouted pass was not run)."""
        out = {}
        for name in self.modules:
            prefix, _, e, leaf = _EXPERT_MODULE_RE.match(name).groups()
            key = f"{prefix}.{e}.{'down' if leaf == 'down_proj' else 'gate_up'}"
            if key not in self.amax:
                raise ValueError(f"no calibration token was routed to {prefix}.{e} and it was not recorded unrouted")
            out[name] = float(self.amax[key])
        return out
