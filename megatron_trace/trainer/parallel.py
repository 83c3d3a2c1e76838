"""torch.distributed + Megatron-Core model-parallel setup for the trainer (GPU or CPU/gloo)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megatron_trace.config import LaunchEnv

from .cpu_compat import apply_cpu_workarounds


def init_distributed(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0, cp: int = 1) -> None:
    """Initialize torch.distributed and Megatron's TP/PP/CP/EP groups, and seed every RNG.

    Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (`config.LaunchEnv`; torch reads MASTER_ADDR/PORT); without
    them it starts a single-process world on an in-memory store (no port). Backend: nccl on
    CUDA (one device per LOCAL_RANK), gloo otherwise, where `apply_cpu_workarounds()` runs first.
    The data-parallel size is what is left: world / (tp * pp * cp). Safe to call when torch.distributed
    is already initialized (the existing process group is reused).
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_workarounds()
    if not dist.is_initialized():
        launched = LaunchEnv.from_env()  # torchrun (or srun + torchrun) sets the rendezvous
        if cuda:
            torch.cuda.set_device((launched.local_rank if launched else 0) % torch.cuda.device_count())
        if launched:
            dist.init_process_group(
                backend="nccl" if cuda else "gloo", rank=launched.rank, world_size=launched.world_size
            )
        else:
            # A single process needs no rendezvous port: two runs on one machine must not collide.
            dist.init_process_group(backend="nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    # Same seed on every rank for the default generators (data-parallel replicas must agree);
    # the tracker derives per-TP-rank / per-EP-rank streams from it. On CPU the tracker is the
    # CPU-generator one installed by cpu_compat, so the same call works on both.
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy() -> None:
    """Tear down Megatron's groups and the default process group (no-op if not initialized)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
