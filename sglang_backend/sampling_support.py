"""Which tokens a request's top-k / top-p / min-p keep, and a token's logprob under that support.

    logits / T ─► log_softmax ─► probs ─► keep = top-k ∩ top-p ∩ min-p ─► sample from probs·keep
                                                                      └► logprob = log(p_tok / Σ_keep p)
The logprob a rollout records is the one of the distribution it actually sampled from (the
renormalized, filtered one); the trainer's recompute calls the same two functions on its own
logits, so with identical numerics the importance ratio is exactly 1 under top-p too. (SGLang
reports the unfiltered softmax unless a request sets `return_sampling_mask`, whose "selected"
logprob is this one.) Lives beside the rollout contract because both sides must share it.
"""

from __future__ import annotations

import torch


def needs_filter(top_k: int, top_p: float, min_p: float, vocab: int) -> bool:
    return (top_k != -1 and top_k < vocab) or top_p < 1.0 or min_p > 0


def keep_mask(probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """probs [R, V] -> bool [R, V]: the tokens sampling may pick (top-k, then nucleus, then min-p).

    Nucleus: a token is kept while the mass strictly above it is < top_p, so the most likely
    token always survives. Ties are ordered by a stable sort, the same on both sides."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k != -1 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        keep &= probs >= kth
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, -1) - sorted_p
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    if min_p > 0:
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    return keep


def support_logprob(logp: torch.Tensor, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """log p(token) under the filtered, renormalized distribution: logp[tok] - log Σ_keep exp(logp).

    logp [R, V] (log_softmax at the sampling temperature), tokens [R], keep [R, V]. The sampled
    token is always counted in the support (a trainer whose own nucleus, computed from slightly
    different logits, misses it still gets a finite logprob). Differentiable in logp."""
    keep = keep.scatter(-1, tokens[:, None], True)
    mass = torch.where(keep, logp.exp(), torch.zeros((), dtype=logp.dtype)).sum(-1)
    return logp.gather(-1, tokens[:, None])[:, 0] - torch.log(mass)
