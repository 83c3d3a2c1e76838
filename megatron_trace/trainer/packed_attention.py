"""Causal attention over a packed THD stream, in memory linear in the sequence length.

    q [T, heads, D], k / v [T, groups, D], cu_seqlens (whole padded samples)
      ─► Transformer Engine's fused/flash attention (Megatron's TEDotProductAttention: THD, and its
         context-parallel ring) where TE is installed on CUDA
      ─► otherwise torch's scaled_dot_product_attention per sample (is_causal, GQA: the flash kernel
         on CPU and CUDA, never an S x S score matrix); under context parallelism (zigzag halves per
         rank) K and V are all-gathered over the CP group and each local half attends to the
         positions before it (lower-right causal), which runs on gloo too
Attention never crosses samples; a sample's padding tail comes after its real tokens, so causal
attention keeps it out of them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)
_warned: list[str] = []


def _sdpa(q, k, v, scale, causal=True, mask=None) -> torch.Tensor:
    """[n, heads, D] x [m, groups, D] -> [n, heads, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def packed_attention(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each sample of the stream attends causally to itself: [T, heads, D]. Samples of one length
    run as one batched call (RL batches hold many short answers of few distinct lengths)."""
    starts, lengths = cu_seqlens[:-1].tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if len(starts) == 1:
        return _sdpa(q, k, v, scale)
    groups: dict[int, list[int]] = {}
    for a, n in zip(starts, lengths):
        groups.setdefault(n, []).append(a)
    parts, order = [], []
    for n, firsts in groups.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(n)).reshape(-1).to(q.device)
        qs, ks, vs = (t.index_select(0, rows).unflatten(0, (len(firsts), n)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        parts.append(o.transpose(1, 2).reshape(-1, *q.shape[1:]))
        order.append(rows)
    return torch.cat(parts).index_select(0, torch.argsort(torch.cat(order)))


class _GatherCP(torch.autograd.Function):
    """All-gather [T_local, ...] over the CP group -> [cp, T_local, ...]; backward sums the
    gradients of every rank's copy and keeps this rank's piece."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def packed_attention_cp(q, k, v, cu_seqlens: torch.Tensor, scale: float, group) -> torch.Tensor:
    """Context-parallel attention for this rank's zigzag halves ([T/CP, ...] local rows; cu_seqlens
    of the whole samples). Torch reference for CPU/gloo: K and V of every rank are gathered."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ks, vs = _GatherCP.apply(k, group), _GatherCP.apply(v, group)
    out, start = [], 0
    for length in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist():
        c, local = length // (2 * cp), length // cp
        # chunk j of the whole sample: first half of rank j, or second half of rank 2cp-1-j
        src = [(j, 0) if j < cp else (2 * cp - 1 - j, c) for j in range(2 * cp)]
        seg = slice(start, start + local)
        k_full = torch.cat([ks[r, seg][o : o + c] for r, o in src])
        v_full = torch.cat([vs[r, seg][o : o + c] for r, o in src])
        for half, chunk in ((0, rank), (c, 2 * cp - 1 - rank)):
            qh = q[seg][half : half + c]
            end = (chunk + 1) * c
            out.append(_sdpa(qh, k_full[:end], v_full[:end], scale, mask=causal_lower_right(c, end)))
        start += local
    return torch.cat(out)


def te_attention(config, layer_number: int, attn_mask_type, attention_type: str, softmax_scale, cp_comm_type, pg):
    """Megatron's TEDotProductAttention when Transformer Engine imports on a CUDA machine, else None
    (the torch path above runs: same math, no fused THD kernel; said once on a GPU, where TE was
    expected)."""
    if not torch.cuda.is_available():
        return None
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
    except ImportError as e:
        HAVE_TE, why = False, repr(e)
    else:
        why = "megatron.core reports HAVE_TE=False"
    if not HAVE_TE:
        if not _warned:
            _warned.append(why)
            log.warning(
                "trainer attention: Transformer Engine is not importable (%s): packed attention runs torch's "
                "SDPA per sample (same numbers, no fused THD kernel, context parallelism through all-gathered K/V)",
                why,
            )
        return None
    return TEDotProductAttention(
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        softmax_scale=softmax_scale,
        cp_comm_type=cp_comm_type or "p2p",
        pg_collection=pg,
    )
