"""NVFP4 KV for SGLang attention backends without native FP4 KV (the CPU engine's torch_native).

SGLang 0.5.23 describes how each attention backend reads a quantized KV pool
(`fp4_kv_cache_quant_method.KVCacheAttentionAccess`): PLAIN access with a packed storage dtype
makes the pool hand attention `quant_method.dequantize_kv_tensor(codes, scales, layer_id)`
(`MHATokenToKVPool._get_key_buffer`). SGLang's own NVFP4 method declares only FlashInfer/TRT-LLM
accesses and its server-argument check refuses other backends; this method adds PLAIN access
for `PLAIN_BACKENDS`, keeps linear [slots, heads, D/16] scales for it, and dequantizes with the
project's NVFP4 (`megatron_trace.fp4.nvfp4`: the same bits as the embedded engine's pages).
`allow_plain_backends` is the AROUND hook that lets the server-argument check pass for them.
"""

from __future__ import annotations

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode

from .. import plugin_settings as settings
from .kv_capture import sglang_kv_method_class, sglang_nvfp4_base

PLAIN_BACKENDS = frozenset({"torch_native"})
# SGLang's server-argument checks that refuse NVFP4 KV off Blackwell / off CUDA
ARGS_HOOK_TARGETS = (
    "sglang.srt.arg_groups.kv_cache_hook.handle_nvfp4_prefill_kv_dequant_dtype",
    "sglang.srt.arg_groups.kv_cache_hook.handle_kv4_compatibility",
)


# SGLang treats torch.float4_e2m1fn_x2 as an FP4 KV dtype only under CUDA (utils/common.py)
FP4_DTYPE_TARGET = "sglang.srt.utils.common.is_float4_e2m1fn_x2"


def fp4_dtype_anywhere(original, dtype, *args, **kwargs):
    return dtype == getattr(torch, "float4_e2m1fn_x2", None) or original(dtype, *args, **kwargs)


def allow_plain_backends(original, server_args, *args, **kwargs):
    backend = getattr(server_args, "attention_backend", None)
    prefill = getattr(server_args, "prefill_attention_backend", None) or backend
    decode = getattr(server_args, "decode_attention_backend", None) or backend
    if getattr(server_args, "kv_cache_dtype", None) == "nvfp4" and {prefill, decode} <= PLAIN_BACKENDS:
        return None  # the plugin's method reads these pools through plain dequantization
    return original(server_args, *args, **kwargs)


def plain_read_method_class():
    """SGLang's NVFP4 KV method + TRACE's writes (kv_capture) + plain dequantized reads (None without SGLang)."""
    base = sglang_kv_method_class()
    _, mod = sglang_nvfp4_base()
    if base is None or not hasattr(mod, "KVCacheAttentionAccess"):
        return None
    plain = [
        mod.KVCacheAttentionAccess(
            phase,
            mod.KVCacheAttentionAccessKind.PLAIN,
            mod.KVCacheBackendMatcher(exact=PLAIN_BACKENDS),
            storage_dtype=torch.uint8,
            scale_recipe="nvfp4",
        )
        for phase in (mod.KVCacheAttentionPhase.PREFILL, mod.KVCacheAttentionPhase.DECODE)
    ]

    def attention_accesses(self):
        return tuple(super(cls, self).attention_accesses()) + tuple(plain)

    def _plain_selected(self) -> bool:
        return any(a.kind == mod.KVCacheAttentionAccessKind.PLAIN for a in self.active_attention_accesses())

    def needs_linear_scale_buffer(self) -> bool:
        return _plain_selected(self) or super(cls, self).needs_linear_scale_buffer()

    def dequantize_kv_tensor(self, fp4_tensor, scales, layer_id, dtype=None):
        which = "k" if fp4_tensor.data_ptr() in getattr(self, "_layer_of", {}) else "v"
        s_dec = (self.k_scales_gpu if which == "k" else self.v_scales_gpu)[layer_id]
        s_enc = encode_scale_from_decode(s_dec.detach().float().cpu()).to(fp4_tensor.device)
        q = nvfp4.NVFP4Tensor(fp4_tensor.view(torch.uint8), scales.view(torch.uint8), s_enc)
        return nvfp4.dequantize(q, dtype or getattr(torch, settings.current().kv_read_dtype))

    cls = type(
        "TracePlainReadNVFP4KVCacheMethod",
        (base,),
        {
            "name": base.name,
            "attention_accesses": attention_accesses,
            "needs_linear_scale_buffer": needs_linear_scale_buffer,
            "dequantize_kv_tensor": dequantize_kv_tensor,
        },
    )
    return cls
