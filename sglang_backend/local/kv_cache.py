"""Paged KV cache whose pages hold K and V each in BF16/fp32, NVFP4, MXFP4 or FP8.

Token slots live in fixed-size pages; a request owns a list of pages. K and V have their own
format (the policy's quant.kv_k / quant.kv_v). FP4 pages store the packed E2M1 codes plus block
scales along head_dim (NVFP4: E4M3 per 16 with a per-layer fp32 global scale, as SGLang's nvfp4
KV; MXFP4: E8M0 per 16 with the ceil rule, as SGLang's fp4_mx_block16); FP8 pages store E4M3
bytes with one fp32 decode scale per token over its KV heads (fp4.fp8). Values are dequantized when
attention reads them.

When K and V share a BF16, NVFP4 or MXFP4 format, both live in one [layers, 2, slots, ...] array
(`values`, or `codes` + `scales`), the layout the one-call C layer reads; otherwise (`fmt` is
"fp8" or "mixed") each side has its own arrays, `side_data[which]` and `side_scale[which]`.
"""

from __future__ import annotations

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import dispatch, kv_codec
from megatron_trace.models.quant_policy import kv_side_bits

KV_DTYPES = ("auto", *kv_codec.FORMATS)
SIDE_FORMATS = kv_codec.FORMATS
_PAIRED = ("bf16", "nvfp4", "mxfp4")  # formats whose K and V share one array when both sides use them


class OutOfPages(RuntimeError):
    pass


