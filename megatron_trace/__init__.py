"""megatron-trace: FP4 rollout RL with rollout-guided QAT (TRACE)."""
