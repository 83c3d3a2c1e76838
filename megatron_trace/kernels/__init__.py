"""Custom kernels. Importing this package never imports triton and builds nothing: `megatron_trace.kernels.dispatch`
loads the Triton implementations on first use, and the CPU engine's C kernels (`*.c`, `*.h`, bound
to torch tensors in `cpu_ops.cpp`) are built by `megatron_trace.kernels.cpu_build` the first time one is called,
so CPU-only installs without triton or a compiler keep working (on the torch references).

Call kernels through `dispatch` (e.g. `from megatron_trace.kernels.dispatch import nvfp4_quantize`).
The function is deliberately not re-exported here: the submodule `megatron_trace.kernels.nvfp4_quantize`
shares its name, and importing that submodule would overwrite a package attribute of the same
name with the module.
"""
