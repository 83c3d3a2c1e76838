"""An independent scalar re-implementation of the FP4 numerics in numpy float32, written from
the hardware/TE definitions (not from megatron_trace.fp4), used as the second opinion in tests."""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FLT_MAX = np.finfo(np.float32).max


def e2m1(x: float) -> int:
    x = F32(x)
    if math.isnan(x):
        return 0x7
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(float(x)), 6.0)
    best = min(range(8), key=lambda c: (abs(GRID[c] - a), c % 2))  # nearest, ties to even code
    return sign | best


def e4m3_values() -> list[float]:
    vals = []
    for b in range(0x7F):  # 0x7F is NaN
        e, m = b >> 3, b & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


_E4M3 = e4m3_values()


def e4m3(x: float) -> int:
    x = float(F32(x))
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    best = min(range(0x7F), key=lambda b: (abs(_E4M3[b] - a), b % 2))
    return sign | best


def e4m3_value(b: int) -> float:
    return (-1.0 if b & 0x80 else 1.0) * _E4M3[b & 0x7F]


def nvfp4_row(xs: list[float], s_enc: float) -> tuple[list[int], list[int]]:
    """TE's sequence for one row (len % 16 == 0) with a given S_enc; returns (scale bytes, codes)."""
    s_enc = F32(s_enc)
    s_dec = F32(1.0 / np.float64(s_enc))
    scales, codes = [], []
    for i in range(0, len(xs), 16):
        blk = [F32(v) for v in xs[i : i + 16]]
        amax = F32(max([abs(v) for v in blk if not math.isnan(v)] or [0.0]))
        sf = e4m3(F32(amax * F32(s_enc * F32(1.0 / 6.0))))
        prod = F32(F32(e4m3_value(sf)) * s_dec)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            enc = F32(min(F32(F32(1.0) / prod), FLT_MAX))
            codes += [e2m1(F32(v * enc)) for v in blk]
        scales.append(sf)
    return scales, codes


def s_enc_from_amax(amax: float) -> float:
    amax = F32(amax)
    if amax == 0:
        return 1.0
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(min(F32(F32(2688.0) / amax), FLT_MAX))
    return 1.0 if s == 0 else float(s)


def fp8_row(xs: list[float]) -> tuple[list[int], float]:
    """FP8 E4M3 with one fp32 scale per row: (codes, S_dec). S_enc = 448 / amax (1 for amax 0 or
    Inf), codes e4m3(x * S_enc), S_dec = fp32(1 / fp64(S_enc))."""
    row = [F32(v) for v in xs]
    amax = F32(max([abs(v) for v in row if not math.isnan(v)] or [0.0]))
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(min(F32(F32(448.0) / amax), FLT_MAX)) if amax != 0 else F32(1.0)
    if amax == 0 or math.isinf(amax) or s == 0:
        s = F32(1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = [e4m3(F32(v * s)) for v in row]
    return codes, float(F32(1.0 / np.float64(s)))
