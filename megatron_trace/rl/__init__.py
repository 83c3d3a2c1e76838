"""RL math: advantages, policy losses and train/rollout mismatch metrics (no trainer internals)."""
from .losses import LOSSES, LossConfig, policy_loss
from .mismatch import mismatch_metrics, position_buckets

__all__ = ["LOSSES", "LossConfig", "mismatch_metrics", "policy_loss", "position_buckets"]
