"""Per-request sampling and the logprob of the sampled token.

The logprob is taken from log_softmax(logits / temperature) before top-k/top-p/min-p
filtering (greedy: temperature 1), the distribution the trainer recomputes.
"""
from __future__ import annotations

import torch

from sglang_backend.api import SamplingParams


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """logits fp32 [V] -> (token, logprob)."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
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
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    tok = int(torch.multinomial(filtered, 1, generator=gen))
    return tok, float(logp[tok])
