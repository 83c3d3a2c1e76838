"""Resident MiB after linear forward + backward at the 0.5B model's down_proj over a run of new
token counts (one JSON line: growth over the first and over the later shapes). Caches as the train
entry point sets them (cpu_alloc.bound_kernel_caches), unless the environment names its own."""

import ctypes
import json
import sys

import torch

from megatron_trace.kernels import cpu_alloc

cpu_alloc.bound_kernel_caches()  # before the first GEMM, as megatron_trace.train does
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")


def resident_mib() -> float:
    libc.malloc_trim(0)
    return cpu_alloc.resident_gib() * 1024


weights = [torch.randn(896, 4864, dtype=torch.bfloat16)]  # down_proj
first, later = int(sys.argv[1]), int(sys.argv[2])
marks = [resident_mib()]
for i, tokens in enumerate(range(64, 64 + 4 * (first + later), 4)):  # each micro-batch a new token count
    for w in weights:
        x = torch.randn(tokens, w.shape[1], dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(x, w.clone().requires_grad_(True)).sum().backward()
    if i + 1 in (first, first + later):
        marks.append(resident_mib())
print(json.dumps({"first": marks[1] - marks[0], "later": marks[2] - marks[1]}))
