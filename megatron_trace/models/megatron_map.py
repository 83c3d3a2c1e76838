"""HF <-> Megatron-Core (GPTModel, local layer spec) state-dict conversion with TP/PP/EP split/merge.

Pure layout: tensors are only sliced, concatenated and reshaped, never computed on, so every
round trip is bit-exact. Megatron's layouts that differ from HF:

* `linear_qkv` is interleaved per KV group, [q heads of group g, k_g, v_g] for g = 0..G-1,
  so a contiguous TP slice holds whole groups (this is why TP may not exceed num_kv_heads here).
* `linear_fc1` is [gate; up], and each TP rank holds [gate_shard; up_shard], not a slice of it.
* Row-parallel `linear_proj` / `linear_fc2` split on dim 1; column/vocab-parallel ones on dim 0.
* PP stages number their layers from 0; EP ranks number their experts from 0.
* The vocab may be padded (Megatron rounds it up to a multiple of 128 * TP); padding rows are
  zeros on the way in and dropped on the way out.

The returned tensors may share storage with the input state dict.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from .arch import ModelArch

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_FUSED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# Per-layer one-to-one renames: Megatron suffix -> HF suffix (under model.layers.{i}.).
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_LAYER_SPLIT_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
_GLOBAL_SPLIT_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "decoder.final_layernorm.weight": None,
}


# --------------------------------------------------------------------------- parallel layout
def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the global layers pipeline stage `pp_rank` holds (even split)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, pp_size); got pp_rank={pp_rank}, pp_size={pp_size}")
    if num_layers % pp_size:
        raise ValueError(f"num_layers ({num_layers}) must be divisible by pp_size ({pp_size})")
    per = num_layers // pp_size
    return pp_rank * per, (pp_rank + 1) * per


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padded vocab: rounded up to a multiple of `divisible_by * tp_size`."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def tp_split_dim(megatron_name: str) -> int | None:
    """Dim along which TP ranks split `megatron_name` (None: replicated on every TP rank)."""
    m = _LAYER_RE.match(megatron_name)
    if m is None:
        if megatron_name not in _GLOBAL_SPLIT_DIM:
            raise ValueError(f"unknown Megatron parameter {megatron_name!r}")
        return _GLOBAL_SPLIT_DIM[megatron_name]
    suffix = m.group(2)
    e = _EXPERT_RE.match(suffix)
    if e is not None:
        return 0 if e.group(2) == "linear_fc1" else 1
    if suffix in _LAYER_SPLIT_DIM:
        return _LAYER_SPLIT_DIM[suffix]
    if suffix in _LAYER_RENAMES:
        return None
    raise ValueError(f"unknown Megatron parameter {megatron_name!r}")


def _check_parallel(arch: ModelArch, tp_size: int, ep_size: int, vocab: int) -> None:
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"tp_size and ep_size must be >= 1; got tp_size={tp_size}, ep_size={ep_size}")
    if tp_size > arch.num_kv_heads or arch.num_kv_heads % tp_size:
        raise ValueError(
            f"tp_size ({tp_size}) must divide num_kv_heads ({arch.num_kv_heads}); "
            "TP > num_kv_heads (replicated KV heads) is not supported"
        )
    if arch.intermediate_size % tp_size:
        raise ValueError(f"intermediate_size ({arch.intermediate_size}) must be divisible by tp_size ({tp_size})")
    if vocab % tp_size:
        raise ValueError(f"vocab size ({vocab}) must be divisible by tp_size ({tp_size}); pass padded_vocab_size")
    if arch.is_moe:
        if arch.num_experts % ep_size:
            raise ValueError(f"num_experts ({arch.num_experts}) must be divisible by ep_size ({ep_size})")
        if arch.moe_intermediate_size % tp_size:
            raise ValueError(
                f"moe_intermediate_size ({arch.moe_intermediate_size}) must be divisible by tp_size ({tp_size})"
            )
    elif ep_size != 1:
        raise ValueError(f"ep_size must be 1 for dense family {arch.family}; got {ep_size}")


# --------------------------------------------------------------------------- layout primitives
def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q/k/v (weight [rows, in] or bias [rows]) -> Megatron's per-group [q_g, k_g, v_g] rows."""
    tail = q.shape[1:]
    g = num_kv_heads
    parts = [t.reshape(g, t.shape[0] // g, *tail) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv` for the full (TP-gathered) tensor."""
    tail = qkv.shape[1:]
    g, q_rows = num_kv_heads, num_heads // num_kv_heads * head_dim
    q, k, v = qkv.reshape(g, q_rows + 2 * head_dim, *tail).split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])


