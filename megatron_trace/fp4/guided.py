"""TRACE rounding: pin the trainer's FP4 rounding to the codeword the rollout used (NVFP4, and
MXFP4 with the rollout's E8M0 block scales: `guided_quantize_mxfp4`).

The trainer's activation x is scaled with the rollout's own block scale and global scale
(z = x * enc, the quantizer's exact arithmetic), clipped to +-6, and bracketed by the two
adjacent E2M1 codewords lo <= z <= hi. Of the two, we keep:
  - full guidance: the one closer to the rollout's codeword (a z exactly on a grid point is
    bracketed by its two neighbours); when that is the rollout's codeword, its exact code is
    returned (so -0 and +0 agree too);
  - mantissa guidance: the one whose mantissa bit equals the rollout's bit. Adjacent E2M1
    magnitudes alternate mantissa bits (and so do -0.5, 0, +0.5), so one bit names one of the two.
Either choice is lo or hi, and round-to-nearest is also lo or hi. Full guidance therefore never
moves the trainer further from the rollout's codeword than round-to-nearest would. Mantissa
guidance gives that guarantee only while the rollout's codeword is lo or hi (the two sides within
one codeword): further apart, the bit names whichever bracket shares the rollout's parity, which
can be the farther one, and around zero (-0.5, 0, +0.5) that can mean the opposite sign. How
often that happens is measured, not assumed: the probe scores mantissa mode against the rollout's
full codes (tests/test_fp4_guided.py shows both cases).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import mxfp4
from .codecs import E2M1_MAX, as_float32, e2m1_grid, pack_fp4, unpack_fp4
from .nvfp4 import BLOCK, NVFP4Tensor, check_blocks, encode_with_scales

# What the rollout records per element (`guidance.mode`): its 4-bit code, or its mantissa bit.
GUIDANCE_MODES = ("full", "mantissa")


@dataclass
class RolloutRounding:
    """What the rollout recorded at one quantization site for a [..., K] activation: the input of
    `guided_quantize` (exactly one of codes / mantissa is set)."""

    scale: torch.Tensor  # uint8 E4M3 block scales [..., K/16]
    global_scale: torch.Tensor  # fp32 S_enc, 0-d or one per row
    codes: torch.Tensor | None = None  # packed codes [..., K/2] (full guidance)
    mantissa: torch.Tensor | None = None  # packed mantissa bits [..., K/8]


_UPPER = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # grid magnitudes above 0
_upper_cache: dict[torch.device, torch.Tensor] = {}


def _upper(device) -> torch.Tensor:
    if device not in _upper_cache:
        _upper_cache[device] = torch.tensor(_UPPER, dtype=torch.float32, device=device)
    return _upper_cache[device]


def signed_index(codes: torch.Tensor) -> torch.Tensor:
    """Codes -> position on the signed grid, -7..7 (both zeros are 0); neighbours differ by 1."""
    mag = (codes & 7).to(torch.int8)
    return torch.where((codes & 8) != 0, -mag, mag)


def bracket_indices(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed-grid indices lo <= hi of the codewords around z (clipped to +-6), and z's on-grid mask.

    On the grid lo == hi. NaN counts as +6, the code E2M1 conversion gives it.
    """
    nan = torch.isnan(z)
    mag = torch.where(nan, torch.full_like(z, E2M1_MAX), z.abs().clamp_max(E2M1_MAX))
    lo_m = torch.bucketize(mag, _upper(z.device), right=True).to(torch.int8)  # grid points <= mag
    on_grid = e2m1_grid(z.device)[lo_m.long()] == mag
    hi_m = lo_m + (~on_grid).to(torch.int8)
    neg = torch.signbit(z) & ~nan
    lo = torch.where(neg, -hi_m, lo_m)
    hi = torch.where(neg, -lo_m, hi_m)
    return lo, hi, on_grid & (z.abs() <= E2M1_MAX)


def codes_from_index(idx: torch.Tensor, negative_zero: torch.Tensor) -> torch.Tensor:
    code = idx.abs().to(torch.uint8)
    neg = (idx < 0) | ((idx == 0) & negative_zero)
    return code | (neg.to(torch.uint8) << 3)


