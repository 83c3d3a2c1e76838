"""Paged KV cache whose pages hold BF16/fp32, NVFP4 or MXFP4 K and V.

Token slots live in fixed-size pages; a request owns a list of pages. FP4 pages store the
packed E2M1 codes plus block scales along head_dim (NVFP4: E4M3 per 16 with a per-layer fp32
global scale, as SGLang's nvfp4 KV; MXFP4: E8M0 per 16 with the ceil rule, as SGLang's
fp4_mx_block16). Values are dequantized when attention reads them.
"""
from __future__ import annotations

import torch

from megatron_trace.fp4 import fast, mxfp4, nvfp4

KV_DTYPES = ("auto", "bf16", "nvfp4", "mxfp4")
MX_KV_BLOCK, MX_KV_RULE = 16, "ceil"


class OutOfPages(RuntimeError):
    pass


class PagedKVCache:
    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, num_pages: int, page_size: int,
                 kv_dtype: str, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
        self.fmt = "bf16" if kv_dtype == "auto" else kv_dtype
        if self.fmt != "bf16" and head_dim % 16:
            raise ValueError(f"FP4 KV needs head_dim divisible by 16; got {head_dim}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        slots = num_pages * page_size
        shape = (num_layers, 2, slots, kv_heads)
        if self.fmt == "bf16":
            self.values = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        else:
            self.codes = torch.zeros(*shape, head_dim // 2, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(*shape, head_dim // 16, dtype=torch.uint8, device=device)
        # Each layer's pages as views, made once: (K, V) values, or (K codes, K scales, V codes, V scales).
        self.layer_pages = [(self.values[i, 0], self.values[i, 1]) if self.fmt == "bf16" else
                            (self.codes[i, 0], self.scales[i, 0], self.codes[i, 1], self.scales[i, 1])
                            for i in range(num_layers)]
        # Per-layer S_enc for NVFP4 K and V (1.0 unless a checkpoint or the trainer sets it).
        self.global_scale = torch.ones(num_layers, 2, dtype=torch.float32, device=device)
        self.free_pages = list(range(num_pages - 1, -1, -1))

    # -- accounting --------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        """K and V of one token across all layers, as stored."""
        per_elem = {"bf16": torch.tensor([], dtype=self.dtype).element_size() * 8, "nvfp4": 4.5, "mxfp4": 4.5}[self.fmt]
        return self.num_layers * 2 * self.kv_heads * self.head_dim * per_elem / 8

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
        if self.fmt == "nvfp4":
            return fast.quantize_dequantize(x, global_scale=self.global_scale[layer, which])[0]
        if self.fmt == "mxfp4":
            return mxfp4.quantize(x, rule=MX_KV_RULE, block=MX_KV_BLOCK)
        return None

    def write(self, layer: int, which: int, slots: torch.Tensor, x: torch.Tensor, q=None,
              return_values: bool = True) -> torch.Tensor | None:
        """Store x at slots; returns the values attention will read back (dequantized for FP4)."""
        if self.fmt == "bf16":
            self.values[layer, which].index_copy_(0, slots, x.to(self.dtype))  # index_* beat x[idx] on CPU
            return x.to(self.dtype) if return_values else None
        if q is None and self.fmt == "nvfp4" and not return_values and fast.quantize_to_slots(
                x, self.global_scale[layer, which], self.codes[layer, which], self.scales[layer, which], slots):
            return None  # quantized straight into the pages
        q = self.quantize(layer, which, x) if q is None else q
        self.codes[layer, which].index_copy_(0, slots, q.data)
        self.scales[layer, which].index_copy_(0, slots, q.scale)
        return self._dequant(layer, which, q.data, q.scale) if return_values else None

    def read(self, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
        if self.fmt == "bf16":
            return self.values[layer, which].index_select(0, slots)
        if self.fmt == "nvfp4":  # gather + dequantize in one pass over the read slots only
            return fast.dequantize_rows(self.codes[layer, which], self.scales[layer, which], slots,
                                        self.global_scale[layer, which], self.dtype)
        return self._dequant(layer, which, self.codes[layer, which, slots], self.scales[layer, which, slots])

    def _dequant(self, layer: int, which: int, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return nvfp4.dequantize(nvfp4.NVFP4Tensor(data, scale, self.global_scale[layer, which]), self.dtype)
        return mxfp4.dequantize(mxfp4.MXFP4Tensor(data, scale, MX_KV_BLOCK), self.dtype)

    def scales_as_floats(self) -> tuple[list, list]:
        """NVFP4: per layer [S_dec of K, S_dec of V] and (S_enc of K, S_enc of V) as Python floats,
        converted again only after global_scale changed (its version counter moved)."""
        try:
            version = self.global_scale._version
        except RuntimeError:  # an inference-mode tensor keeps no version: convert every time
            version = None
        cached = self.__dict__.get("_scale_floats")
        if version is None or cached is None or cached[0] != version:
            cached = self._scale_floats = (version, nvfp4.decode_scale(self.global_scale).tolist(),
                                           [tuple(r) for r in self.global_scale.tolist()])
        return cached[1], cached[2]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from src slots to dst slots (prompt pages shared by n samples)."""
        if self.fmt == "bf16":
            self.values[:, :, dst] = self.values[:, :, src]
        else:
            self.codes[:, :, dst] = self.codes[:, :, src]
            self.scales[:, :, dst] = self.scales[:, :, src]
