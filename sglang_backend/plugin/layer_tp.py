"""How a plugin linear method sees its SGLang layer: the layer's tensor-parallel rank and size,
this rank's slice of a full checkpoint tensor, the all-reduce MAX a row-parallel layer needs for
its per-token scale, and derived buffers written in place (so CUDA graphs keep their addresses).
Shared by `quant_method` (checkpoint FP4) and `online_quant` (BF16 checkpoints quantized at load).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


def sglang_attr(module: str, name: str):
    """`module.name` when SGLang (or the module) provides it, else None: 0.5.x moves things around."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        return None


def tp_rank_size(layer, shard_id=None) -> tuple[int, int]:
    """(rank, size) of the layer's tensor-parallel group, read as SGLang 0.5.23 layers expose it:
    `tp_group` (k/v shards of a QKV layer: `kv_tp_group`) through `get_group_rank_size`, None
    meaning unsharded. Layers without a group attribute (plain modules in CPU tests) are TP=1."""
    attr = "kv_tp_group" if shard_id in ("k", "v") and hasattr(layer, "kv_tp_group") else "tp_group"
    if not hasattr(layer, attr):
        return 0, 1
    group = getattr(layer, attr)
    rank_size = sglang_attr("sglang.srt.distributed.utils", "get_group_rank_size")
    if rank_size is not None:
        rank, size = rank_size(group)
    else:
        rank, size = (0, 1) if group is None else (group.rank_in_group, group.world_size)
    return int(rank), int(size)


def narrow_tp(t: torch.Tensor, dim: int, want: int, layer, what: str, shard_id=None) -> torch.Tensor:
    """This rank's `want` rows/cols of a full tensor (replicated KV heads share a chunk)."""
    full = t.shape[dim]
    if full == want:
        return t
    rank, size = tp_rank_size(layer, shard_id)
    if want == 0 or full % want or full // want > size:
        raise ValueError(
            f"{what}: checkpoint size {full} along dim {dim} does not split into {want} per rank (tp={size})"
        )
    chunk = rank * (full // want) // size
    return t.narrow(dim, chunk * want, want)


def is_row_parallel(layer) -> bool:
    """A row-parallel layer at TP > 1: its input row (K) is split over the TP ranks."""
    return hasattr(layer, "input_is_parallel") and tp_rank_size(layer)[1] > 1


def _process_group(group, t: torch.Tensor):
    """SGLang's GroupCoordinator keeps a gloo group for CPU tensors and the device group for the rest."""
    return group.device_group if t.device.type != "cpu" else group.cpu_group


def tp_all_max(layer):
    """A function returning the elementwise max over the layer's TP group (all_reduce MAX), None at TP=1.
    Over `tp_group` even for a QKV layer's replicated k/v shards: duplicates do not change a MAX."""
    if tp_rank_size(layer)[1] <= 1:
        return None
    group = layer.tp_group

    def all_max(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=_process_group(group, t))
        return t

    return all_max


def row_parallel_all_max(layer):
    """For a row-parallel layer at TP > 1: `tp_all_max` (its per-token scale spans the full row), else None."""
    return tp_all_max(layer) if is_row_parallel(layer) else None


def row_parallel_all_gather(layer):
    """For a row-parallel layer at TP > 1: a function concatenating every rank's [..., K_rank] tensor along
    the last dim in rank order (the full row: SGLang gives rank r the r-th K chunk), else None."""
    if not is_row_parallel(layer):
        return None
    group, size = layer.tp_group, tp_rank_size(layer)[1]

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t, group=_process_group(group, t))
        return torch.cat(parts, dim=-1)

    return all_gather


def set_derived(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Write a derived buffer in place when the shape allows (CUDA graphs keep its address)."""
    cur = getattr(layer, name, None)
    if value is None:
        setattr(layer, name, None)
    elif isinstance(cur, torch.Tensor) and _same_layout(cur, value):
        cur.copy_(value)
    elif name in layer._buffers or cur is None:
        layer.register_buffer(name, value, persistent=False)
    else:
        setattr(layer, name, value)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)


def kv_head_owner_ranks(total_heads: int, size: int) -> list[int]:
    """The ranks whose K/V heads, concatenated in rank order, are each of the `total_heads` heads once:
    all ranks when the heads split (rank r: heads [r*H/size, (r+1)*H/size)), else the first rank of each
    group replicating one head (rank r: head r*H//size, SGLang's tp_rank // num_kv_head_replicas)."""
    if total_heads < 1 or (total_heads >= size and total_heads % size) or (total_heads < size and size % total_heads):
        raise ValueError(f"{total_heads} KV heads do not split over {size} TP ranks")
    return [r for r in range(size) if r == 0 or r * total_heads // size != (r - 1) * total_heads // size]


def kv_heads_all_gather(group, rank: int, size: int, total_heads: int):
    """A function turning this rank's K/V rows [T, heads_rank, ...] into all `total_heads` heads [T, H, ...].
    SGLang's attention gives rank r heads [r*H/size, (r+1)*H/size), or with fewer heads than ranks
    (H < size) head r*H//size, replicated on consecutive ranks: those are taken once, from the first."""
    first = kv_head_owner_ranks(total_heads, size)

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:  # nothing to exchange (an FP8 site's zero-width block scales): only the shape grows
            return t.new_empty(t.shape[0], total_heads, *t.shape[2:])
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t, group=_process_group(group, t))
        full = torch.cat([parts[r] for r in first], dim=1)
        if full.shape[1] != total_heads:
            raise RuntimeError(
                f"K/V capture on rank {rank}: assembled {full.shape[1]} heads, the model has {total_heads}"
            )
        return full

    return all_gather