def mantissa_bits(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] unpacked 4-bit codes -> [..., K/8] bytes of mantissa bits (element 8i+j at bit j)."""
    if codes.dtype != torch.uint8 or codes.dim() == 0 or codes.shape[-1] % 8:
        raise ValueError(
            f"mantissa_bits takes uint8 codes [..., K] with K a multiple of 8; got {codes.dtype} {tuple(codes.shape)}"
        )
    bits = (codes & 1).reshape(*codes.shape[:-1], -1, 8).to(torch.int32)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=codes.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def mantissa_bits_packed(packed: torch.Tensor) -> torch.Tensor:
    """mantissa_bits(unpack_fp4(packed)) straight from packed codes [..., K/2] (low nibble first).
    The reference; the engine's C pass of it is megatron_trace.kernels.dispatch.mantissa_bits_packed."""
    if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] % 4:
        raise ValueError(
            f"mantissa_bits_packed takes packed uint8 codes [..., K/2] with K a multiple of 8; "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    # bit 0 of each nibble is the mantissa bit; four bytes (eight codes) make one output byte
    p = packed.reshape(*packed.shape[:-1], -1, 4)
    pairs = (p & 1) | ((p >> 3) & 2)  # bit 0: element 2i (low nibble), bit 1: element 2i + 1 (high nibble)
    return pairs[..., 0] | (pairs[..., 1] << 2) | (pairs[..., 2] << 4) | (pairs[..., 3] << 6)


def unpack_mantissa_bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/8] bytes -> [..., K] bits (uint8 0/1)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def check_guidance(x: torch.Tensor, scale, global_scale, codes, mantissa, block: int = BLOCK) -> None:
    if (codes is None) == (mantissa is None):
        raise ValueError("guided rounding needs exactly one of codes= (full) or mantissa= (1 bit per element)")
    k = x.shape[-1]
    expect = {"scale": (scale, k // block)}
    if codes is not None:
        expect["codes"] = (codes, k // 2)
    else:
        expect["mantissa"] = (mantissa, k // 8)
    for name, (t, last) in expect.items():
        if t.dtype != torch.uint8:
            raise TypeError(f"guidance {name} must be uint8; got {t.dtype}")
        if tuple(t.shape) != (*x.shape[:-1], last):
            raise ValueError(
                f"guidance {name} has shape {tuple(t.shape)} but x {tuple(x.shape)} needs {(*x.shape[:-1], last)}"
            )
    if global_scale is None:  # MXFP4: block scales only
        return
    gs = torch.as_tensor(global_scale)
    if gs.dim() and tuple(gs.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"global_scale must be 0-d or one per row {tuple(x.shape[:-1])}; got {tuple(gs.shape)}")


def guided_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    codes: torch.Tensor | None = None,
    mantissa: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """Quantize x with the rollout's scales, rounding each element as the rollout did.

    scale: the rollout's E4M3 block-scale bytes [..., K/16]; global_scale: its S_enc (0-d or per row);
    codes: the rollout's packed codes [..., K/2] (full guidance) or
    mantissa: its packed mantissa bits [..., K/8] (from `mantissa_bits`).
    """
    x = as_float32(x)
    check_blocks(x, BLOCK, "NVFP4")
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    check_guidance(x, scale, global_scale, codes, mantissa)
    z = encode_with_scales(x, scale, global_scale).reshape(x.shape)
    return NVFP4Tensor(pack_fp4(_guided_codes(z, codes, mantissa)), scale, global_scale)


def guided_quantize_mxfp4(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    codes: torch.Tensor | None = None,
    mantissa: torch.Tensor | None = None,
    block: int = mxfp4.BLOCK,
) -> mxfp4.MXFP4Tensor:
    """MXFP4 with the rollout's E8M0 block-scale bytes [..., K/block] (either scale rule: the rule
    only chose the bytes), rounding each element as the rollout did: z = x * 2^-(scale - 127), the
    quantizer's exact arithmetic, then the same bracket choice as NVFP4 (values mapping past 6,
    which the floor rule allows, bracket as 6)."""
    x = as_float32(x)
    check_blocks(x, block, "MXFP4")
    check_guidance(x, scale, None, codes, mantissa, block=block)
    exp = scale.to(torch.int32) - 127
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    z = torch.ldexp(xb, -exp.unsqueeze(-1)).reshape(x.shape)
    return mxfp4.MXFP4Tensor(pack_fp4(_guided_codes(z, codes, mantissa)), scale, block)


def _guided_codes(z: torch.Tensor, codes: torch.Tensor | None, mantissa: torch.Tensor | None) -> torch.Tensor:
    """Unpacked 4-bit codes for the scaled values z, pinned to the rollout's codes or mantissa bits."""
    lo, hi, on_grid = bracket_indices(z)
    if codes is not None:
        ref = unpack_fp4(codes)
        r = signed_index(ref)
        # On a grid point the value brackets both ways: one codeword either side still counts.
        lo = torch.where(on_grid, (lo - 1).clamp_min(-7), lo)
        hi = torch.where(on_grid, (hi + 1).clamp_max(7), hi)
        pick = torch.maximum(torch.minimum(r, hi), lo)
        out = torch.where(pick == r, ref, codes_from_index(pick, torch.signbit(z)))
    else:
        bit = unpack_mantissa_bits(mantissa).to(torch.int8)
        pick = torch.where((hi.abs() & 1) == bit, hi, lo)
        out = codes_from_index(pick, torch.signbit(z))
    return torch.where(torch.isnan(z), torch.full_like(out, 7), out)
