"""RL math: the sample, GRPO advantages, policy losses and train/rollout mismatch metrics (no
trainer internals). The losses read the config tree's `algo` section (`megatron_trace.config.AlgoConfig`)."""

from .losses import policy_loss
from .mismatch import mismatch_metrics, position_buckets
from .sample import Sample, grpo_advantages

__all__ = ["Sample", "grpo_advantages", "mismatch_metrics", "policy_loss", "position_buckets"]
