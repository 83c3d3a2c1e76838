"""Batched per-request sampling and the logprob of each sampled token.

The logprob is the one of the distribution the token was drawn from: log_softmax(logits / T),
renormalized over what top-k/top-p/min-p keep (`sglang_backend.api` (its sampling support), which the
trainer's recompute shares; greedy: temperature 1, no filter). A sampled row draws exactly one
uniform from its request's own generator per token and inverts the CDF of its filtered
distribution, so a sample's tokens depend only on its seed and logits, never on which other
requests share the batch.
"""

from __future__ import annotations

import torch

from megatron_trace.kernels import cpu_fused
from sglang_backend.api import SamplingParams, keep_mask, needs_filter, support_logprob


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """logits fp32 [B, V] -> (tokens, logprobs), row i sampled with params[i] and gens[i]."""
    vocab = logits.shape[-1]
    greedy = [p.temperature == 0 for p in params]
    if all(greedy):
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_fused.available():
            return cpu_fused.greedy_logprob(logits.contiguous())
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]
        return tok.tolist(), lp.tolist()
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=logits.dtype)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = logp.exp()
    filtered = {}  # row -> its keep mask (rare: per-row filters)
    for i, p in enumerate(params):
        if not greedy[i] and needs_filter(p.top_k, p.top_p, p.min_p, vocab):
            filtered[i] = keep_mask(probs[i : i + 1], p.top_k, p.top_p, p.min_p)
            probs[i] = torch.where(filtered[i][0], probs[i], torch.zeros((), dtype=probs.dtype))
    us = torch.cat([torch.zeros(1) if g else torch.rand(1, generator=gen) for g, gen in zip(greedy, gens)])
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (us.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)[:, 0]
    if bool((tok >= vocab).any()):  # u * total rounded up to total: the last token with mass
        last = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
        tok = torch.where(tok >= vocab, last, tok)
    if any(greedy):
        tok = torch.where(torch.tensor(greedy), logits.argmax(-1), tok)
    lp = logp.gather(1, tok[:, None])[:, 0]
    for i, keep in filtered.items():
        lp[i] = support_logprob(logp[i : i + 1], tok[i : i + 1], keep)[0]
    return tok.tolist(), lp.tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """logits fp32 [V] -> (token, logprob)."""
    tok, lp = sample_batch(logits[None], [params], [gen])
    return tok[0], lp[0]
