"""One weight sync, end to end: gather -> quantize -> transport (which buckets for the wire).

# every trainer rank (collective); only global rank 0 passes a transport
stats = push_weights(chunks, arch, policy, transport if rank == 0 else None, version=step)

# single process, from an HF state dict (export, benchmarks, tests)
stats = push_hf_state_dict(hf_sd, arch, policy, transport, version=1)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from .. import faults
from ..models import ModelArch, QuantPolicy
from .bucket import BucketStats
from .gather import hf_order, iter_hf_params, model_parallel
from .quantize import manifest, rollout_tensors
from .transports import TransferStats, Transport


def hf_state_dict_stream(hf_sd: Mapping[str, torch.Tensor], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF state dict in `arch.hf_param_shapes()` order (fused-group members are consecutive)."""
    for name in arch.hf_param_shapes():
        if name not in hf_sd:
            raise KeyError(f"HF state dict is missing {name!r}")
        yield name, hf_sd[name]


def _send(
    stream: Iterable[tuple[str, torch.Tensor]],
    arch: ModelArch,
    policy: QuantPolicy,
    transport: Transport,
    version: int,
    *,
    bucket_mb: float,
    input_amax,
    dtype,
    plan,
    bucket_stats,
) -> TransferStats:
    policy.check_resolved(arch)
    units = rollout_tensors(stream, arch, policy, input_amax=input_amax, dtype=dtype)
    return transport.send_units(
        _with_fault_point(units, version), version, manifest=plan, bucket_mb=bucket_mb, bucket_stats=bucket_stats
    )


def _with_fault_point(units: Iterable, version: int) -> Iterator:
    """Hits `transfer.unit` before handing unit i over: armed at i >= 1, a kill lands after the
    transport has taken units 0..i-1 of this version and before it has all of them (mid-sync)."""
    for i, u in enumerate(units):
        faults.hit("transfer.unit", version=version, unit=i)
        yield u


def push_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor],
    arch: ModelArch,
    policy: QuantPolicy,
    transport: Transport,
    version: int,
    *,
    bucket_mb: float = 512.0,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype | None = None,
    bucket_stats: BucketStats | None = None,
) -> TransferStats:
    """Quantize + bucket + send a full HF state dict (one process)."""
    shapes = arch.hf_param_shapes()
    model_dtype = next(iter(hf_sd.values())).dtype
    plan = manifest(shapes.items(), arch, policy, model_dtype=model_dtype, dtype=dtype)
    return _send(
        hf_state_dict_stream(hf_sd, arch),
        arch,
        policy,
        transport,
        version,
        bucket_mb=bucket_mb,
        input_amax=input_amax,
        dtype=dtype,
        plan=plan,
        bucket_stats=bucket_stats,
    )


def push_weights(
    model_chunks: list,
    arch: ModelArch,
    policy: QuantPolicy,
    transport: Transport | None,
    version: int,
    *,
    bucket_mb: float = 512.0,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype | None = None,
    bucket_stats: BucketStats | None = None,
) -> TransferStats | None:
    """Collective over all trainer ranks: rank(s) with `transport=None` only take part in the
    gather's collectives; the sender (global rank 0) quantizes, buckets and sends. Returns the
    sender's stats (None elsewhere). If sending fails the sender raises AFTER draining the gather,
    so the other ranks are never left waiting in a collective."""
    stream = iter_hf_params(model_chunks, arch)
    if transport is None:
        for _ in stream:
            pass
        return None
    par, vocab = model_parallel(model_chunks)
    model_dtype = next(p for p in model_chunks[0].parameters()).dtype
    plan = manifest(hf_order(arch, par, vocab), arch, policy, model_dtype=model_dtype, dtype=dtype)
    try:
        return _send(
            stream,
            arch,
            policy,
            transport,
            version,
            bucket_mb=bucket_mb,
            input_amax=input_amax,
            dtype=dtype,
            plan=plan,
            bucket_stats=bucket_stats,
        )
    finally:
        for _ in stream:  # keep the collectives paired if the send stopped early
            pass
