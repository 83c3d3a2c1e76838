"""The run: one RL run from a config to its summary (`python -m megatron_trace.train`)."""