def _fc1_merge(fc1: torch.Tensor, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # fc1 is tp_size rank shards laid end to end, each [gate_r; up_r].
    halves = [s.chunk(2) for s in fc1.chunk(tp_size)]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def _shard(t: torch.Tensor, dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    return t if dim is None or tp_size == 1 else t.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def _pad_vocab(t: torch.Tensor, vocab: int) -> torch.Tensor:
    if t.shape[0] == vocab:
        return t
    return torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])])


def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise KeyError(f"HF state dict is missing {name!r}") from None


def unfuse_hf_experts(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-5 in-memory experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) -> the per-expert checkpoint names; other entries pass through (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_sd.items():
        m = _HF_FUSED_EXPERTS_RE.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


# --------------------------------------------------------------------------- HF -> Megatron
def _layer_params(
    hf_sd: Mapping[str, torch.Tensor], arch: ModelArch, i: int, tp_size: int, tp_rank: int, experts: range
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron suffix with local expert ids, this TP rank's shard) for HF layer `i`."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
    for kind in ("weight", "bias") if arch.qkv_bias else ("weight",):
        q, k, v = (_get(hf_sd, f"{attn}{x}_proj.{kind}") for x in "qkv")
        qkv = interleave_qkv(q, k, v, arch.num_kv_heads)
        yield f"self_attention.linear_qkv.{kind}", _shard(qkv, 0, tp_size, tp_rank)
    for meg, hf in _LAYER_RENAMES.items():
        if meg.startswith("self_attention.q_") or meg.startswith("self_attention.k_"):
            if not arch.qk_norm:
                continue
        elif meg == "self_attention.linear_proj.bias" and not arch.o_bias:
            continue
        elif meg.startswith("mlp."):
            continue  # handled below: the MLP differs between dense and MoE layers
        yield meg, _shard(_get(hf_sd, p + hf), _LAYER_SPLIT_DIM.get(meg), tp_size, tp_rank)
    if not arch.layer_is_moe(i):
        gate, up = _get(hf_sd, p + "mlp.gate_proj.weight"), _get(hf_sd, p + "mlp.up_proj.weight")
        yield "mlp.linear_fc1.weight", _fc1_shard(gate, up, tp_size, tp_rank)
        yield "mlp.linear_fc2.weight", _shard(_get(hf_sd, p + "mlp.down_proj.weight"), 1, tp_size, tp_rank)
        return
    yield "mlp.router.weight", _get(hf_sd, p + "mlp.gate.weight")
    for local, e in enumerate(experts):
        x = f"{p}mlp.experts.{e}."
        gate, up = _get(hf_sd, x + "gate_proj.weight"), _get(hf_sd, x + "up_proj.weight")
        meg = f"mlp.experts.local_experts.{local}."
        yield meg + "linear_fc1.weight", _fc1_shard(gate, up, tp_size, tp_rank)
        yield meg + "linear_fc2.weight", _shard(_get(hf_sd, x + "down_proj.weight"), 1, tp_size, tp_rank)


def hf_to_megatron(
    hf_sd: Mapping[str, torch.Tensor],
    arch: ModelArch,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    ep_size: int = 1,
    ep_rank: int = 0,
    padded_vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict rank (tp_rank, pp_rank, ep_rank) holds, from a full HF state dict.

    Accepts checkpoint (per-expert) or transformers-5 in-memory (fused-expert) names. Expert
    weights are TP-split like dense ones (Megatron's default expert_tensor_parallel_size = TP).
    `padded_vocab_size` (default: the real vocab) zero-pads embedding/output rows.
    """
    vocab = padded_vocab_size or arch.vocab_size
    if vocab < arch.vocab_size:
        raise ValueError(f"padded_vocab_size ({vocab}) is smaller than vocab_size ({arch.vocab_size})")
    _check_parallel(arch, tp_size, ep_size, vocab)
    if not 0 <= tp_rank < tp_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ranks out of range: tp_rank={tp_rank}/{tp_size}, ep_rank={ep_rank}/{ep_size}")
    hf_sd = unfuse_hf_experts(hf_sd)
    start, end = pp_layer_range(arch.num_layers, pp_size, pp_rank)
    per_ep = arch.num_experts // ep_size
    experts = range(ep_rank * per_ep, (ep_rank + 1) * per_ep)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        emb = _pad_vocab(_get(hf_sd, "model.embed_tokens.weight"), vocab)
        out["embedding.word_embeddings.weight"] = _shard(emb, 0, tp_size, tp_rank)
    for i in range(start, end):
        for suffix, t in _layer_params(hf_sd, arch, i, tp_size, tp_rank, experts):
            out[f"decoder.layers.{i - start}.{suffix}"] = t
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = _get(hf_sd, "model.norm.weight")
        if not arch.tie_word_embeddings:
            head = _pad_vocab(_get(hf_sd, "lm_head.weight"), vocab)
            out["output_layer.weight"] = _shard(head, 0, tp_size, tp_rank)
        elif pp_size > 1:
            # Tied + PP: Megatron keeps a synchronized copy of the embedding on the last stage.
            emb = _pad_vocab(_get(hf_sd, "model.embed_tokens.weight"), vocab)
            out["output_layer.weight"] = _shard(emb, 0, tp_size, tp_rank)
    return out


# --------------------------------------------------------------------------- Megatron -> HF
def megatron_param_to_hf(
    name: str,
    tensor: torch.Tensor,
    arch: ModelArch,
    layer_offset: int = 0,
    *,
    expert_offset: int = 0,
    tp_size: int = 1,
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one TP-gathered Megatron parameter, for streaming transfers.

    `name` is rank-local: its layer index is offset by `layer_offset` (the stage's first global
    layer) and its expert index by `expert_offset` (ep_rank * experts per rank). `tensor` is the
    TP shards concatenated along `tp_split_dim(name)`; `tp_size` says how many, which matters only
    for linear_fc1, whose shards are each [gate_r; up_r] (pass 1 if already [gate; up]).
    Padded vocab rows are dropped. A tied model's `output_layer.weight` maps to nothing.
    """
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            return []
        hf = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        return [(hf, tensor[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    m = _LAYER_RE.match(name)
    if m is None:
        raise ValueError(f"unknown Megatron parameter {name!r}")
    i, suffix = int(m.group(1)) + layer_offset, m.group(2)
    p = f"model.layers.{i}."
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, arch.num_heads, arch.num_kv_heads, arch.head_dim)
        return [(f"{p}self_attn.{x}_proj.{kind}", t) for x, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = _fc1_merge(tensor, tp_size)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    e = _EXPERT_RE.match(suffix)
    if e is not None:
        x = f"{p}mlp.experts.{int(e.group(1)) + expert_offset}."
        if e.group(2) == "linear_fc2":
            return [(x + "down_proj.weight", tensor)]
        gate, up = _fc1_merge(tensor, tp_size)
        return [(x + "gate_proj.weight", gate), (x + "up_proj.weight", up)]
    if suffix in _LAYER_RENAMES:
        return [(p + _LAYER_RENAMES[suffix], tensor)]
    raise ValueError(f"unknown Megatron parameter {name!r}")


def megatron_to_hf(
    shards: Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]],
    arch: ModelArch,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Merge every rank's Megatron state dict, keyed (pp_rank, tp_rank, ep_rank), into one HF
    state dict in `arch.hf_param_shapes()` order. Replicated params are read from TP/EP rank 0."""
    for pp in range(pp_size):
        for tp in range(tp_size):
            for ep in range(ep_size):
                if (pp, tp, ep) not in shards:
                    raise KeyError(f"missing shard (pp_rank={pp}, tp_rank={tp}, ep_rank={ep})")
    per_ep = arch.num_experts // ep_size if arch.is_moe else 0
    out: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        start, _ = pp_layer_range(arch.num_layers, pp_size, pp)
        for name in shards[(pp, 0, 0)]:
            dim = tp_split_dim(name)
            is_expert = ".mlp.experts.local_experts." in name
            for ep in range(ep_size if is_expert else 1):
                parts = [shards[(pp, tp, ep)][name] for tp in range(tp_size)]
                full = parts[0] if dim is None else torch.cat(parts, dim=dim)
                pairs = megatron_param_to_hf(
                    name, full, arch, start, expert_offset=ep * per_ep, tp_size=1 if dim is None else tp_size
                )
                out.update(pairs)
    expected = arch.hf_param_shapes()
    missing = [k for k in expected if k not in out]
    if missing:
        raise KeyError(f"Megatron shards do not cover HF parameters: {', '.join(missing[:8])}")
    return {k: out[k] for k in expected}
