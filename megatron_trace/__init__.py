"""megatron-trace: FP4 rollout RL with rollout-guided QAT (TRACE)."""

# First, before torch runs an op: MEGATRON_TRACE_CPU_ISA caps torch's, oneDNN's and MKL's dispatch
# (kernels/cpu_routes.py; it imports nothing but the standard library).
from megatron_trace.kernels import cpu_routes as _cpu_routes  # noqa: F401
