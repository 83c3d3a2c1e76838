"""Prepacked oneDNN bf16 linears for the engine's CPU torch paths (batches, prefill, the LM head).

F.linear over a bf16 weight hands oneDNN a plain [N, K] matrix, which it reorders into its blocked
layout on every call; at the 0.5B widths and 8-32 rows that reorder costs as much as the GEMM
(benchmarks/cpu_linears.py: the packed call is 1.3-2.3x faster). `PackedWeight` keeps the
reordered copy (torch.ops.mkldnn._reorder_linear_weight, what inductor's CPU weight freezing uses)
and multiplies with torch.ops.mkldnn._linear_pointwise: the same bits as F.linear at every row
count (tests/test_onednn_linear.py), for one more copy of the weight in memory.
Where oneDNN cannot pack bf16 here (no oneDNN in the torch build, or no bf16 path on this CPU as
MEGATRON_TRACE_CPU_ISA caps it: cpu_routes.py decides it once), `available()` is False and
`unavailable_reason()` says why; the engine reports it in model_info and multiplies by
cpu_routes.linear (F.linear, or fp32 on the up-cast where this CPU has no bf16 GEMM).
"""

from __future__ import annotations

import torch

from . import cpu_routes


def unavailable_reason() -> str | None:
    return cpu_routes.routes().onednn_bf16


def available() -> bool:
    return unavailable_reason() is None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a packed call serves x . weight^T: bf16 both, on CPU, 2-D weight, oneDNN packs here."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and available()
    )


class PackedWeight:
    """One weight's oneDNN-packed copy, rebuilt whenever the caller's key (which must change with
    every write to the weight) changes."""

    def __init__(self) -> None:
        self._key, self._packed = None, None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key) -> torch.Tensor:
        if self._key != key:
            self._packed, self._key = torch.ops.mkldnn._reorder_linear_weight(weight.detach()), key
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
