"""Building blocks of the embedded engine: RMSNorm, RoPE and the (optionally FP4) linear.

Numerics follow HF transformers' Qwen modules (RMSNorm in fp32, RoPE cos/sin in fp32) so the
BF16/fp32 engine reproduces HF's logits; FP4 goes only through `megatron_trace.fp4` and the
`kernels` dispatcher.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
from torch import nn

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode
from megatron_trace.kernels import cpu_gemv, cpu_routes, onednn_linear
from megatron_trace.kernels.dispatch import (
    fp4_linear,
    fp4_linear_w4a4,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_dequantize,
    nvfp4_weight_quantize,
)
from megatron_trace.models import rope

from . import run_plan

# site name, quantized input (NVFP4Tensor), or None when the site is not captured
CaptureFn = Callable[[str, nvfp4.NVFP4Tensor], None]


def streaming_status() -> str:
    """What the CPU linears run on, for model_info and benchmarks: 'cpu_gemv/<isa>' or 'torch (<why
    the kernels are missing>)' at decode widths, then how torch's bf16 GEMMs above them run."""
    decode = f"cpu_gemv/{cpu_gemv.isa()}" if cpu_gemv.available() else f"torch ({cpu_gemv.unavailable_reason()})"
    why = onednn_linear.unavailable_reason()
    if why is None:
        return f"{decode}; gemm: onednn-packed"
    gemm = "fp32 on the bf16 up-cast" if cpu_routes.routes().bf16_gemm == "fp32" else "F.linear"
    return f"{decode}; gemm: {gemm} ({why})"


def lm_head_logits(h: torch.Tensor, weight: torch.Tensor, packed: onednn_linear.PackedWeight | None = None):
    """fp32 logits of h [T, hidden] (CPU): a bf16 head at decode widths streams through cpu_gemv
    (fp32 accumulation rounded to bf16, as torch's bf16 linear), wider ones through `packed` (the
    same bits as F.linear), everything else by this CPU's GEMM route (cpu_routes.linear)."""
    cpu_bf16 = h.device.type == "cpu" and weight.dtype == torch.bfloat16 and h.dtype == torch.bfloat16
    if cpu_bf16 and h.shape[0] <= run_plan.STREAM_MAX_ROWS and _streaming():
        return cpu_gemv.bf16_linear(h, weight).float()
    if packed is not None and onednn_linear.usable(h, weight):
        return packed.linear(h, weight, None, (weight.data_ptr(), weight._version)).float()
    return cpu_routes.linear(h, weight).float()


def _streaming() -> bool:
    """cpu_gemv is built; says once, loudly, when it is not (cpu_gemv logs the build error)."""
    if cpu_gemv.available():
        return True
    if not _WARNED:
        _WARNED.append(True)
        logging.getLogger(__name__).warning(
            "CPU decode runs torch matmuls over dequantized weights: %s", streaming_status()
        )
    return False


