"""Every FP4 bit of the project: codecs, NVFP4, MXFP4, FP8 E4M3 rows (the FP8 KV format), scale
swizzle, ModelOpt tensors, TRACE guided rounding and the straight-through estimator QAT uses.
Pure torch; imports nothing else of the project.
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
from .guided import (
    GUIDANCE_MODES,
    RolloutRounding,
    guided_quantize,
    guided_quantize_mxfp4,
    mantissa_bits,
    mantissa_bits_packed,
    unpack_mantissa_bits,
)
from .modelopt import from_modelopt, to_modelopt, to_modelopt_fused
from .mxfp4 import MXFP4Tensor
from .nvfp4 import NVFP4Tensor
from .straight_through import dequantize_any, straight_through
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "FP8Tensor",
    "GUIDANCE_MODES",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "RolloutRounding",
    "dequantize_any",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "e8m0_decode",
    "e8m0_encode",
    "from_modelopt",
    "guided_quantize",
    "guided_quantize_mxfp4",
    "mantissa_bits",
    "mantissa_bits_packed",
    "pack_fp4",
    "straight_through",
    "swizzle_scales",
    "to_modelopt",
    "to_modelopt_fused",
    "unpack_fp4",
    "unpack_mantissa_bits",
    "unswizzle_scales",
]
