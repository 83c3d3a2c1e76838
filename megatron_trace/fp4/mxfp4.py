"""MXFP4 (OCP Microscaling v1.0): 32-element blocks, E8M0 power-of-two scale, E2M1 elements.

rule="floor" (OCP): X = 2^(floor(log2 amax) - 2), values mapping into (6, 8) saturate.
rule="ceil" (TE reference, SGLang's KV path): X = 2^ceil(log2(amax / 6)), nothing saturates.
An all-zero block gets the smallest scale, 2^-127 (byte 0x00).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import as_float32, e2m1_decode, e2m1_encode, e8m0_decode, e8m0_encode, pack_fp4, unpack_fp4
from .nvfp4 import check_blocks, nan_free_amax

BLOCK = 32
RULES = ("floor", "ceil")
# The MXFP4 KV cache (SGLang's fp4_mx_block16): E8M0 per 16 with the ceil rule. The engine's
# pages and the trainer's QAT both take it from here.
KV_BLOCK, KV_RULE = 16, "ceil"


@dataclass
class MXFP4Tensor:
    data: torch.Tensor  # uint8 [..., K/2], element 2i in the low nibble
    scale: torch.Tensor  # uint8 E8M0 [..., K/block]
    block: int = BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.data.shape[-1] * 2)

    def codes(self) -> torch.Tensor:
        return unpack_fp4(self.data)


def block_scale_bytes(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """E8M0 scale byte for each block amax under `rule`."""
    if rule not in RULES:
        raise ValueError(f"MXFP4 scale rule must be one of {', '.join(RULES)}; got {rule!r}")
    amax = as_float32(amax, "amax")
    if rule == "floor":
        # floor(log2 amax) - 2: divide by 4 exactly, then floor the log.
        b = e8m0_encode(amax * 0.25, rounding="floor")
    else:
        b = e8m0_encode(amax / 6.0, rounding="ceil")
    return torch.where(amax > 0, b, torch.zeros_like(b))


def quantize(x: torch.Tensor, *, rule: str = "floor", block: int = BLOCK) -> MXFP4Tensor:
    """Quantize along the last dim. `block` is 32 for OCP MXFP4; 16 gives SGLang's fp4 KV layout."""
    x = as_float32(x)
    check_blocks(x, block, "MXFP4")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    sb = block_scale_bytes(nan_free_amax(xb, dim=-1), rule)
    exp = sb.to(torch.int32) - 127
    codes = e2m1_encode(torch.ldexp(xb, -exp.unsqueeze(-1))).reshape(x.shape)
    return MXFP4Tensor(pack_fp4(codes), sb, block)


def dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(q.data))
    vals = vals.reshape(*vals.shape[:-1], -1, q.block) * e8m0_decode(q.scale).unsqueeze(-1)
    return vals.reshape(q.shape).to(dtype)
