"""Batched per-request sampling and the logprob of each sampled token.

The logprob is taken from log_softmax(logits / temperature) before top-k/top-p/min-p
filtering (greedy: temperature 1), the distribution the trainer recomputes. A sampled row
draws exactly one uniform from its request's own generator per token and inverts the CDF of
its filtered distribution, so a sample's tokens depend only on its seed and logits, never on
which other requests share the batch.
"""
from __future__ import annotations

import torch

from kernels import cpu_fused
from sglang_backend.api import SamplingParams


def _filtered(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's probabilities with top-k / top-p / min-p applied (zeros outside)."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k != -1 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        keep &= probs >= kth
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly above each token
        in_nucleus = torch.zeros_like(keep)
        in_nucleus[order] = before < params.top_p
        keep &= in_nucleus
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    return torch.where(keep, probs, torch.zeros_like(probs))


def _needs_filter(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k != -1 and p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 gens: list[torch.Generator]) -> tuple[list[int], list[float]]:
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
    for i, p in enumerate(params):  # rare: per-row filters
        if not greedy[i] and _needs_filter(p, vocab):
            probs[i] = _filtered(probs[i], p)
    us = torch.cat([torch.zeros(1) if g else torch.rand(1, generator=gen) for g, gen in zip(greedy, gens)])
    cdf = probs.cumsum(-1)
    tok = torch.searchsorted(cdf, (us.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)[:, 0]
    if bool((tok >= vocab).any()):  # u * total rounded up to total: the last token with mass
        last = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
        tok = torch.where(tok >= vocab, last, tok)
    if any(greedy):
        tok = torch.where(torch.tensor(greedy), logits.argmax(-1), tok)
    lp = logp.gather(1, tok[:, None])[:, 0]
    return tok.tolist(), lp.tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """logits fp32 [V] -> (token, logprob)."""
    tok, lp = sample_batch(logits[None], [params], [gen])
    return tok[0], lp[0]
