"""De-biased K inside SGLang's KV pool (quant.kv_k_debias), with the embedded engine's bits.

Qwen2/2.5's k_proj bias b, turned by RoPE with the position, is what puts K's outlier channels
there; the cache stores K - RoPE_pos(b) and adds RoPE_pos(b) back at read (megatron_trace/models/rope.py,
the one function both stacks and the trainer use). SGLang's pool knows each token's KV slot but
not its position, so the per-side method (kv_sides.py) keeps one position per slot:

    ModelRunner.forward (AROUND hook) ── forward_batch.positions ──► current_positions()
    qkv_proj (held_out_k_bias):        x W + b with b's K rows zero, so K = RoPE(x W_k) in the read dtype
    quantize_and_store(loc, cache_k):  slot_pos[loc] = positions;  RoPE(x W_k) ─► quantized
    dequantize_kv_tensor(K, layer):    dequantized K (read dtype) + RoPE_slot_pos(b_layer) in fp32 ─► read dtype

Leaving b out of the projection, rather than adding it in bf16 and taking it away again, keeps bf16's
rounding of the large biased K out of the small remainder the cache resolves (the engine's
EngineLinear.bias_held_out). The biases are read from each attention's live `qkv_proj.bias` at every
use (a weight update loads into it), found on the runner's model at its first forward. A layout this
does not know (no bias, a rotary that is not the plain neox form over the whole head) is refused by name.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from megatron_trace.models.rope import rotary_tables, rotate_bias

_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("trace_kv_positions", default=None)


@dataclass
class LayerKBias:
    """Where one attention layer's K bias lives (this TP rank's KV heads) and its RoPE base."""

    attention: torch.nn.Module
    theta: float

    def bias(self) -> torch.Tensor:
        a = self.attention
        return a.qkv_proj.bias[a.q_size : a.q_size + a.kv_size].view(a.num_kv_heads, a.head_dim)


def k_biases_of(model: torch.nn.Module) -> dict[int, LayerKBias]:
    """{KV-pool layer id: LayerKBias} of every attention in `model` (SGLang's Qwen2-style attention:
    qkv_proj with a bias, rotary_emb, attn.layer_id)."""
    out = {}
    for name, m in model.named_modules():
        attn, qkv = getattr(m, "attn", None), getattr(m, "qkv_proj", None)
        if qkv is None or not hasattr(attn, "layer_id"):
            continue
        if getattr(qkv, "bias", None) is None:
            raise ValueError(f"quant.kv_k_debias subtracts K's rotated k_proj bias, but {name}.qkv_proj has none")
        rot = getattr(m, "rotary_emb", None)
        plain = type(rot).__name__ == "RotaryEmbedding" and getattr(rot, "is_neox_style", False)
        if not plain or rot.rotary_dim != m.head_dim:
            raise ValueError(
                f"quant.kv_k_debias: {name}.rotary_emb is {type(rot).__name__} (neox "
                f"{getattr(rot, 'is_neox_style', None)}, rotary_dim {getattr(rot, 'rotary_dim', None)} of "
                f"{m.head_dim}); the de-biased cache knows the plain neox RoPE over the whole head only"
            )
        hold_out_k_bias(m)
        out[int(attn.layer_id)] = LayerKBias(m, float(rot.base))
    if not out:
        raise ValueError("quant.kv_k_debias: the served model has no attention with a qkv_proj bias and a layer_id")
    return out


def hold_out_k_bias(attention: torch.nn.Module) -> None:
    """attention.qkv_proj adds b with its K rows zero from now on: a persistent masked copy (graph
    capture keeps its address) refreshed from the live bias at every call, swapped in around SGLang's
    own forward so its TP and sequence-parallel paths stay as they are."""
    qkv = attention.qkv_proj
    if getattr(qkv, "trace_k_bias_held_out", False):
        return
    a, b = attention.q_size, attention.q_size + attention.kv_size
    masked = torch.nn.Parameter(qkv.bias.detach().clone(), requires_grad=False)
    original = qkv.forward

    def forward(*args, **kwargs):
        live = qkv._parameters["bias"]
        masked.data.copy_(live.data)
        masked.data[a:b].zero_()
        qkv._parameters["bias"] = masked
        try:
            return original(*args, **kwargs)
        finally:
            qkv._parameters["bias"] = live

    qkv.forward = forward
    qkv.trace_k_bias_held_out = True


def current_positions() -> torch.Tensor | None:
    """The positions of the batch the model runner is running, one per new token (None outside a forward)."""
    return _POSITIONS.get()


def forward_with_positions(original, self, forward_batch, *args, **kwargs):
    """AROUND hook of ModelRunner.forward: a de-biasing KV method sees the batch's positions."""
    method = getattr(getattr(self, "token_to_kv_pool", None), "quant_method", None)
    if not getattr(method, "k_debias", False):
        return original(self, forward_batch, *args, **kwargs)
    if method.k_biases is None:
        method.k_biases = k_biases_of(self.model)
    token = _POSITIONS.set(forward_batch.positions)
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        _POSITIONS.reset(token)


class SlotPositions:
    """One position per KV slot (shared by every layer) and the fp32 RoPE tables of them all."""

    def __init__(self, size: int, head_dim: int, device) -> None:
        self.pos = torch.zeros(size, dtype=torch.int64, device=device)
        self.head_dim = head_dim
        self._tables: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, loc: torch.Tensor, positions: torch.Tensor | None) -> None:
        if positions is None:
            raise RuntimeError(
                "quant.kv_k_debias: a K store ran outside ModelRunner.forward, so the slots' positions are "
                "unknown (the plugin's forward hook sets them; is the trace_fp4 plugin's capture hook registered?)"
            )
        positions = positions.reshape(-1).to(device=self.pos.device, dtype=torch.int64)
        if positions.numel() != loc.numel():
            raise RuntimeError(
                f"quant.kv_k_debias: the batch has {positions.numel()} positions for {loc.numel()} stored K rows"
            )
        if not torch.equal(self.pos[loc], positions):
            self.pos.index_copy_(0, loc, positions)
            self._tables.clear()

    def offset(self, k_bias: LayerKBias) -> torch.Tensor:
        """RoPE_pos(b) fp32 [slots, heads, D] at every slot's position."""
        if k_bias.theta not in self._tables:
            self._tables[k_bias.theta] = rotary_tables(self.pos, self.head_dim, k_bias.theta)
        return rotate_bias(k_bias.bias(), *self._tables[k_bias.theta])
