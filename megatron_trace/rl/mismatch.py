"""Train/rollout mismatch metrics over response tokens (the `mismatch/` namespace).

With samples drawn by the rollout policy, r = p_train / p_rollout per token:
  |Δlogp|       mean and max of |logp_rollout - logp_train|
  K3 KL         mean of (r - 1) - log r, an unbiased, non-negative estimate of KL(rollout || train)
  ratio         mean / max of r, and the fraction of tokens with r > is_clip (what the loss clips)
  by position   mean |Δlogp| per response-position bucket: FP4 KV error grows with length
"""

from __future__ import annotations

import torch

DEFAULT_BUCKETS = (0, 8, 16, 32, 64, 128, 256, 512, 1024)


def _flat(seqs: list[torch.Tensor]) -> torch.Tensor:
    return (
        torch.cat([torch.as_tensor(s, dtype=torch.float64).reshape(-1) for s in seqs])
        if seqs
        else torch.zeros(0, dtype=torch.float64)
    )


def mismatch_metrics(
    rollout_logprobs: list, train_logprobs: list, *, is_clip: float = 5.0, buckets: tuple[int, ...] = DEFAULT_BUCKETS
) -> dict[str, float]:
    """Per-sample lists of per-token logprobs (same lengths) -> scalar metrics."""
    if len(rollout_logprobs) != len(train_logprobs):
        raise ValueError(f"{len(rollout_logprobs)} rollout samples but {len(train_logprobs)} train samples")
    for i, (a, b) in enumerate(zip(rollout_logprobs, train_logprobs)):
        if len(a) != len(b):
            raise ValueError(f"sample {i}: {len(a)} rollout logprobs but {len(b)} train logprobs")
    lr, lt = _flat(rollout_logprobs), _flat(train_logprobs)
    if lr.numel() == 0:
        return {
            "mean_abs_dlogp": 0.0,
            "max_abs_dlogp": 0.0,
            "k3_kl": 0.0,
            "ratio_mean": 1.0,
            "ratio_max": 1.0,
            "clipped_frac": 0.0,
            "tokens": 0,
        }
    d = lt - lr
    r = torch.exp(d)
    out = {
        "mean_abs_dlogp": float(d.abs().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "k3_kl": float((r - 1 - d).mean()),
        "ratio_mean": float(r.mean()),
        "ratio_max": float(r.max()),
        "clipped_frac": float((r > is_clip).double().mean()),
        "tokens": int(d.numel()),
    }
    out.update(position_buckets(rollout_logprobs, train_logprobs, buckets))
    return out


def position_buckets(rollout_logprobs: list, train_logprobs: list, buckets=DEFAULT_BUCKETS) -> dict[str, float]:
    """mean |Δlogp| per response-position bucket, keyed 'dlogp_pos_{lo}_{hi}'."""
    gaps = [
        (torch.as_tensor(b, dtype=torch.float64) - torch.as_tensor(a, dtype=torch.float64)).abs()
        for a, b in zip(rollout_logprobs, train_logprobs)
    ]
    return {f"dlogp_pos_{k}": v for k, v in bucket_means(gaps, buckets).items()}


def bucket_means(per_seq: list, buckets=DEFAULT_BUCKETS) -> dict[str, float]:
    """The mean of per-position values (one sequence of values per answer, position 0 first) in each
    position bucket [lo, hi) that holds any, keyed '{lo}_{hi}' (the last bucket '{lo}_inf')."""
    sums = [0.0] * len(buckets)
    counts = [0] * len(buckets)
    for seq in per_seq:
        d = torch.as_tensor(seq, dtype=torch.float64)
        for i, lo in enumerate(buckets):
            hi = buckets[i + 1] if i + 1 < len(buckets) else None
            part = d[lo:hi]
            sums[i] += float(part.sum())
            counts[i] += part.numel()
    out = {}
    for i, lo in enumerate(buckets):
        if counts[i]:
            hi = buckets[i + 1] if i + 1 < len(buckets) else "inf"
            out[f"{lo}_{hi}"] = sums[i] / counts[i]
    return out
