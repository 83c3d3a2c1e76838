"""NVFP4 KV cache writes with TRACE's quantizer, recorded into the batch's guidance capture (slot_capture).

Targets SGLang 0.5.23's KV quant-method contract (python/sglang/srt/layers/quantization/
fp4_kv_cache_quant_method.py, `KVCacheQuantMethodBase.quantize_and_store(k_buffer, v_buffer,
k_scale_buffer, v_scale_buffer, loc, cache_k, cache_v, k_scale=None, v_scale=None)`), called by
the KV pool's `set_kv_buffer`. Buffers are per layer: codes uint8 [size, heads, head_dim/2],
scales uint8 (E4M3 bytes) [size, heads, head_dim/16]. `k_scale`/`v_scale` are the per-layer
global scales in the decode direction (x = fp4 * block_scale * global_scale); we quantize with
S_enc = encode_scale_from_decode(global_scale), the same bits as `PagedKVCache` (per-layer S_enc,
E4M3 per 16 along head_dim).

`TraceNVFP4KVMethod` is the standalone (CPU-testable) method; `sglang_kv_method_class()` mixes
the same write path into SGLang's own NVFP4 method so its buffers, dequant and attention-access
rules stay SGLang's.
"""

from __future__ import annotations

import importlib

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode
from megatron_trace.kernels import kv_codec

from .capture import get_capture_buffer
from .slot_capture import SlotCapture

KV_METHOD_MODULES = (
    "sglang.srt.layers.quantization.fp4_kv_cache_quant_method",
    "sglang.srt.layers.quantization.kv_cache_quant_method",
)


def s_enc_of(s_dec, device) -> torch.Tensor:
    """NVFP4's per-layer S_enc (0-d) from SGLang's k_scale / v_scale, an S_dec (None is 1.0)."""
    s_dec = torch.as_tensor(1.0 if s_dec is None else s_dec, dtype=torch.float32)
    return encode_scale_from_decode(s_dec.detach().reshape(-1)[:1].reshape(()).cpu()).to(device)


def quantize_kv(x: torch.Tensor, s_dec) -> nvfp4.NVFP4Tensor:
    """x [T, heads, head_dim] -> NVFP4 (data [T, H, D/2], scale [T, H, D/16], S_enc 0-d): the
    codec the engine's pages and the trainer's QAT use (megatron_trace.kernels.kv_codec)."""
    return kv_codec.quantize("nvfp4", x, nvfp4_scale=s_enc_of(s_dec, x.device))


