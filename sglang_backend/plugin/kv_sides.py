"""K and V cache in their own formats inside SGLang (the policy's quant.kv_k / quant.kv_v).

SGLang's pool takes one `--kv-cache-dtype` for K and V, but it lets the KV quant method own the
buffers (`MHATokenToKVPool._create_quantized_buffers`) and, for PLAIN access, hands attention
`dequantize_kv_tensor(buffer, scale_buffer, layer_id)` for each side (`_get_key_buffer`). So the
server runs with `--kv-cache-dtype nvfp4` (the FP4-KV plumbing and its argument checks) and this
method, chosen by `TRACE_KV_SIDES=<k>,<v>` (the launcher sets it), stores each side in its format
with the embedded engine's bits (`sglang_backend/local/kv_cache.py`):

    bf16   the model-dtype values, as bytes            data [slots, heads, D * itemsize]
    fp8    E4M3 bytes + one fp32 S_dec per token over  data [slots, heads, D], scale [slots, 4]
           all its KV heads (megatron_trace.fp4.fp8)   (the fp32 bytes)
    nvfp4  E2M1 codes + E4M3 per 16 + the per-layer    data [slots, heads, D/2], scale [.., D/16]
           global scale SGLang keeps (k/v_scales_gpu)
    mxfp4  E2M1 codes + E8M0 per 16, ceil rule         data [slots, heads, D/2], scale [.., D/16]
           (SGLang's fp4_mx_block16 layout)

At SGLang TP > 1 (KV heads split or replicated over the ranks) the FP8 per-token amax is
MAX-reduced over the TP group, so every rank stores TP=1's bytes for its heads.
Every buffer is uint8, so the pool's slot moves (data pointers and byte strides) stay valid.
Reads dequantize the whole layer, as SGLang's own PLAIN FP4 recipe does, so the method serves the
PLAIN backends of kv_read (torch_native) only and refuses others by name. Every quantized side is
captured for guidance (site `model.layers.{i}.self_attn.k_cache` / `v_cache`; MXFP4: the E8M0
bytes per 16 and a static S_enc of 1.0; FP8: the E4M3 bytes and S_enc per token), as the embedded
engine captures them; a BF16 side records nothing.
"""

from __future__ import annotations

import torch

from megatron_trace.kernels import kv_codec

from .. import plugin_settings as settings
from . import capture, kv_debias, kv_read
from .kv_capture import s_enc_of, sglang_nvfp4_base
from .slot_capture import SlotCapture

SIDES_ENV = settings.env_name("kv_sides")
SIDE_FORMATS = settings.SIDE_FORMATS
KV_SITE = "model.layers.{layer}.self_attn.{side}"


def sides_from_env() -> tuple[str, str] | None:
    """(K format, V format) the launcher asked for, None when it asked for none (a malformed value raises)."""
    return settings.current().kv_sides


