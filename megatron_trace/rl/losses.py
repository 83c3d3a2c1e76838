"""Policy losses over response tokens, against the rollout's own logprobs.

All take flat per-token tensors: logp (trainer, with grad), rollout_logp, advantages and a
0/1 mask, and the run's `algo` section (`algo.loss` picks one; its bounds are checked by the
section), and return (loss summed over masked tokens, metrics). The caller divides by its token
count, so micro-batches add up to a token-level mean over the whole batch.

  ppo_clip  r = p_train / p_rollout, PPO's min(rA, clip(r, 1-eps_low, 1+eps_high)A), and for
            negative advantages the dual clip at is_clip (TRACE: token-level IS clip, 5)
  tis       truncated importance sampling: weight min(r, tis_cap) (detached) on -logp·A
  mis       masked IS (IcePop): tokens whose r leaves [mis_low, mis_high] drop out of PPO
  none      -logp·A with no correction (what a naive FP4 rollout trains with)
"""

from __future__ import annotations

import torch

from megatron_trace.config import AlgoConfig


def policy_loss(
    logp: torch.Tensor, rollout_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mask.to(logp.dtype)
    log_ratio = logp - rollout_logp.to(logp.dtype)
    ratio = torch.exp(log_ratio)
    adv = adv.to(logp.dtype)
    keep = mask
    if cfg.loss == "none":
        tok = -logp * adv
    elif cfg.loss == "tis":
        tok = -torch.clamp(ratio.detach(), max=cfg.tis_cap) * logp * adv
    else:
        pg = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
        pg = torch.where(adv < 0, torch.maximum(pg, cfg.is_clip * adv), pg)
        tok = -pg
        if cfg.loss == "mis":
            r = ratio.detach()
            keep = mask * ((r >= cfg.mis_low) & (r <= cfg.mis_high)).to(mask.dtype)
    loss = (tok * keep).sum()
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        r = ratio.detach()
        clipped = ((r > 1 + cfg.eps_high) & (adv > 0)) | ((r < 1 - cfg.eps_low) & (adv < 0))
        metrics = {
            "clipped_frac": float(clipped.to(mask.dtype).mul(mask).sum() / n),
            "is_clipped_frac": float(((r > cfg.is_clip).to(mask.dtype) * mask).sum() / n),
            "masked_frac": float(((mask - keep).sum()) / n),
            "ratio_mean": float((r * mask).sum() / n),
        }
    return loss, metrics
