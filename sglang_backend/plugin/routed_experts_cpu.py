"""`--enable-return-routed-experts` on SGLang's CPU engine (routing replay's rollout half).

SGLang 0.5.23 keeps each token's routed expert ids in a host buffer (`state_capturer/base.py`
BaseHostCache) allocated through `mem_cache/pool_host/common.py` ALLOC_MEMORY_FUNCS[device],
whose default pins the pages with cudaHostRegister: without CUDA that raises while the server
starts. Pinning only speeds device-to-host copies, and a CPU engine has no device, so on a
machine without CUDA the "cpu" entry allocates the same buffer unpinned (SGLang's own
HostTensorAllocator). GPU servers keep SGLang's path untouched.
"""

from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)
ALLOC_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _alloc_unpinned(
    dims: tuple,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator=None,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """SGLang's host-buffer allocation signature, without the pinning a CPU-only torch cannot do."""
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def allow_unpinned_cpu_host_buffers() -> bool:
    """Give ALLOC_MEMORY_FUNCS an entry for "cpu" when CUDA is absent; False when not needed or absent."""
    if torch.cuda.is_available():
        return False
    try:
        mod = importlib.import_module(ALLOC_MODULE)
    except Exception as e:  # noqa: BLE001 - any failure means "this SGLang lacks it"
        log.warning(
            "trace_fp4: cannot import %s (%s); --enable-return-routed-experts fails on the CPU engine", ALLOC_MODULE, e
        )
        return False
    funcs = getattr(mod, "ALLOC_MEMORY_FUNCS", None)
    if funcs is None or not hasattr(funcs, "__setitem__"):
        log.warning(
            "trace_fp4: %s has no ALLOC_MEMORY_FUNCS; --enable-return-routed-experts fails on the CPU engine",
            ALLOC_MODULE,
        )
        return False
    funcs["cpu"] = _alloc_unpinned
    return True
