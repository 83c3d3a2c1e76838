"""The process's memory: how its heap treats large temporaries (for the engine on CPU), what of it is
resident, and its peak (what a run logs as perf/rss_gib and perf/peak_rss_gib, and what the memory
model's tests measure).

glibc serves allocations above its mmap threshold (128 KB, raised adaptively up to 32 MB) with fresh
mmaps and returns freed heap above its trim threshold to the system, so the same large temporary,
made again every decode step (a batch's logits: 32 x 151,936 fp32 = 19 MB; sampling's softmax
passes; prefill activations), is page-faulted in anew each time. On the VMs these numbers come from
that costs ~8 ms per 19 MB, ten times the arithmetic on it (a 19 MB division: 8.6 ms allocated,
0.8 ms into a preallocated output); a sampled 32-row step spent 39 of its ~80 ms so. `keep_freed_memory`
raises both thresholds (process-wide, once), so freed memory is reused; the process's resident
size then stays near its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading

from . import cpu_build

# oneDNN's primitive cache and ideep's (PyTorch's oneDNN wrapper) each keep 1,024 compiled kernels by
# default, one per GEMM shape and direction: 3-4 MiB more per new token count at the 0.5B model's
# linears (fwd + both bwd), and every packed micro-batch and prefill brings a new one, so a run's
# resident size grew for its first ~30 steps. 128 each bounds them to ~0.1 GiB; the decode widths
# (at most max_running) stay cached while the rollout runs them.
KERNEL_CACHE_ENTRIES = 128
KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
MMAP_THRESHOLD = 256 << 20  # allocations below this come from the heap (glibc's default: 128 KB .. 32 MB)
TRIM_THRESHOLD = 1 << 30  # freed heap kept before any is returned to the system

_lock = threading.Lock()
_status: list[str] = []


def keep_freed_memory() -> str:
    """Applies the thresholds once per process; returns what model_info reports: "glibc: freed memory
    kept (mmap threshold 256 MiB)", or why the default allocator behaviour stays (logged once)."""
    with _lock:
        if not _status:
            lib = cpu_build.library()
            why = "CPU kernels not built" if lib is None else lib.keep_freed_memory(MMAP_THRESHOLD, TRIM_THRESHOLD)
            if why:
                logging.getLogger(__name__).warning(
                    "large temporaries are page-faulted in anew each step (%s): expect slower batched CPU decode", why
                )
                _status.append(f"default ({why})")
            else:
                _status.append(f"glibc: freed memory kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB)")
        return _status[0]


def bound_kernel_caches() -> dict[str, str]:
    """Caps oneDNN's and ideep's kernel caches (KERNEL_CACHE_ENTRIES each, unless the environment
    sets them); returns the settings. Both read their variable at their first kernel, so a process
    calls this before any GEMM (the train entry point, the engine's server)."""
    for var in KERNEL_CACHE_VARS:
        os.environ.setdefault(var, str(KERNEL_CACHE_ENTRIES))
    return {var: os.environ[var] for var in KERNEL_CACHE_VARS}


def return_freed_memory(collect: bool = True) -> int:
    """Gives the heap's free pages back to the system (glibc malloc_trim) and returns the resident
    bytes released. keep_freed_memory's thresholds keep what a finished phase freed (the quality
    gate's two engines: 5.4 GB of a 0.5B model) resident, and the trainer's large buffers are fresh
    mmaps that cannot reuse it; a run calls this between such phases. Garbage in reference cycles
    is collected first: the engines' frozen GC (sglang_backend/local/engine.py) leaves a closed
    engine's cycles to the next full collection, and their pages cannot go back before it
    (collect=False: the trainer's calls between micro-batches, which free no cycles). 0 where
    glibc is absent."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = _resident_bytes()
    trim(0)
    return max(before - _resident_bytes(), 0)


_trim_fn: list = []


def _malloc_trim():
    """glibc's malloc_trim, looked up once (find_library runs ldconfig); None where it is absent."""
    if not _trim_fn:
        name = ctypes.util.find_library("c")
        try:
            _trim_fn.append(ctypes.CDLL(name).malloc_trim if name else None)
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing kept that this could free
            _trim_fn.append(None)
    return _trim_fn[0]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # KiB -> GiB
    raise KeyError(field)


_earlier_peak = [0.0]  # the highest peak mark any reset_peak_rss cleared


def reset_peak_rss() -> float:
    """This process's resident GiB now, with the kernel's peak mark (VmHWM) reset to it (Linux).
    Returns the reset mark, not VmRSS: per-thread RSS counters reach the mark in batches, so a VmRSS
    read here can exceed every later VmHWM and make a peak-minus-baseline negative. The mark cleared
    is kept for process_peak_rss."""
    _earlier_peak[0] = max(_earlier_peak[0], _status_gib("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_gib("VmHWM")


def resident_gib() -> float:
    """This process's resident GiB now."""
    return _status_gib("VmRSS")


def peak_rss() -> float:
    """This process's peak resident GiB since start or the last `reset_peak_rss`."""
    return _status_gib("VmHWM")


def process_peak_rss() -> float:
    """This process's peak resident GiB since start, across every reset_peak_rss (which also lowers
    getrusage's ru_maxrss: the kernel reads it from the same mark)."""
    return max(_status_gib("VmHWM"), _earlier_peak[0])