def side_shapes(fmt: str, heads: int, head_dim: int, itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-slot shapes of (data, scale) for one side, in bytes (uint8 buffers)."""
    if fmt == "bf16":
        return (heads, head_dim * itemsize), (1,)  # no scale: a one-byte placeholder keeps the pool's lists
    if fmt == "fp8":
        return (heads, head_dim), (4,)
    if head_dim % 16:
        raise ValueError(f"{fmt} KV needs head_dim divisible by 16; got {head_dim}")
    return (heads, head_dim // 2), (heads, head_dim // 16)


def quantize_side(fmt: str, x: torch.Tensor, s_dec, dtype: torch.dtype, all_max=None):
    """x [T, heads, D] -> (data, scale) uint8 rows as stored, and the NVFP4Tensor / MXFP4Tensor /
    FP8Tensor for guidance (None for a BF16 side, which records nothing).
    `all_max`: MAX over the TP ranks that split the KV heads (FP8's per-token amax spans all heads)."""
    if fmt == "bf16":
        return (
            x.to(dtype).contiguous().view(torch.uint8).reshape(x.shape[0], x.shape[1], -1),
            torch.zeros(x.shape[0], 1, dtype=torch.uint8, device=x.device),
            None,
        )
    q = kv_codec.quantize(fmt, x, nvfp4_scale=s_enc_of(s_dec, x.device) if fmt == "nvfp4" else None, all_max=all_max)
    return q.data, (q.scale.reshape(-1, 1).view(torch.uint8) if fmt == "fp8" else q.scale), q


def dequantize_side(fmt: str, data: torch.Tensor, scale: torch.Tensor, s_dec, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows of one side -> values [slots, heads, D] in `dtype`."""
    data, scale = data.view(torch.uint8), scale.view(torch.uint8)
    if fmt == "bf16":
        return data.reshape(data.shape[0], data.shape[1], -1).view(dtype)
    if fmt == "fp8":  # one fp32 scale per token, stored as its 4 bytes
        scale = scale.contiguous().view(torch.float32).reshape(-1)
    s_enc = s_enc_of(s_dec, data.device) if fmt == "nvfp4" else None
    return kv_codec.dequantize(kv_codec.stored(fmt, data, scale, s_enc), dtype)


def side_bytes(fmt: str, heads: int, head_dim: int, itemsize: int) -> int:
    data, scale = side_shapes(fmt, heads, head_dim, itemsize)
    return int(torch.Size(data).numel() + torch.Size(scale).numel())


def _tp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_size)
    except Exception:  # noqa: BLE001 - no parallel state (a standalone pool): one rank
        return 1


def heads_all_max():
    """A MAX all-reduce over SGLang's TP group, which splits (or replicates) the KV heads of a layer
    (models/qwen2.py divides them by get_parallel().tp_size); None at TP=1. Replicated heads are
    duplicates, so the MAX is still the amax over all of a token's heads."""
    if _tp_size() <= 1:
        return None
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().tp_group

    def all_max(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().clone()
        pg = group.cpu_group if t.device.type == "cpu" else group.device_group
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=pg)
        return t

    return all_max


def per_side_method_class(sides: tuple[str, str], k_debias: bool = False):
    """The plugin's NVFP4 method (kv_read) with K and V stored as `sides` (None without SGLang);
    `k_debias`: a quantized K side holds K - RoPE_pos(k_proj bias) (kv_debias.py)."""
    base = kv_read.plain_read_method_class()
    _, mod = sglang_nvfp4_base()
    if base is None:
        return None
    k_fmt, v_fmt = sides
    debias = bool(k_debias) and k_fmt != "bf16"
    plain_kind = mod.KVCacheAttentionAccessKind.PLAIN

    class TracePerSideKVCacheMethod(base):
        side_formats = (k_fmt, v_fmt)
        records_guidance = True
        k_debias = debias
        k_biases = None  # {layer: kv_debias.LayerKBias}, bound from the model at its first forward

        def attention_accesses(self):
            return tuple(a for a in super().attention_accesses() if a.kind == plain_kind)

        def configure_attention_backends(self, prefill_backend: str, decode_backend: str) -> None:
            other = sorted({prefill_backend, decode_backend} - kv_read.PLAIN_BACKENDS)
            if other:
                raise ValueError(
                    f"K cache {k_fmt} + V cache {v_fmt} ({SIDES_ENV}) is read through the plugin's plain "
                    f"dequantized path, which serves attention backends {sorted(kv_read.PLAIN_BACKENDS)}; "
                    f"this server uses {other}: pass --attention-backend torch_native"
                )
            super().configure_attention_backends(prefill_backend, decode_backend)

        def needs_linear_scale_buffer(self) -> bool:
            return True

        def needs_native_fp4_scales(self) -> bool:
            return False

        def _read_dtype(self) -> torch.dtype:
            return getattr(torch, settings.current().kv_read_dtype)

        def create_buffers(self, size, head_num, head_dim, layer_num, device) -> dict:
            self._all_max = heads_all_max() if "fp8" in self.side_formats else None
            itemsize = torch.tensor([], dtype=self._read_dtype()).element_size()
            self._heads, self._head_dim = head_num, head_dim
            bufs = {}
            for side, fmt in zip("kv", self.side_formats):
                data, scale = side_shapes(fmt, head_num, head_dim, itemsize)
                bufs[f"{side}_buffer"] = [
                    torch.zeros(size, *data, dtype=torch.uint8, device=device) for _ in range(layer_num)
                ]
                bufs[f"{side}_scale_buffer"] = [
                    torch.zeros(size, *scale, dtype=torch.uint8, device=device) for _ in range(layer_num)
                ]
            self._layer_of = {t.data_ptr(): i for i, t in enumerate(bufs["k_buffer"])}
            self._layer_of_v = {t.data_ptr(): i for i, t in enumerate(bufs["v_buffer"])}
            self._slot_pos = kv_debias.SlotPositions(size, head_dim, device) if self.k_debias else None
            return {
                **bufs,
                "native_k_scale_buffer": None,
                "native_v_scale_buffer": None,
                "dq_k_buffer": None,
                "dq_v_buffer": None,
                "store_dtype": torch.uint8,
            }

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
            if native_k_scale_buffer is not None or native_v_scale_buffer is not None:
                raise ValueError("per-side KV stores linear scales only; the pool passed native FP4 scale buffers")
            loc = loc.to(torch.long)
            layer = self._layer_of.get(k_buffer.data_ptr())
            shape = (loc.shape[0], self._heads, self._head_dim)
            if self.k_debias:  # cache_k is RoPE(x W_k): qkv_proj left b out (kv_debias.hold_out_k_bias)
                self._slot_pos.write(loc, kv_debias.current_positions())
                self._k_bias(layer)  # bound, so qkv_proj holds b out
                cache_k = cache_k.reshape(shape).float()
            for side, fmt, buf, sbuf, x, s_dec in (
                ("k_cache", self.side_formats[0], k_buffer, k_scale_buffer, cache_k, k_scale),
                ("v_cache", self.side_formats[1], v_buffer, v_scale_buffer, cache_v, v_scale),
            ):
                data, scale, q = quantize_side(
                    fmt, x.reshape(shape), s_dec, self._read_dtype(), getattr(self, "_all_max", None)
                )
                buf.index_copy_(0, loc, data.reshape(loc.shape[0], *buf.shape[1:]))
                sbuf.index_copy_(0, loc, scale.reshape(loc.shape[0], *sbuf.shape[1:]))
                cap = capture.get_capture_buffer()
                if q is not None and layer is not None and isinstance(cap, SlotCapture):
                    cap.write(KV_SITE.format(layer=layer, side=side), loc, None, q)

        def _side_of(self, buffer) -> int:
            ptr = buffer.data_ptr()
            if ptr in self._layer_of:
                return 0
            if ptr in self._layer_of_v:
                return 1
            raise ValueError("dequantize_kv_tensor: the buffer is neither a K nor a V buffer of this pool")

        def _k_bias(self, layer) -> kv_debias.LayerKBias:
            if self.k_biases is None or layer not in self.k_biases:
                raise RuntimeError(
                    f"quant.kv_k_debias: no k_proj bias bound for KV layer {layer} (the plugin's forward hook binds "
                    "them from the model; is the trace_fp4 plugin's capture hook registered?)"
                )
            return self.k_biases[layer]

        def dequantize_kv_tensor(self, fp4_tensor, scales, layer_id, dtype=None):
            which, dt = self._side_of(fp4_tensor), dtype or self._read_dtype()
            s_dec = (self.k_scales_gpu if which == 0 else self.v_scales_gpu)[layer_id]
            out = dequantize_side(self.side_formats[which], fp4_tensor, scales, s_dec, dt)
            if which == 0 and self.k_debias:  # the engine's read: cache dtype + RoPE_pos(b) in fp32
                return (out.float() + self._slot_pos.offset(self._k_bias(layer_id))).to(dt)
            return out

        def dequantize_prev_kv(self, k_fp4, k_scales, v_fp4, v_scales, layer_id, dtype=None):
            if self.k_debias:
                raise NotImplementedError(
                    "quant.kv_k_debias: dequantize_prev_kv gets gathered rows without their slots, so their "
                    "positions are unknown; the de-biased K cache serves the plain read path (torch_native) only"
                )
            dt = dtype or self._read_dtype()
            return (
                dequantize_side(self.side_formats[0], k_fp4, k_scales, self.k_scales_gpu[layer_id], dt),
                dequantize_side(self.side_formats[1], v_fp4, v_scales, self.v_scales_gpu[layer_id], dt),
            )

        def compute_cell_size(self, head_num, head_dim, num_layers, kv_size) -> int:
            itemsize = torch.tensor([], dtype=self._read_dtype()).element_size()
            per_layer = sum(side_bytes(f, head_num, head_dim, itemsize) for f in self.side_formats)
            return per_layer * num_layers * kv_size

    TracePerSideKVCacheMethod.__name__ = TracePerSideKVCacheMethod.__qualname__ = (
        f"TracePerSideKVCacheMethod_{k_fmt}_{v_fmt}"
    )
    return TracePerSideKVCacheMethod
