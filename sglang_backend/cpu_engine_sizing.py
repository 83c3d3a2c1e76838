"""Sizing SGLang's CPU engine for `launch.py --device cpu`: the per-rank OpenMP thread binding
(SGLANG_CPU_OMP_THREADS_BIND) and --mem-fraction-static from the checkpoint's weights plus the KV it
must hold. Kept apart from the flag translation because it reads the machine (CPU affinity, free
memory) and the checkpoint's tensor shapes, which the rest of the launcher never does.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

# SGLang's CPU engine used 4.17 GB for Qwen2.5-0.5B's 1.9 GB of fp32 weights under trace_nvfp4 (W4A4).
ONLINE_QUANT_WEIGHT_FACTOR = 2.2


def cpu_thread_binding(tp_size: int, cpus: list[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for TP ranks on SGLang's CPU engine: this process's CPUs split into
    tp_size contiguous groups ("0-3|4-7"). Without it SGLang asks for one NUMA node per rank and
    stops on a one-node box."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cpus) < tp_size:
        raise ValueError(
            f"--tp-size {tp_size} on the CPU engine needs at least one CPU per rank; this process may "
            f"use {len(cpus)} ({cpus}); set SGLANG_CPU_OMP_THREADS_BIND yourself to share them"
        )
    per = len(cpus) // tp_size
    groups = [cpus[r * per : (r + 1) * per] for r in range(tp_size)]

    def cpu_list(g: list[int]) -> str:
        if len(g) == 1:
            return str(g[0])
        return f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1 else ",".join(map(str, g))

    return "|".join(cpu_list(g) for g in groups)


def _available_memory() -> int:
    try:
        import psutil  # SGLang's own measure of what its CPU engine may use
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return psutil.virtual_memory().available


def cpu_mem_fraction(args: argparse.Namespace, kv_tokens: int, available: int | None = None) -> float:
    """--mem-fraction-static for SGLang's CPU engine: its share of the memory available now that the
    weights (every floating tensor at --dtype; x2.2 under online quantization) and `kv_tokens` of KV
    at --dtype take, with a third more for slack; at least 0.05. (A fixed 0.05 starved a real 0.5B
    model's KV at fp32.)"""
    from safetensors import safe_open

    from megatron_trace.models import ModelArch

    wide = 4 if args.dtype == "float32" else 2
    weights = 0
    for f in sorted(Path(args.model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = math.prod(t.get_shape())
                weights += n * (wide if t.get_dtype() in ("F32", "F16", "BF16") else 1)
    if args.quantization is not None:  # online quantization holds the float weights and their FP4 copy
        weights = int(weights * ONLINE_QUANT_WEIGHT_FACTOR)
    arch = ModelArch.from_hf_config(Path(args.model_path))
    kv = kv_tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * wide
    frac = 1.34 * (weights + kv) / (available or _available_memory())
    return round(min(max(frac, 0.05), 0.9), 3)
