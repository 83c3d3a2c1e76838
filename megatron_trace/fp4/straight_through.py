"""The two pieces of QAT glue the trainer's quantized linears use (trainer/qat.py): the dequantized
value of any quantized tensor (FP4 or FP8), and the straight-through estimator that passes it forward."""

from __future__ import annotations

import torch

from . import fp8, mxfp4, nvfp4


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, xq):
        return xq

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """Returns xq exactly in the forward; the gradient flows to x unchanged."""
    return _StraightThrough.apply(x, xq.to(x.dtype))


def dequantize_any(
    q: nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor | fp8.FP8Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """NVFP4, MXFP4 or FP8 tensor -> values in dtype."""
    if isinstance(q, fp8.FP8Tensor):
        return fp8.dequantize(q, dtype)
    if isinstance(q, mxfp4.MXFP4Tensor):
        return mxfp4.dequantize(q, dtype)
    return nvfp4.dequantize(q, dtype)