_WARNED: list = []


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class Rope:
    """Non-interleaved rotary embedding (rotate_half), cos/sin computed in fp32 like HF."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str = "cpu"):
        self.head_dim, self.theta, self.device = head_dim, theta, torch.device(device)
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of positions [T]: one forward computes them once for all layers."""
        cos, sin = rope.rotary_tables(positions, self.head_dim, self.theta)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def tables_upto(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [>= n, D] of positions 0, 1, ... holding `tables`' values (rounded to dtype
        like HF), kept and grown by doubling: the C kernels index them by position."""
        have = self._by_dtype.get(dtype)
        if have is None or have[0].shape[0] < n:
            size = max(64, 1 << max(n - 1, 1).bit_length())
            cos, sin = self.tables(torch.arange(size, device=self.device), dtype)
            have = self._by_dtype[dtype] = (cos[:, 0].float().contiguous(), sin[:, 0].float().contiguous())
        return have

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (q and k may share one call: the rotation is per head)."""
        return rope.apply(x, cos, sin)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D], positions [T]."""
        return self.apply(x, *self.tables(positions, x.dtype))


class EngineLinear(nn.Module):
    """A linear whose output rows are the concatenation of named shards (q/k/v, gate/up).

    Weights arrive per shard (BF16 or ModelOpt NVFP4) through `load_shard`; `finalize()` then
    quantizes BF16 weights with one global amax over all shards (the fused group's shared
    scale) and keeps the dequantized copy for the matmul. With `act_fmt` set, the input is
    quantized per token (or with a static scale) before the matmul: W4A4.
    """

    # FP4 GEMM: "auto" runs the Triton kernels (megatron_trace/kernels/fp4_gemm.py: NVFP4 weights read as stored,
    # dequantized in registers) for CUDA inputs and F.linear over the dequantized copy elsewhere;
    # "triton" also sends CPU inputs to the kernels (under TRITON_INTERPRET=1, how the tests reach
    # them); "reference" always takes F.linear.
    gemm_backend = "auto"

    def __init__(
        self,
        shards: dict[str, int],
        in_features: int,
        *,
        bias: bool,
        weight_fmt: str | None,
        act_fmt: str | None,
        dtype: torch.dtype,
        site: str | None = None,
        mx_rule: str = "floor",
        bias_held_out: str | None = None,
    ):
        super().__init__()
        self.shards = dict(shards)
        self.offsets, off = {}, 0
        for name, rows in self.shards.items():
            self.offsets[name] = (off, off + rows)
            off += rows
        self.in_features, self.out_features = in_features, off
        self.weight_fmt, self.act_fmt, self.site, self.mx_rule = weight_fmt, act_fmt, site, mx_rule
        self.weight = nn.Parameter(torch.zeros(off, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(off, dtype=dtype), requires_grad=False) if bias else None
        # A shard whose bias this linear loads but does not add (its rows of `bias` stay zero): K's under
        # quant.kv_k_debias, whose cache holds RoPE(x W_k) and adds RoPE(b) at read. Adding b in bf16 and
        # taking it away again would leave bf16's rounding of the large biased K in the small remainder.
        self.bias_held_out = bias_held_out
        self.held_bias = None
        if bias_held_out is not None:
            if not bias or bias_held_out not in self.offsets:
                raise ValueError(f"{site}: cannot hold out the bias of shard {bias_held_out!r} (bias={bias})")
            a, b = self.offsets[bias_held_out]
            self.held_bias = nn.Parameter(torch.zeros(b - a, dtype=dtype), requires_grad=False)
        self.qweight: nvfp4.NVFP4Tensor | mxfp4.MXFP4Tensor | None = None
        # BF16 source rows of an FP4 linear: a later update of one shard re-quantizes the group from
        # sources, never from already-dequantized values. The first BF16 shard load makes it (from
        # `weight`: zeros, or the FP4 rows an FP4 checkpoint left), so an engine that only gets FP4
        # tensors (a resumed one, refilled by the trainer's NVFP4 sync) never holds an fp32 copy.
        self.master: torch.Tensor | None = None
        self._modelopt_rows: dict[str, dict[str, torch.Tensor]] = {}
        self.input_global_scale: torch.Tensor | None = None  # static activation S_enc
        self.generation, self._wt_key, self._wt = 0, None, None  # bumped by every load (finalize); weight_t() cache
        self._packed = onednn_linear.PackedWeight()  # _torch_linear's cache

    # -- loading -----------------------------------------------------------------------------
    def _rows(self, shard: str) -> tuple[int, int]:
        if shard not in self.offsets:
            raise KeyError(f"unknown shard {shard!r}; this linear has {list(self.offsets)}")
        return self.offsets[shard]

    def load_shard(self, shard: str, tensor: torch.Tensor, kind: str = "weight", check_only: bool = False) -> None:
        """kind: weight | bias | ModelOpt tensor names (weight_packed, weight_scale, weight_scale_2, input_scale).
        check_only: raise what loading would raise about this tensor (its shard, its shape), write nothing."""
        a, b = self._rows(shard)
        if check_only:
            if kind == "bias":
                _check_shape(self.bias is not None and self.bias[a:b], tensor, f"{self.site}:{shard}.bias")
            elif kind in ("weight", "weight_packed"):
                cols = self.in_features // 2 if kind == "weight_packed" else self.in_features
                _check_shape(torch.empty(b - a, cols, device="meta"), tensor, f"{self.site}:{shard}.weight")
            return
        if kind == "bias":
            _check_shape(self.bias is not None and self.bias[a:b], tensor, f"{self.site}:{shard}.bias")
            dst = self.held_bias.data if shard == self.bias_held_out else self.bias.data[a:b]
            dst.copy_(tensor.to(self.bias.dtype))
        elif kind == "weight":
            _check_shape(self.weight[a:b], tensor, f"{self.site}:{shard}.weight")
            if self.weight_fmt is not None:
                if self.master is None:  # the first BF16 load, or BF16 updates after an FP4 checkpoint
                    self.master = self.weight.data.float().clone()
                self.master[a:b] = tensor.float()
            else:
                self.weight.data[a:b] = tensor.to(self.weight.dtype)
            self._modelopt_rows.pop(shard, None)
        else:
            self._modelopt_rows.setdefault(shard, {})[kind] = tensor

    def finalize(self) -> None:
        """Quantize (or adopt pre-quantized) weights once all shards are loaded."""
        self.generation += 1  # shard loads write through .data, which no version counter sees
        if self.weight_fmt is None:
            if self._modelopt_rows:
                raise ValueError(f"{self.site}: checkpoint holds FP4 tensors but the policy keeps it BF16")
            return
        if self.weight_fmt == "mxfp4":
            self.qweight = mxfp4.quantize(self.master, rule=self.mx_rule)
            self.weight.data = mxfp4.dequantize(self.qweight, self.weight.dtype)
            return
        self.qweight = self._nvfp4_weight()
        self.weight.data = nvfp4_dequantize(self.qweight, self.weight.dtype)
        scales = [t["input_scale"] for t in self._modelopt_rows.values() if "input_scale" in t]
        if scales:  # loaders take the max across fused shards
            self.input_global_scale = encode_scale_from_decode(
                torch.stack([s.float().reshape(()) for s in scales]).max()
            )
        self._modelopt_rows = {}

    def _nvfp4_weight(self) -> nvfp4.NVFP4Tensor:
        if not self._modelopt_rows:  # BF16 source: one shared global amax over the fused shards
            q = nvfp4_weight_quantize(self.master, global_amax=nvfp4.nan_free_amax(self.master))
            return nvfp4.NVFP4Tensor(q.data, q.scale, q.global_scale.expand(self.out_features).clone())
        missing = [s for s in self.shards if s not in self._modelopt_rows]
        if missing:
            raise ValueError(f"{self.site}: FP4 checkpoint lacks shards {missing}")
        self.master = None  # pre-quantized: the FP4 tensors are the source of truth now
        data, scale, gs = [], [], []
        for shard, rows in self.shards.items():
            t = self._modelopt_rows[shard]
            if "weight_packed" not in t or "weight_scale" not in t or "weight_scale_2" not in t:
                raise ValueError(f"{self.site}:{shard} needs weight, weight_scale and weight_scale_2; got {sorted(t)}")
            _check_shape(torch.empty(rows, self.in_features // 2), t["weight_packed"], f"{self.site}:{shard}.weight")
            data.append(t["weight_packed"])
            scale.append(t["weight_scale"].view(torch.uint8))
            gs.append(encode_scale_from_decode(t["weight_scale_2"].float().reshape(())).expand(rows))
        return nvfp4.NVFP4Tensor(torch.cat(data), torch.cat(scale), torch.cat(gs))

    # -- compute -----------------------------------------------------------------------------
    def quantize_input(self, x: torch.Tensor):
        if self.act_fmt == "mxfp4":
            return mxfp4.quantize(x, rule=self.mx_rule)
        if self.input_global_scale is not None:
            return nvfp4_quantize(x, global_scale=self.input_global_scale)
        return nvfp4_quantize(x, per_row_global=True)

    def forward(self, x: torch.Tensor, capture: CaptureFn | None = None, site: str | None = None) -> torch.Tensor:
        if self._packed_gemm(x):
            return self._forward_packed(x, capture, site)
        return self._torch_linear(self._matmul_input(x, capture, site))

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x . weight^T + bias by torch: bf16 on CPU through the oneDNN-packed weight (same bits) where
        oneDNN packs bf16 here, else by this CPU's GEMM route (cpu_routes.linear)."""
        w = self.weight
        if onednn_linear.usable(x, w):
            key = (w.data_ptr(), w._version, self.generation)  # as weight_t(): loads, load_state_dict
            return self._packed.linear(x, w, self.bias, key)
        return cpu_routes.linear(x, w, self.bias)

    def _packed_gemm(self, x: torch.Tensor) -> bool:
        """Whether this call runs the Triton FP4 GEMM: NVFP4 weights with NVFP4 or unquantized
        inputs. MXFP4 linears have no such kernel: on CUDA they say so once and take F.linear."""
        if self.gemm_backend == "reference" or not (x.is_cuda or self.gemm_backend == "triton"):
            return False
        if isinstance(self.qweight, nvfp4.NVFP4Tensor) and self.act_fmt in (None, "nvfp4"):
            return True
        if self.weight_fmt is not None or self.act_fmt is not None:
            _warn_no_packed_gemm(f"weights {self.weight_fmt or 'bf16'}, activations {self.act_fmt or 'bf16'}")
        return False

    def _forward_packed(self, x: torch.Tensor, capture: CaptureFn | None, site: str | None) -> torch.Tensor:
        """The NVFP4 weight as stored through megatron_trace.kernels.dispatch: W4A4 multiplies the activation's
        codes (quantized and reported to capture as `_matmul_input` does), W4A16 x itself."""
        if self.act_fmt == "nvfp4":
            q = self.quantize_input(x)
            if capture is not None:
                capture(site or self.site, q)
            return fp4_linear_w4a4(q, self.qweight, self.bias, out_dtype=x.dtype, backend=self.gemm_backend)
        return fp4_linear(x, self.qweight, self.bias, backend=self.gemm_backend)

    def forward_cpu(self, x: torch.Tensor, capture: CaptureFn | None = None, site: str | None = None) -> torch.Tensor:
        """The C-kernel forward's linear: decode widths (run_plan.linear_stream_rows) read the
        weights as stored (NVFP4 codes + scales, or BF16) through cpu_gemv, after the same activation
        quantization (and capture) as `forward`; W4A4 multiplies the activation codes themselves
        (fp4's dequantized values exactly, where `forward` rounds them to the model dtype first).
        Other widths, MXFP4 and fp32 weights: `forward`."""
        if x.device.type != "cpu" or x.shape[0] > run_plan.linear_stream_rows(self):
            return self.forward(x, capture, site)
        w4a4 = run_plan.is_w4a4(self)
        if self.weight_fmt == "nvfp4" and isinstance(self.qweight, nvfp4.NVFP4Tensor) and _streaming():
            w = self.qweight
            if w4a4:  # fp4 codes on both sides, exact integer block products
                gs = self.input_global_scale
                q, _ = nvfp4_quantize_dequantize(x, per_row_global=gs is None, global_scale=gs)
                if capture is not None:
                    capture(site or self.site, q)
                return cpu_gemv.w4a4_linear(
                    q.data,
                    q.scale,
                    nvfp4.decode_scale(q.global_scale),
                    w.data,
                    w.scale,
                    self.global_decode(),
                    self.bias,
                    out_dtype=x.dtype,
                )
            return cpu_gemv.nvfp4_linear(
                self._matmul_input(x, capture, site), w.data, w.scale, self.global_decode(), self.bias
            )
        if self.weight_fmt is None and self.weight.dtype == torch.bfloat16 and _streaming():
            return cpu_gemv.bf16_linear(self._matmul_input(x, capture, site), self.weight, self.bias)
        return self.forward(x, capture, site)

    def global_decode(self) -> torch.Tensor:
        """fp32 S_dec [N] of the NVFP4 weight (what fp4's dequantize multiplies by), per finalize."""
        if getattr(self, "_gdec_for", None) != (self.generation, id(self.qweight)):
            self._gdec = nvfp4.decode_scale(self.qweight.global_scale).float().expand(self.out_features).contiguous()
            self._gdec_for = (self.generation, id(self.qweight))
        return self._gdec

    def _matmul_input(self, x: torch.Tensor, capture: CaptureFn | None, site: str | None) -> torch.Tensor:
        """x, or with FP4 activations its quantize-dequantize (reported to capture)."""
        if self.act_fmt is not None:
            if self.act_fmt == "nvfp4" and x.device.type == "cpu":  # fused quantize + dequantize, same bits
                gs = self.input_global_scale
                q, xq = nvfp4_quantize_dequantize(x, per_row_global=gs is None, global_scale=gs, dequant_dtype=x.dtype)
            else:
                q = self.quantize_input(x)
                xq = mxfp4.dequantize(q, x.dtype) if self.act_fmt == "mxfp4" else nvfp4.dequantize(q, x.dtype)
            if capture is not None:
                capture(site or self.site, q)
            x = xq
        return x

    def weight_t(self) -> torch.Tensor:
        """The weight transposed to [in, out] (what the CPU layer kernel's GEMM reads), rebuilt
        whenever the weight changed: a new tensor or any in-place write bumps its version."""
        w = self.weight
        key = (w.data_ptr(), w._version, self.generation)  # loads bump generation, load_state_dict _version
        if self._wt_key != key:
            self._wt, self._wt_key = w.detach().t().contiguous(), key
        return self._wt

    def shard_view(self, shard: str, y: torch.Tensor) -> torch.Tensor:
        a, b = self._rows(shard)
        return y[..., a:b]


@functools.lru_cache(maxsize=None)
def _warn_no_packed_gemm(kind: str) -> None:
    logging.getLogger(__name__).warning(
        "no Triton FP4 GEMM for %s: these linears run F.linear over dequantized weights on CUDA", kind
    )


def _check_shape(dst, src: torch.Tensor, name: str) -> None:
    if dst is False:
        raise ValueError(f"{name}: this layer has no bias but the checkpoint provides one")
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
