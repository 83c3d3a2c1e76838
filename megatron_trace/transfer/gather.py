"""Stream a TP/PP/EP-sharded Megatron model out as full HF-named tensors, one parameter at a time.

    for hf_name, tensor in iter_hf_params(model_chunks, arch):   # every rank calls (collectives)
        ...

No pickle: every rank computes the same *plan* (each Megatron parameter's owning pipeline stage,
owning expert-parallel rank, local name and full shape) from `arch` and the parallel sizes alone,
by running the pure layout map `hf_to_megatron` on meta tensors. Then, per planned parameter:

1. the owning stage all-gathers the TP shards along `tp_split_dim` (expert weights over the
   expert-TP group),
2. for expert weights, the owning expert-parallel rank broadcasts over the EP group,
3. the owning stage broadcasts the full tensor over the pipeline group,
4. `megatron_param_to_hf` undoes the fused layouts (interleaved qkv, [gate; up]) and renames.

After step 3 every rank holds the full tensor, so EVERY rank yields the same stream; only the
sender (global rank 0) needs it, the others just have to keep iterating so the collectives pair
up. Peak extra memory is about two copies of the largest parameter (shards list + gathered).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models import ModelArch, hf_to_megatron, megatron_param_to_hf, tp_split_dim
from ..models.megatron_map import pp_layer_range


@dataclass(frozen=True)
class PlannedParam:
    stage: int  # pipeline stage that owns it
    name: str  # rank-local Megatron name (layer/expert index local to the stage / EP rank)
    full_shape: tuple[int, ...]  # after TP gather
    split_dim: int | None  # TP split dim (None: replicated)
    ep_owner: int | None  # expert-parallel rank owning it (None: not an expert weight)
    layer_offset: int
    expert_offset: int


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    ep: int = 1


def _meta_hf(arch: ModelArch) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in arch.hf_param_shapes().items()}


def plan(arch: ModelArch, par: Parallel, padded_vocab: int) -> list[PlannedParam]:
    """Every Megatron parameter of the whole model, in stream order, computed identically on all
    ranks (meta tensors: no data, no communication)."""
    meta = _meta_hf(arch)
    per_ep = arch.num_experts // par.ep if arch.is_moe else 0
    out: list[PlannedParam] = []
    for stage in range(par.pp):
        start, _ = pp_layer_range(arch.num_layers, par.pp, stage)
        local = hf_to_megatron(
            meta,
            arch,
            tp_size=par.tp,
            tp_rank=0,
            pp_size=par.pp,
            pp_rank=stage,
            ep_size=par.ep,
            ep_rank=0,
            padded_vocab_size=padded_vocab,
        )
        experts: list[tuple[str, torch.Tensor]] = []

        def flush() -> None:
            # Global expert e = r * per_ep + j: EP rank outer gives HF's expert order.
            for r in range(par.ep):
                for n, t in experts:
                    out.append(_entry(stage, n, t, par, r, start, r * per_ep))
            experts.clear()

        for name, t in local.items():
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # tied + PP: the last stage's copy of the embedding maps to no HF name
            if ".mlp.experts.local_experts." in name:
                experts.append((name, t))
                continue
            flush()
            out.append(_entry(stage, name, t, par, None, start, 0))
        flush()
    return out


def _entry(stage, name, shard, par, ep_owner, start, expert_offset) -> PlannedParam:
    dim = tp_split_dim(name)
    shape = list(shard.shape)
    if dim is not None:
        shape[dim] *= par.tp
    return PlannedParam(stage, name, tuple(shape), dim, ep_owner, start, expert_offset)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    return model


def _groups():
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size():
        raise ValueError("unsupported: expert tensor parallel size != tensor parallel size")
    return ps


def hf_order(arch: ModelArch, par: Parallel, padded_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) in exactly the order `iter_hf_params` yields them (meta tensors)."""
    out = []
    for p in plan(arch, par, padded_vocab):
        t = torch.empty(p.full_shape, device="meta")
        pairs = megatron_param_to_hf(
            p.name, t, arch, p.layer_offset, expert_offset=p.expert_offset, tp_size=1 if p.split_dim is None else par.tp
        )
        out += [(n, tuple(x.shape)) for n, x in pairs]
    return out


def model_parallel(model_chunks: list) -> tuple[Parallel, int]:
    """(the parallel sizes, the model's padded vocab) of an initialized Megatron run."""
    ps = _groups()
    par = Parallel(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    (chunk,) = model_chunks
    return par, int(_unwrap(chunk).vocab_size)


@torch.no_grad()
def iter_hf_params(
    model_chunks: list, arch: ModelArch, *, out_device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, streaming; collective over all ranks.

    Every rank must consume the generator to the end in lockstep (it issues TP all-gathers and
    EP/PP broadcasts per parameter). Every rank yields the same stream. Tensors are moved to
    `out_device` (CPU by default: the transports and the quantizer work on host memory).
    """
    from ..trainer.gpt import _local_state_dict  # unfused names also for the fused-norm layout

    ps = _groups()
    par, vocab = model_parallel(model_chunks)
    (chunk,) = model_chunks
    mine = _local_state_dict(_unwrap(chunk))
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    sample = next(iter(mine.values()))
    dtype, device = sample.dtype, sample.device
    for p in plan(arch, par, vocab):
        full = None
        if p.stage == pp_rank:
            full = _tp_gather(mine[p.name], p, par, ps)
            if p.ep_owner is not None and par.ep > 1:
                # Each EP rank gathered its own local expert j; keep the owner's copy.
                buf = full if ep_rank == p.ep_owner else torch.empty(p.full_shape, dtype=dtype, device=device)
                group = ps.get_expert_model_parallel_group()
                dist.broadcast(buf, src=dist.get_global_rank(group, p.ep_owner), group=group)
                full = buf
        if par.pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            if full is None:
                full = torch.empty(p.full_shape, dtype=dtype, device=device)
            dist.broadcast(full, src=dist.get_global_rank(group, p.stage), group=group)
        pairs = megatron_param_to_hf(
            p.name,
            full,
            arch,
            p.layer_offset,
            expert_offset=p.expert_offset,
            tp_size=1 if p.split_dim is None else par.tp,
        )
        for hf_name, t in pairs:
            yield hf_name, t.to(out_device).contiguous()
        del full, pairs  # keep only one parameter alive at a time


def _tp_gather(local: torch.Tensor, p: PlannedParam, par: Parallel, ps) -> torch.Tensor:
    local = local.detach().contiguous()
    if p.split_dim is None or par.tp == 1:
        return local  # a broadcast source is only read; the yielded views may alias the parameter
    group = ps.get_expert_tensor_parallel_group() if p.ep_owner is not None else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(par.tp)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=p.split_dim)
