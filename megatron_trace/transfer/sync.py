"""The loop's weight sync: trainer shards -> rollout tensors -> buckets -> transport, one version.

Every trainer rank calls `sync_weights` (the gather is collective); global rank 0 owns the
transport and sends. FP4 linears travel as ModelOpt NVFP4 tensors quantized here by the same
fp4 code the trainer's QAT uses, so rollout and trainer weights are bit-identical.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from ..models import QuantPolicy
from .pipeline import push_weights
from .transports import DiskTransport, DistributedTransport, HttpTransport, InProcessTransport, TransferStats


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
