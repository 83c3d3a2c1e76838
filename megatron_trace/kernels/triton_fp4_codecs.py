"""Element codecs shared by the Triton FP4 kernels (quantize, GEMM, attention): E4M3 and E2M1
rounding/decoding and TRACE's guided choice of an E2M1 code, bit-identical with
`megatron_trace.fp4` (codecs.py, nvfp4.py, guided.py).

Exactness notes (the reason for the unusual code below):
* Triton's fp32 `/` is approximate on GPUs, so every division uses `tl.math.div_rn`, or fp64
  where the reference itself divides in fp64 (S_dec).
* E4M3 and E2M1 rounding are written as integer bit arithmetic and float comparisons, which
  mean the same in the interpreter and on the GPU; `.to(tl.float8e4nv)` is not used.
* `tl.minimum`/`tl.maximum` differ on NaN between the interpreter and the GPU, so clamps that
  may see NaN are `tl.where` with explicit comparisons.
* Kernels launch with float contraction disabled so no multiply is fused into a later add.

Importing this module imports triton; callers go through `megatron_trace.kernels.dispatch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.codecs import FLT_MAX as _FLT_MAX

FLT_MAX: tl.constexpr = tl.constexpr(_FLT_MAX)
ONE_SIXTH: tl.constexpr = tl.constexpr(nvfp4._ONE_SIXTH)  # fp32(1/6), exactly as TE writes it
SENC_NUM: tl.constexpr = tl.constexpr(448.0 * 6.0)

# jit decides at decoration time whether kernels run in the interpreter, so this records the
# mode the project's kernels actually have (CPU tensors work only when it is True).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def _clean_abs(x):
    """|x| with NaN -> 0 (Inf kept): amax ignores NaN the way fmaxf does."""
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def _e4m3_rn_satfinite(v):
    """fp32 -> E4M3FN byte as int32: round half even, |v| >= 448 (and Inf) -> 448, NaN -> 0x7F."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: clamp at the bits of 448.0 (saturation, and keeps the adds below from
    # overflowing), then round the 23-bit mantissa to 3 bits, ties to even; a mantissa carry
    # moves into the exponent as it should. 960 = (127 - 7) << 3 rebiases the exponent.
    m = tl.minimum(mag, 0x43E00000)
    normal = ((m + 0x7FFFF + ((m >> 20) & 1)) >> 20) - 960
    # Below 2^-6 the E4M3 value is k * 2^-9: k = round_half_even(significand >> shift).
    e = mag >> 23
    sig = (mag & 0x7FFFFF) | 0x800000
    # >= 25 always rounds to 0 since sig < 2^24; the floor only keeps the shift defined in
    # lanes that take the normal branch (negative shifts are poison in LLVM).
    shift = tl.minimum(tl.maximum(141 - e, 21), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0x3C800000, q, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _e4m3_decode(b):
    """E4M3FN byte (int32) -> fp32, NaN for 0x7F/0xFF."""
    exp = (b >> 3) & 0xF
    man = b & 7
    neg = (b & 0x80) != 0
    normal = (((b & 0x80) << 24) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # man * 2^-9, exact
    sub = tl.where(neg, -sub, sub)
    val = tl.where(exp == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def _e2m1_rn_satfinite(z):
    """fp32 -> E2M1 code (int32): ties to the even code, saturate at 6, NaN -> 7, -0 -> 8."""
    a = tl.abs(z)
    # Count the rounding boundaries below |z|; ">=" at 0.75/1.75/3.5 sends those ties up to the
    # even code, ">" at 0.25/1.25/2.5/5 sends them down.
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    nan = z != z
    code = tl.where(nan, 7, code)
    neg = (z.to(tl.int32, bitcast=True) < 0) & (~nan)
    return code | (neg.to(tl.int32) << 3)


@triton.jit
def _signed_code(idx, negative_zero):
    """Signed grid index (-7..7) -> E2M1 code; index 0 keeps the sign of negative_zero."""
    neg = (idx < 0) | ((idx == 0) & negative_zero)
    return tl.abs(idx) | (neg.to(tl.int32) << 3)


@triton.jit
def _guided_e2m1(z, ref, bit, FULL: tl.constexpr):
    """E2M1 code (int32) for z pinned to the rollout's rounding, as `fp4.guided._guided_codes`:
    the bracketing codewords lo <= z <= hi on the signed grid (z clipped to +-6, NaN as +6); full
    guidance (ref = the rollout's code) takes the bracket nearest ref (one step further either
    side when z is on the grid), keeping ref itself when it is chosen; mantissa guidance (bit)
    takes the bracket whose mantissa bit equals bit. NaN -> 7."""
    nan = z != z
    a = tl.abs(z)
    mag = tl.where(nan | (a > 6.0), 6.0, a)
    lo_m = (mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
    lo_m += (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)
    lo_m += (mag >= 6.0).to(tl.int32)
    grid = tl.where(lo_m <= 4, lo_m.to(tl.float32) * 0.5, tl.where(lo_m == 5, 3.0, tl.where(lo_m == 6, 4.0, 6.0)))
    on_grid = grid == mag
    hi_m = lo_m + (~on_grid).to(tl.int32)
    sign = z.to(tl.int32, bitcast=True) < 0
    neg = sign & (~nan)
    lo = tl.where(neg, -hi_m, lo_m)
    hi = tl.where(neg, -lo_m, hi_m)
    if FULL:
        widen = on_grid & (a <= 6.0)
        lo = tl.where(widen & (lo > -7), lo - 1, lo)
        hi = tl.where(widen & (hi < 7), hi + 1, hi)
        r = tl.where((ref & 8) != 0, -(ref & 7), ref & 7)
        pick = tl.where(r > hi, hi, tl.where(r < lo, lo, r))
        code = tl.where(pick == r, ref, _signed_code(pick, sign))
    else:
        code = _signed_code(tl.where((tl.abs(hi) & 1) == bit, hi, lo), sign)
    return tl.where(nan, 7, code)