def _side_format(kv_dtype: str, name: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
    return "bf16" if kv_dtype == "auto" else kv_dtype


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        kv_dtype: str,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        k_dtype: str | None = None,
        v_dtype: str | None = None,
    ):
        """kv_dtype sets both sides; k_dtype / v_dtype (when given) override one side."""
        both = _side_format(kv_dtype, "kv_cache_dtype")
        self.k_fmt = _side_format(k_dtype, "k_dtype") if k_dtype else both
        self.v_fmt = _side_format(v_dtype, "v_dtype") if v_dtype else both
        self.side_fmt = (self.k_fmt, self.v_fmt)
        self.fmt = self.k_fmt if self.k_fmt == self.v_fmt else "mixed"
        if any(f != "bf16" for f in self.side_fmt) and head_dim % 16:
            raise ValueError(f"quantized KV needs head_dim divisible by 16; got {head_dim}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        slots = num_pages * page_size
        if self.fmt in _PAIRED:
            shape = (num_layers, 2, slots, kv_heads)
            if self.fmt == "bf16":
                self.values = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
                self.side_data, self.side_scale = [self.values[:, 0], self.values[:, 1]], [None, None]
            else:
                self.codes = torch.zeros(*shape, head_dim // 2, dtype=torch.uint8, device=device)
                self.scales = torch.zeros(*shape, head_dim // 16, dtype=torch.uint8, device=device)
                self.side_data = [self.codes[:, 0], self.codes[:, 1]]
                self.side_scale = [self.scales[:, 0], self.scales[:, 1]]
        else:
            made = [self._side_arrays(f, slots, device) for f in self.side_fmt]
            self.side_data, self.side_scale = [m[0] for m in made], [m[1] for m in made]
        # Each layer's pages as views, made once: (K values, V values) for BF16, else
        # (K data, K scales, V data, V scales) with None for the scales of a BF16 side.
        self.layer_pages = [
            (self.side_data[0][i], self.side_data[1][i])
            if self.fmt == "bf16"
            else tuple(t if t is None else t[i] for w in (0, 1) for t in (self.side_data[w], self.side_scale[w]))
            for i in range(num_layers)
        ]
        # Per-layer S_enc for NVFP4 K and V (1.0 unless a checkpoint or the trainer sets it).
        self.global_scale = torch.ones(num_layers, 2, dtype=torch.float32, device=device)
        self.free_pages = list(range(num_pages - 1, -1, -1))

    def _side_arrays(self, fmt: str, slots: int, device):
        shape = (self.num_layers, slots, self.kv_heads)
        d = self.head_dim
        if fmt == "bf16":
            return torch.zeros(*shape, d, dtype=self.dtype, device=device), None
        if fmt == "fp8":
            return (
                torch.zeros(*shape, d, dtype=torch.uint8, device=device),
                torch.ones(self.num_layers, slots, dtype=torch.float32, device=device),
            )
        return (
            torch.zeros(*shape, d // 2, dtype=torch.uint8, device=device),
            torch.zeros(*shape, d // 16, dtype=torch.uint8, device=device),
        )

    # -- accounting --------------------------------------------------------------------------
    def bits_per_element(self, which: int) -> float:
        """Stored bits per K (which=0) or V element, scales included."""
        bf16_bits = torch.tensor([], dtype=self.dtype).element_size() * 8
        return kv_side_bits(self.side_fmt[which], self.kv_heads * self.head_dim, bf16_bits)

    def bytes_per_token(self) -> float:
        """K and V of one token across all layers, as stored."""
        per_pair = self.bits_per_element(0) + self.bits_per_element(1)
        return self.num_layers * self.kv_heads * self.head_dim * per_pair / 8

    def pages_needed(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_pages):
            raise OutOfPages(f"KV cache needs {n} pages, {len(self.free_pages)} free of {self.num_pages}")
        return [self.free_pages.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        page_ids = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        return page_ids * self.page_size + pos % self.page_size

    # -- data --------------------------------------------------------------------------------
    def quantize(self, layer: int, which: int, x: torch.Tensor):
        """x [T, kv_heads, head_dim] -> the quantized form written to the cache (None for bf16)."""
        fmt = self.side_fmt[which]
        return None if fmt == "bf16" else kv_codec.quantize(fmt, x, nvfp4_scale=self.global_scale[layer, which])

    def write(
        self, layer: int, which: int, slots: torch.Tensor, x: torch.Tensor, q=None, return_values: bool = True
    ) -> torch.Tensor | None:
        """Store x at slots; returns the values attention will read back (dequantized if quantized)."""
        fmt, data, scale = self.side_fmt[which], self.side_data[which][layer], self.side_scale[which]
        if fmt == "bf16":
            data.index_copy_(0, slots, x.to(self.dtype))  # index_* beat x[idx] on CPU
            return x.to(self.dtype) if return_values else None
        if q is None and not return_values:  # quantized straight into the pages where a kernel takes it
            if fmt == "nvfp4" and dispatch.nvfp4_quantize_to_slots(
                x, self.global_scale[layer, which], data, scale[layer], slots
            ):
                return None
            if fmt == "fp8" and dispatch.fp8_quantize_to_slots(x, data, scale[layer], slots):
                return None
        q = self.quantize(layer, which, x) if q is None else q
        data.index_copy_(0, slots, q.data)
        scale[layer].index_copy_(0, slots, q.scale)
        return self._dequant(layer, which, q.data, q.scale) if return_values else None

    def read(self, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
        fmt, data, scale = self.side_fmt[which], self.side_data[which][layer], self.side_scale[which]
        if fmt == "bf16":
            return data.index_select(0, slots)
        if fmt == "nvfp4":  # gather + dequantize in one pass over the read slots only
            return dispatch.nvfp4_dequantize_rows(
                data, scale[layer], slots, self.global_scale[layer, which], self.dtype
            )
        return self._dequant(layer, which, data[slots], scale[layer][slots])

    def _dequant(self, layer: int, which: int, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        q = kv_codec.stored(self.side_fmt[which], data, scale, self.global_scale[layer, which])
        return kv_codec.dequantize(q, self.dtype)

    def scales_as_floats(self) -> tuple[list, list]:
        """NVFP4: per layer [S_dec of K, S_dec of V] and (S_enc of K, S_enc of V) as Python floats,
        converted again only after global_scale changed (its version counter moved)."""
        try:
            version = self.global_scale._version
        except RuntimeError:  # an inference-mode tensor keeps no version: convert every time
            version = None
        cached = self.__dict__.get("_scale_floats")
        if version is None or cached is None or cached[0] != version:
            cached = self._scale_floats = (
                version,
                nvfp4.decode_scale(self.global_scale).tolist(),
                [tuple(r) for r in self.global_scale.tolist()],
            )
        return cached[1], cached[2]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from src slots to dst slots (prompt pages shared by n samples)."""
        if self.fmt == "bf16":
            self.values[:, :, dst] = self.values[:, :, src]
        elif self.fmt in _PAIRED:
            self.codes[:, :, dst] = self.codes[:, :, src]
            self.scales[:, :, dst] = self.scales[:, :, src]
        else:
            for t in (*self.side_data, *self.side_scale):
                if t is not None:
                    t[:, dst] = t[:, src]
