"""The rollout side: the contract (`api`), the HTTP client, the embedded engine and server
(`local`), and the plugin that runs inside a real SGLang server. Imports nothing heavy."""

# First, before torch runs an op: MEGATRON_TRACE_CPU_ISA caps torch's, oneDNN's and MKL's dispatch.
from megatron_trace.kernels import cpu_routes as _cpu_routes  # noqa: F401