class _PlainNVFP4KVBase:
    """Buffers and dequantization of the NVFP4 KV layout in plain torch (no SGLang)."""

    def __init__(self, num_layers: int = 1, device: str = "cpu", **_):
        self.num_layers, self.device = num_layers, device
        self.k_scales_gpu = torch.ones(num_layers, dtype=torch.float32, device=device)  # decode direction
        self.v_scales_gpu = torch.ones(num_layers, dtype=torch.float32, device=device)

    def needs_global_scale(self) -> bool:
        return True

    def create_buffers(self, size, head_num, head_dim, layer_num, device) -> dict:
        def mk(d):
            return [torch.zeros(size, head_num, d, dtype=torch.uint8, device=device) for _ in range(layer_num)]

        return {
            "k_buffer": mk(head_dim // 2),
            "v_buffer": mk(head_dim // 2),
            "k_scale_buffer": mk(head_dim // 16),
            "v_scale_buffer": mk(head_dim // 16),
            "dq_k_buffer": None,
            "dq_v_buffer": None,
            "store_dtype": torch.uint8,
        }

    def dequantize_prev_kv(self, k_fp4, k_scales, v_fp4, v_scales, layer_id: int, dtype=torch.bfloat16):
        def dq(data, scale, s_dec):
            q = kv_codec.stored("nvfp4", data.view(torch.uint8), scale.view(torch.uint8), s_enc_of(s_dec, data.device))
            return kv_codec.dequantize(q, dtype)

        return dq(k_fp4, k_scales, self.k_scales_gpu[layer_id]), dq(v_fp4, v_scales, self.v_scales_gpu[layer_id])

    def compute_cell_size(self, head_num: int, head_dim: int, num_layers: int, kv_size: int) -> int:
        return head_num * (head_dim // 2 + head_dim // 16) * num_layers * 2 * kv_size


def trace_nvfp4_kv_method(base: type, class_name: str = "TraceNVFP4KVMethod", method_name: str = "nvfp4") -> type:
    """`base` (an NVFP4 KV method class: SGLang's, or the plain torch one below) with TRACE's
    quantize_and_store: one definition of the writes for both."""

    class TraceNVFP4KV(base):
        """quantize_and_store with TRACE's NVFP4 rules. Inside SGLang the K/V codes also go to the
        guidance capture of the batch (slot_capture), as sites model.layers.{i}.self_attn.k_cache / v_cache."""

        name = method_name
        SCALE_BLOCK_SIZE = 16
        records_guidance = True  # slot_capture refuses guidance with a KV method that does not

        def bind_layers(self, k_buffers, v_buffers=None) -> None:
            """Remember which layer each per-layer buffer belongs to (the capture is keyed by layer)."""
            self._layer_of = {t.data_ptr(): i for i, t in enumerate(k_buffers)}

        def create_buffers(self, size: int, head_num: int, head_dim: int, layer_num: int, device: str) -> dict:
            bufs = super().create_buffers(size, head_num, head_dim, layer_num, device)
            self.bind_layers(bufs["k_buffer"], bufs["v_buffer"])
            return bufs

        def quantize_and_store(
            self,
            k_buffer,
            v_buffer,
            k_scale_buffer,
            v_scale_buffer,
            loc,
            cache_k,
            cache_v,
            k_scale=None,
            v_scale=None,
            native_k_scale_buffer=None,
            native_v_scale_buffer=None,
        ) -> None:
            """SGLang 0.5.23's signature. Scales go to the linear [slots, heads, D/16] buffers and/or, on SM100's
            trtllm_mha layout, the native [pages, heads, page_size, D/16] ones (V with TRT-LLM's four-token
            interleave, as sglang/srt/layers/quantization/nvfp4_kv_cache.py stores them); the linear ones are
            None there."""
            linear, native = k_scale_buffer is not None, native_k_scale_buffer is not None
            if linear != (v_scale_buffer is not None) or native != (native_v_scale_buffer is not None):
                raise ValueError("NVFP4 KV: K and V scale buffers of one layout must be given together")
            if not (linear or native):
                raise ValueError("NVFP4 KV: neither linear nor native scale buffers were given")
            qk, qv = quantize_kv(cache_k, k_scale), quantize_kv(cache_v, v_scale)
            loc = loc.to(torch.long)
            for buf, sbuf, q in ((k_buffer, k_scale_buffer, qk), (v_buffer, v_scale_buffer, qv)):
                buf.view(torch.uint8).index_copy_(0, loc, q.data.reshape((loc.shape[0], *buf.shape[1:])))
                if linear:
                    sbuf.view(torch.uint8).index_copy_(0, loc, q.scale.reshape((loc.shape[0], *sbuf.shape[1:])))
            if native:
                self._store_native_scales(native_k_scale_buffer, native_v_scale_buffer, loc, qk.scale, qv.scale)
            layer = getattr(self, "_layer_of", {}).get(k_buffer.data_ptr())
            guidance = get_capture_buffer()
            if layer is not None and isinstance(guidance, SlotCapture):
                for side, q in (("k_cache", qk), ("v_cache", qv)):
                    guidance.write(f"model.layers.{layer}.self_attn.{side}", loc, None, q)

        def _store_native_scales(self, nk, nv, loc, k_sf, v_sf) -> None:
            page_size = getattr(self, "page_size", None)
            if not page_size or page_size % 4:
                raise ValueError(
                    f"native NVFP4 KV scales need a page_size divisible by 4; the method has {page_size!r}"
                )
            sd = k_sf.shape[-1]
            if sd % 4:
                raise ValueError(f"native NVFP4 KV scales need head_dim divisible by 64; scale_dim is {sd}")
            page, tok = loc // page_size, loc % page_size
            nk.view(torch.uint8)[page, :, tok] = k_sf.to(torch.uint8)  # [T, heads, D/16]
            col = torch.arange(sd, device=loc.device)
            group = sd // 4
            row = (tok[:, None] // 4) * 4 + col[None, :] // group  # [T, D/16]: the four-token interleave
            pos = (col[None, :] % group) * 4 + tok[:, None] % 4
            nv.view(torch.uint8)[page[:, None], :, row, pos] = v_sf.to(torch.uint8).permute(0, 2, 1)  # [T, D/16, heads]

    TraceNVFP4KV.__name__ = TraceNVFP4KV.__qualname__ = class_name
    return TraceNVFP4KV


# Standalone method: the same writes as inside SGLang, testable on CPU.
TraceNVFP4KVMethod = trace_nvfp4_kv_method(_PlainNVFP4KVBase)


def sglang_nvfp4_base():
    """SGLang's NVFP4 KV method class and the module holding KV_CACHE_QUANT_REGISTRY (None, None if absent)."""
    for mod_name in KV_METHOD_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001
            continue
        base = getattr(mod, "NVFP4KVCacheMethod", None) or getattr(mod, "NVFP4Method", None)
        if base is not None and hasattr(mod, "KV_CACHE_QUANT_REGISTRY"):
            return base, mod
    return None, None


def sglang_kv_method_class():
    """SGLang's NVFP4 KV method with TRACE's quantize_and_store (None without SGLang)."""
    base, _ = sglang_nvfp4_base()
    if base is None:
        return None
    return trace_nvfp4_kv_method(base, "TraceSGLangNVFP4KVCacheMethod", getattr(base, "name", "nvfp4"))
