"""Element and scale codecs, bit-exact with NVIDIA's `cvt.rn.satfinite` conversions.

E2M1 (4-bit element): codes 0x0-0x7 are +{0, .5, 1, 1.5, 2, 3, 4, 6}, 0x8-0xF the negatives.
E4M3 (FP8 E4M3FN, used unsigned as the NVFP4 block scale). E8M0 (the MX power-of-two scale).
Every codec takes floating tensors, computes in fp32 (the hardware's input precision) and
returns uint8 codes; decoders return fp32.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

# Magnitudes of codes 0..7; adjacent ones alternate mantissa bits 0,1,0,1,...
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _prev_float(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(-1.0)).item()


# code(|x|) = number of boundaries strictly below |x|. Midpoints that tie to the upper (even)
# code are replaced by the float just below them, which turns "|x| >= m" into "|x| > m'".
_E2M1_BOUNDARIES = (0.25, _prev_float(0.75), 1.25, _prev_float(1.75), 2.5, _prev_float(3.5), 5.0)
_grid_cache: dict[torch.device, torch.Tensor] = {}


def e2m1_grid(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 code values as fp32 (index = code)."""
    device = torch.device(device)
    if device not in _grid_cache:
        pos = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
        _grid_cache[device] = torch.cat([pos, -pos])
    return _grid_cache[device]


def check_floating(x: torch.Tensor, what: str = "input") -> torch.Tensor:
    """x itself if it is a floating tensor; anything else is an error that names the dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating tensor (float32, bfloat16, float16, float64), got {x.dtype}")
    return x


def as_float32(x: torch.Tensor, what: str = "input") -> torch.Tensor:
    """fp32 view of a floating tensor; anything else is an error that names the dtype."""
    check_floating(x, what)
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _check_codes(codes: torch.Tensor, what: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {codes.dtype}")


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest E2M1, ties to the even code; saturate at +-6; NaN -> 0x7; -0 -> 0x8."""
    x = as_float32(x)
    mag = x.abs()
    # code = how many boundaries lie strictly below |x|: seven compares summed run ~4x faster on CPU
    # than torch.bucketize's per-element binary search (the trainer's fake-quant calls this per weight)
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for b in _E2M1_BOUNDARIES:
        code += mag > b
    nan = torch.isnan(x)
    sign = torch.signbit(x) & ~nan
    code = torch.where(nan, torch.full_like(code, 7), code)
    return code | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits used; values above 15 are an error) -> fp32 values."""
    _check_codes(codes, "E2M1 codes")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("E2M1 codes are 4-bit: values must be in 0..15 (unpack bytes first)")
    return e2m1_grid(codes.device)[codes.long()]


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3FN byte, round to nearest even, saturating at +-448 (Inf too); NaN -> 0x7F."""
    x = as_float32(x)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    _check_codes(b, "E4M3 bytes")
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_encode(x: torch.Tensor, rounding: str = "floor") -> torch.Tensor:
    """Positive scale -> E8M0 byte (2^(b-127)) with log2 rounded down ("floor") or up ("ceil").

    Exponents clamp to [-127, 127]; zero and negatives give 0x00, +Inf 0xFE, NaN 0xFF.
    """
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"e8m0 rounding must be 'floor' or 'ceil', got {rounding!r}")
    x = as_float32(x)
    mant, exp = torch.frexp(x)  # x = mant * 2^exp with mant in [0.5, 1)
    e = exp.to(torch.int32) - 1  # floor(log2 x) for finite positive x
    if rounding == "ceil":
        e = e + (mant != 0.5).to(torch.int32)
    b = (e.clamp(-127, 127) + 127).to(torch.uint8)
    b = torch.where(x > 0, b, torch.zeros_like(b))
    b = torch.where(torch.isinf(x) & (x > 0), torch.full_like(b, 0xFE), b)
    return torch.where(torch.isnan(x), torch.full_like(b, 0xFF), b)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    _check_codes(b, "E8M0 bytes")
    v = torch.ldexp(torch.ones(b.shape, dtype=torch.float64, device=b.device), b.to(torch.int32) - 127)
    v = v.to(torch.float32)
    return torch.where(b == 0xFF, torch.full_like(v, float("nan")), v)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K/2] bytes, element 2i in the low nibble."""
    _check_codes(codes, "FP4 codes")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (low nibble first)."""
    _check_codes(packed, "packed FP4 bytes")
    if packed.dim() == 0:
        raise ValueError("unpack_fp4 needs at least one dimension")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
