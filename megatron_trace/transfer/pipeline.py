"""One weight sync, end to end: gather -> quantize -> transport (which buckets for the wire).

# a run: its transport (rank 0), then every step on every rank (the gather is collective)
transport = make_transport(cfg, backend, run_dir, arch)
stats = sync_weights(chunks, arch, policy, cfg, transport if rank == 0 else None, version=step)

# single process, from an HF state dict (export, benchmarks, tests)
stats = push_hf_state_dict(hf_sd, arch, policy, transport, version=1)

FP4 linears travel as ModelOpt NVFP4 tensors quantized here by the same fp4 code the trainer's QAT
uses, so rollout and trainer weights are bit-identical.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from .. import faults
from ..models import ModelArch, QuantPolicy
from .bucket import BucketStats
from .gather import hf_order, iter_hf_params, model_parallel
from .quantize import manifest, rollout_tensors
from .transports import (
    DiskTransport,
    DistributedTransport,
    HttpTransport,
    InProcessTransport,
    TransferStats,
    Transport,
)


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


# -- the run's sync: its transport and each step's version ----------------------------------------
def make_transport(cfg, backend, run_dir: Path, arch):
    """The configured transport (rank 0 only): `transfer.transport` over the rollout backend."""
    kind = cfg.transfer.transport
    if kind == "inprocess":
        if cfg.rollout.backend != "local":
            raise ValueError("transfer.transport=inprocess needs rollout.backend=local")
        return InProcessTransport(backend)
    if cfg.rollout.backend != "http":
        raise ValueError(f"transfer.transport={kind} sends to servers: set rollout.backend=http and rollout.urls")
    if kind == "http":
        return HttpTransport(backend)
    if kind == "distributed":
        t = cfg.transfer
        # "auto": this host (global rank 0 lands on whichever node the rendezvous picked).
        address = socket.gethostname() if t.master_address == "auto" else t.master_address
        return DistributedTransport(
            cfg.rollout.urls,
            api_key=cfg.rollout.api_key or None,
            master_address=address,
            master_port=t.master_port,
            backend=t.group_backend,
        )
    return DiskTransport(backend, run_dir / "weights", arch.to_hf_config())


def sync_weights(
    model_chunks,
    arch,
    policy: QuantPolicy,
    cfg,
    transport,
    version: int,
    *,
    input_amax: Mapping[str, float] | None = None,
) -> TransferStats | None:
    """Collective; returns the sender's stats (bytes, seconds) on rank 0, None elsewhere.
    `policy`: the run's resolved one. input_amax: the run's calibrated {HF module: input amax} with
    quant.activation_scale=static; every version carries the same input_scale, the S_enc the
    trainer's QAT rounds with."""
    if policy.activation_scale == "static" and transport is not None and input_amax is None:
        raise ValueError(
            "quant.activation_scale=static: the weight sync needs the run's calibrated input amax "
            "(Run calibrates it at start; megatron_trace.transfer.static_scales)"
        )
    return push_weights(
        model_chunks, arch, policy, transport, version, bucket_mb=cfg.transfer.bucket_mb, input_amax=input_amax
    )
