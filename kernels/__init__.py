"""Custom kernels. Importing this package never imports triton; `kernels.dispatch` loads the
Triton implementations on first use, so CPU-only installs without triton keep working.

Call kernels through `kernels.dispatch` (e.g. `from kernels.dispatch import nvfp4_quantize`).
The function is deliberately not re-exported here: the submodule `kernels.nvfp4_quantize`
shares its name, and importing that submodule would overwrite a package attribute of the same
name with the module.
"""
