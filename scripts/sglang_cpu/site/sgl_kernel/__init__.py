"""CPU stand-in for SGLang's CUDA-only `sgl_kernel` package (sglang-kernel 0.4.10 ships no CPU build).

SGLang 0.5.23's CPU engine imports names from `sgl_kernel` at module level but, for a plain
Qwen2 on a CPU without AMX, calls only `assign_req_to_token_pool_cpu`. That one function is
implemented here in torch; every other top-level name resolves to a stub that
raises when called, naming the kernel, so a test cannot pass through a fake kernel. It has no
submodules: `import sgl_kernel.X` fails with ImportError, which SGLang's optional imports handle.
Installed on the test venv's path by scripts/setup_env.sh (scripts/sglang_cpu/install.sh).
"""

from __future__ import annotations

import torch

STAND_IN = True
__version__ = "0.0.0+trace.cpu.stand.in"


class MissingKernelError(NotImplementedError):
    pass


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request r: req_to_token[req_pool_indices[r], start[r]:end[r]] = the next end-start out_cache_loc entries."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    pos = 0
    for r, slot in enumerate(req_pool_indices.tolist()):
        n = ends[r] - starts[r]
        if n <= 0:
            continue
        if ends[r] > pool_len:
            raise IndexError(f"assign_req_to_token_pool_cpu: end {ends[r]} beyond pool_len {pool_len}")
        req_to_token[slot, starts[r] : ends[r]] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _stub(qualname: str):
    def missing(*_args, **_kwargs):
        raise MissingKernelError(
            f"{qualname} is a CUDA kernel of sglang-kernel, which has no CPU build; this CPU stand-in "
            f"(scripts/sglang_cpu/site/sgl_kernel) implements only assign_req_to_token_pool_cpu"
        )

    missing.__name__ = missing.__qualname__ = qualname.rpartition(".")[2]
    missing.__module__ = qualname.rpartition(".")[0]
    missing.sgl_kernel_stand_in = True
    return missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(f"{__name__}.{name}")
