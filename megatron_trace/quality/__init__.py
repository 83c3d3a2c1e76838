"""What a quantization setting does to the policy, measured before trusting it: rollout quality
against BF16 (`measure`, `python -m megatron_trace.quality`), the run's gate before step 0 (`gate`),
and train/rollout agreement per trainer mode (`probe`, `python -m megatron_trace.quality.probe`)."""
