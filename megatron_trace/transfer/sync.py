"""The loop's weight sync: trainer shards -> rollout tensors -> buckets -> backend, as one version.

Every trainer rank calls it (the gather is collective); rank 0 sends. FP4 linears travel as
ModelOpt NVFP4 tensors quantized here with the same fp4 code the trainer's QAT uses.
"""
from __future__ import annotations

import torch.distributed as dist

from sglang_backend.api import WeightBucket


def sync_weights(model_chunks, arch, cfg, backend, version: int) -> None:
    from megatron_trace.trainer.gpt import export_hf_state_dict

    hf = export_hf_state_dict(model_chunks, arch)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    backend.update_weights(WeightBucket(hf, version))
