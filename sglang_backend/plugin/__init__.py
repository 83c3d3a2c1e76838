"""TRACE's SGLang plugin: FP4 linear/KV methods with guidance capture, registered via the
`sglang.srt.plugins` entry point (`register.register`). Importable without SGLang: every SGLang
import is guarded, and the layer methods are plain torch usable on CPU.
"""

from .capture import capture_batch, set_capture_buffer
from .kv_capture import TraceNVFP4KVMethod, quantize_kv
from .quant_config import TraceFP4Config, TraceMXFP4Config
from .quant_method import HAVE_SGLANG, TraceFP4LinearMethod, TraceMXFP4LinearMethod

__all__ = [
    "HAVE_SGLANG",
    "TraceFP4Config",
    "TraceFP4LinearMethod",
    "TraceMXFP4Config",
    "TraceMXFP4LinearMethod",
    "TraceNVFP4KVMethod",
    "capture_batch",
    "quantize_kv",
    "set_capture_buffer",
]
