"""Every FP4 bit of the project: codecs, NVFP4, MXFP4, FP8 E4M3 rows (the FP8 KV format), scale swizzle, ModelOpt tensors,
TRACE guided rounding and straight-through fake quantization. Pure torch; imports nothing
else of the project.
"""
from .codecs import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_encode,
    pack_fp4,
    unpack_fp4,
)
from .fp8 import FP8Tensor
from .fake_quant import RolloutRounding, fake_quant, quantize_site, straight_through
from .guided import guided_quantize, guided_quantize_mxfp4, mantissa_bits, mantissa_bits_packed, unpack_mantissa_bits
from .modelopt import from_modelopt, to_modelopt, to_modelopt_fused
from .mxfp4 import MXFP4Tensor
from .nvfp4 import NVFP4Tensor
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "FP8Tensor", "MXFP4Tensor", "NVFP4Tensor", "RolloutRounding",
    "e2m1_decode", "e2m1_encode", "e4m3_decode", "e4m3_encode", "e8m0_decode", "e8m0_encode",
    "fake_quant", "from_modelopt", "guided_quantize", "guided_quantize_mxfp4", "mantissa_bits", "mantissa_bits_packed", "pack_fp4",
    "quantize_site", "straight_through", "swizzle_scales", "to_modelopt", "to_modelopt_fused",
    "unpack_fp4", "unpack_mantissa_bits", "unswizzle_scales",
]
