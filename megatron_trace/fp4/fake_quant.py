"""Fake quantization for QAT: quantize -> dequantize in the forward, straight-through backward.

mode "rtn": round to nearest with the trainer's own scales (plain QAT).
mode "guided": the rollout's scales and codewords (TRACE), from a `RolloutRounding`.
The forward output equals the rollout engine's dequantized tensor bit for bit when both sides
see the same input, because both call the same quantizer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import mxfp4, nvfp4
from .guided import guided_quantize

MODES = ("rtn", "guided")
FORMATS = ("nvfp4", "mxfp4")


@dataclass
class RolloutRounding:
    """What the rollout recorded at one quantization site for a [..., K] activation."""

    scale: torch.Tensor  # uint8 E4M3 block scales [..., K/16]
    global_scale: torch.Tensor  # fp32 S_enc, 0-d or one per row
    codes: torch.Tensor | None = None  # packed codes [..., K/2] (full guidance)
    mantissa: torch.Tensor | None = None  # packed mantissa bits [..., K/8]


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


def quantize_site(
    x: torch.Tensor,
    *,
    mode: str = "rtn",
    fmt: str = "nvfp4",
    guidance: RolloutRounding | None = None,
    global_amax: torch.Tensor | float | None = None,
    per_row_global: bool = False,
    mx_rule: str = "floor",
) -> nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor:
    """The quantized tensor a QAT site produces (no autograd); `fake_quant` dequantizes it."""
    if mode not in MODES:
        raise ValueError(f"fake-quant mode must be one of {', '.join(MODES)}; got {mode!r}")
    if fmt not in FORMATS:
        raise ValueError(f"fake-quant format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    x = x.detach()
    if mode == "guided":
        if fmt != "nvfp4":
            raise ValueError("guided rounding is defined for nvfp4 (E4M3 block scales); use mode='rtn' for mxfp4")
        if guidance is None:
            raise ValueError("mode='guided' needs the rollout's RolloutRounding for this site")
        return guided_quantize(
            x, guidance.scale, guidance.global_scale, codes=guidance.codes, mantissa=guidance.mantissa
        )
    if fmt == "mxfp4":
        return mxfp4.quantize(x, rule=mx_rule)
    return nvfp4.quantize(x, global_amax=global_amax, per_row_global=per_row_global)


def dequantize_any(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(q, mxfp4.MXFP4Tensor):
        return mxfp4.dequantize(q, dtype)
    return nvfp4.dequantize(q, dtype)


def fake_quant(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """quantize_site(x, **kwargs) dequantized to x's dtype, with a straight-through gradient."""
    return straight_through(x, dequantize_any(quantize_site(x, **kwargs), x.dtype))
