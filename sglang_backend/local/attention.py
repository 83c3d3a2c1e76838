"""The engine's attention over its paged KV cache, apart from the C fused path (model.py).

prefill_attention / decode_attention read K and V back from the cache (dequantized when
quantized) and attend in torch; on CUDA tensors decode over FP4 pages goes through the Triton paged
kernel (megatron_trace.kernels.dispatch). `k_add(positions, dtype)` adds back what a de-biased K cache
(quant.kv_k_debias) left out of K.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from megatron_trace.kernels.dispatch import paged_decode_attention

if TYPE_CHECKING:
    from .kv_cache import PagedKVCache
    from .model import ForwardBatch


@functools.lru_cache(maxsize=1)
def warn_debias_gathered() -> None:
    logging.getLogger(__name__).warning(
        "quant.kv_k_debias: attention reads K back through a dequantized gather plus RoPE_pos(k bias) (the "
        "Triton page kernel takes no K offset; the CPU page kernels do): same numbers, slower than plain FP4 pages"
    )


def attend(q, k, v, mask, num_kv_heads) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, L, Hkv, D], mask [B, n, L] (True = visible) -> [B, n, H, D]."""
    b, n, h, d = q.shape
    g = h // num_kv_heads
    qg = q.reshape(b, n, num_kv_heads, g, d)
    scores = torch.einsum("bnkgd,blkd->bkgnl", qg, k) * (d**-0.5)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bkgnl,blkd->bnkgd", probs, v).reshape(b, n, h, d)


def prefill_attention(q, batch: ForwardBatch, kv: PagedKVCache, layer: int, k_add=None) -> torch.Tensor:
    """k_add(positions, dtype): what to add back to K as read (a de-biased K cache), or None."""
    outs = []
    for (s, e), slots in zip(batch.spans, batch.read_slots):
        k, v = kv.read(layer, 0, slots), kv.read(layer, 1, slots)
        if k_add is not None:  # a sequence's slots hold positions 0, 1, ... in order
            k = (k.float() + k_add(torch.arange(slots.numel()), torch.float32)).to(k.dtype)
        pos = batch.positions[s:e]
        mask = torch.arange(slots.numel())[None, :] <= pos[:, None]
        outs.append(attend(q[None, s:e], k[None], v[None], mask[None], kv.kv_heads)[0])
    return torch.cat(outs)


# Decode attention over FP4 pages. "auto": the Triton kernel (megatron_trace/kernels/fp4_attention.py: codes x
# scales dequantized in registers, never a dequantized copy) for CUDA tensors, the torch gather
# below elsewhere; "triton" also sends CPU tensors to the kernel (under TRITON_INTERPRET=1, how the
# tests reach it); "reference" always takes the torch gather.
DECODE_ATTENTION_BACKEND = "auto"
PAGED_KERNEL_KV_FORMATS = ("nvfp4", "mxfp4")  # K and V in one of these (the kernel's page formats)


def decode_attention(q, batch: ForwardBatch, kv: PagedKVCache, layer: int, k_add=None) -> torch.Tensor:
    backend = DECODE_ATTENTION_BACKEND
    paged = kv.fmt in PAGED_KERNEL_KV_FORMATS and backend != "reference" and (q.is_cuda or backend == "triton")
    if paged and k_add is None:
        return decode_attention_paged(q, batch, kv, layer, backend)
    if paged:
        warn_debias_gathered()
    flat, mask = batch.decode_gather()
    b, w = mask.shape
    k = kv.read(layer, 0, flat).reshape(b, w, kv.kv_heads, -1)
    if k_add is not None:  # column j of the gather is position j
        k = (k.float() + k_add(torch.arange(w, device=k.device), torch.float32)[None]).to(k.dtype)
    v = kv.read(layer, 1, flat).reshape(b, w, kv.kv_heads, -1)
    return attend(q[:, None], k, v, mask[:, None], kv.kv_heads)[:, 0]


def decode_attention_paged(q, batch: ForwardBatch, kv: PagedKVCache, layer: int, backend: str) -> torch.Tensor:
    """Decode attention straight over the layer's FP4 pages through megatron_trace.kernels.dispatch (each row of
    the slot table is one sequence's slots, valid up to its length)."""
    flat, mask = batch.decode_gather()
    table = flat.reshape(mask.shape).to(device=q.device, dtype=torch.int32)
    lens = mask.sum(1).to(device=q.device, dtype=torch.int32)
    k_codes, k_scales, v_codes, v_scales = kv.layer_pages[layer]
    k_gs, v_gs = kv.global_scale[layer]
    return paged_decode_attention(
        q, k_codes, k_scales, v_codes, v_scales, k_gs, v_gs, table, lens, kv.fmt, backend=backend
    )
