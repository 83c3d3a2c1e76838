"""The SGLang linear methods of `trace_fp4` / `trace_mxfp4` (their configs: quant_config.py) with TRACE's FP4 rules.

Targets SGLang 0.5.23 (`LinearMethodBase` in python/sglang/srt/layers/quantization/base_config.py).
Without SGLang the classes derive from `object` and stay usable on CPU with any `torch.nn.Module`
as the layer.

NVFP4 (W4A4) loads our exported ModelOpt checkpoints: per layer `weight` uint8 [N, K/2],
`weight_scale` float8_e4m3fn [N, K/16], `weight_scale_2` and `input_scale` fp32, one per fused
output partition (q/k/v, gate/up). The loaders write each shard's rows in place, so these four
Parameters keep their storage across weight updates; everything derived from them (per-row
S_enc, swizzled scales, alpha, the dequantized weight of the fallback GEMM) is recomputed from
them by `process_weights_after_loading` and, lazily, by the first `apply` after a load.
Activations are quantized per token (or with the checkpoint's static input_scale) exactly as
`sglang_backend.local.layers.EngineLinear` does; the GEMM is SGLang's native FP4 GEMM on SM100+,
else `megatron_trace.kernels.dispatch.fp4_linear_w4a4` (Triton: the activation's codes times the weight as
stored, as EngineLinear on CUDA) on CUDA, else dequantize + F.linear (bit-identical to
EngineLinear on CPU).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_trace.fp4 import mxfp4, nvfp4
from megatron_trace.fp4.modelopt import encode_scale_from_decode
from megatron_trace.fp4.swizzle import swizzle_scales
from megatron_trace.kernels.dispatch import nvfp4_quantize_dequantize

from .. import plugin_settings as settings
from . import capture
from .layer_tp import narrow_tp, row_parallel_all_max, set_derived, sglang_attr

if TYPE_CHECKING:
    from .quant_config import TraceFP4Config

log = logging.getLogger(__name__)

try:  # SGLang's base when it is installed; a plain object otherwise (CPU tests, trainer nodes)
    from sglang.srt.layers.quantization.base_config import LinearMethodBase as _LinearBase

    HAVE_SGLANG = True
except Exception:  # noqa: BLE001 - a broken SGLang install must not break the import
    _LinearBase = object
    HAVE_SGLANG = False

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


# -- linear methods ---------------------------------------------------------------------------
class _TraceLinearBase(_LinearBase):
    def __init__(self, quant_config: TraceFP4Config | None = None, site: str | None = None):
        # quant_config builds these methods (imports this module), so its default is looked up when needed
        from .quant_config import TraceFP4Config, TraceMXFP4Config

        self.quant_config = quant_config or (TraceFP4Config() if self.FMT == "nvfp4" else TraceMXFP4Config())
        self.site = site

    FMT = "nvfp4"

    def _common(self, layer, k, output_partition_sizes, input_size, params_dtype):
        if k % self.quant_config.group_size:
            raise ValueError(
                f"{self.site}: in_features per partition {k} is not a multiple of {self.quant_config.group_size}"
            )
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition, layer.output_size_per_partition = k, sum(output_partition_sizes)
        layer.params_dtype, layer.trace_site, layer.trace_input_size = params_dtype, self.site, input_size
        layer._trace_dirty = True

    def _param(self, layer, name: str, data: torch.Tensor) -> None:
        p = nn.Parameter(data, requires_grad=False)
        p.trace_name = name
        p.weight_loader = functools.partial(self.load_shard, layer)
        if data.dim() == 2:
            p.output_dim, p.input_dim = 0, 1
        layer.register_parameter(name, p)

    @staticmethod
    def _shard(layer, shard_id) -> tuple[int, int, int | None]:
        widths = layer.logical_widths
        if shard_id is None:
            return 0, sum(widths), None
        idx = _SHARD_INDEX.get(shard_id, -1) if isinstance(shard_id, str) else int(shard_id)
        if not 0 <= idx < len(widths):
            raise KeyError(f"{layer.trace_site}: unknown shard {shard_id!r}; partitions {widths}")
        return sum(widths[:idx]), widths[idx], idx

    def _load_rows(self, layer, param, loaded: torch.Tensor, shard_id) -> None:
        off, rows, _ = self._shard(layer, shard_id)
        what = f"{layer.trace_site}:{shard_id}.{param.trace_name}"
        t = narrow_tp(loaded, 0, rows, layer, what, shard_id)
        t = narrow_tp(t, 1, param.shape[1], layer, what)  # row-parallel: this rank's K slice
        if tuple(t.shape) != (rows, param.shape[1]):
            raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != model shape {(rows, param.shape[1])}")
        param.data[off : off + rows].copy_(t.to(param.device))
        layer._trace_dirty = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.refresh(layer)


class TraceFP4LinearMethod(_TraceLinearBase):
    FMT = "nvfp4"

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        k, n, parts = input_size_per_partition, sum(output_partition_sizes), len(output_partition_sizes)
        self._common(layer, k, output_partition_sizes, input_size, params_dtype)
        self._param(layer, "weight", torch.zeros(n, k // 2, dtype=torch.uint8))
        self.modelopt_scales(layer, n, k, parts)

    def modelopt_scales(self, layer: nn.Module, rows: int, k: int, parts: int) -> None:
        """The ModelOpt NVFP4 scale tensors a checkpoint or an update loads into."""
        self._param(layer, "weight_scale", torch.zeros(rows, k // 16, dtype=torch.float8_e4m3fn))
        self._param(layer, "weight_scale_2", torch.zeros(parts, dtype=torch.float32))
        self._param(layer, "input_scale", torch.zeros(parts, dtype=torch.float32))  # 0 = absent: per-token scaling

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The weight_loader of all four tensors: one shard's (or an unfused layer's) tensor, written in place."""
        name = param.trace_name
        if name in ("weight_scale_2", "input_scale"):
            v = loaded.detach().reshape(-1).to(torch.float32)
            _, _, idx = self._shard(layer, shard_id)
            if v.numel() == 1:
                (param.data if idx is None else param.data[idx : idx + 1]).copy_(
                    v.expand(param.numel() if idx is None else 1)
                )
            elif idx is None and v.numel() == param.numel():
                param.data.copy_(v)
            else:
                raise ValueError(
                    f"{layer.trace_site}:{shard_id}.{name}: expected a scalar, got shape {tuple(loaded.shape)}"
                )
            layer._trace_dirty = True
            return
        if name == "weight" and loaded.dtype != torch.uint8:
            raise TypeError(f"{layer.trace_site}:{shard_id}.weight must be packed uint8 FP4; got {loaded.dtype}")
        if name == "weight_scale":
            loaded = loaded.view(torch.float8_e4m3fn) if loaded.dtype == torch.uint8 else loaded
            if loaded.dtype != torch.float8_e4m3fn:
                raise TypeError(f"{layer.trace_site}:{shard_id}.weight_scale must be float8_e4m3fn; got {loaded.dtype}")
        self._load_rows(layer, param, loaded, shard_id)

    # -- derived state --------------------------------------------------------------------------
    def refresh(self, layer: nn.Module) -> None:
        """Recompute every derived buffer from the (in-place) ModelOpt tensors."""
        s2, si = layer.weight_scale_2.data, layer.input_scale.data
        if not bool((s2 > 0).all()):  # `not >` also catches NaN
            raise ValueError(
                f"{layer.trace_site}: weight_scale_2 missing for partitions {(s2 <= 0).nonzero().flatten().tolist()}"
            )
        static = si > 0
        if bool(static.any()) and not bool(static.all()):
            raise ValueError(f"{layer.trace_site}: input_scale given for some fused shards only")
        if not bool((s2 == s2[0]).all()):
            log.warning(
                "%s: fused shards carry different weight_scale_2 %s; the native GEMM uses their max",
                layer.trace_site,
                s2.tolist(),
            )
        gs = torch.cat([encode_scale_from_decode(s2[i].cpu()).expand(w) for i, w in enumerate(layer.logical_widths)])
        set_derived(layer, "trace_weight_global_scale", gs.to(s2.device))
        in_gs = encode_scale_from_decode(si.max().cpu()).to(si.device) if bool(static.all()) else None
        set_derived(layer, "trace_input_global_scale", in_gs)
        alpha = (s2.max() * si.max()) if in_gs is not None else s2.max()
        set_derived(layer, "trace_alpha", alpha.to(torch.float32).reshape(()))
        set_derived(layer, "trace_weight_scale_swizzled", swizzle_scales(layer.weight_scale.data.view(torch.uint8)))
        kernel = self._packed_gemm(layer.weight)
        wdeq = (
            None
            if self._native(layer) or kernel
            else nvfp4.dequantize(self.quantized_weight(layer), layer.params_dtype)
        )
        set_derived(layer, "trace_weight_dequant", wdeq)
        layer._trace_dirty = False

    def quantized_weight(self, layer) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(
            layer.weight.data, layer.weight_scale.data.view(torch.uint8), layer.trace_weight_global_scale
        )

    # Off SM100: "auto" runs the Triton W4A4 GEMM for CUDA inputs; "triton" also for CPU inputs (under
    # TRITON_INTERPRET=1, how the tests reach it); "reference" keeps dequantize + F.linear.
    gemm_backend = "auto"

    def _packed_gemm(self, t: torch.Tensor) -> bool:
        """Whether the Triton W4A4 GEMM serves tensors like t (refresh then keeps no dequantized weight)."""
        wanted = self.gemm_backend == "triton" or (self.gemm_backend == "auto" and t.is_cuda)
        return wanted and _w4a4_kernel() is not None

    @staticmethod
    def _native(layer) -> bool:
        if settings.current().fp4_native == "0" or not layer.weight.is_cuda or not HAVE_SGLANG:
            return False
        ok = (
            torch.cuda.get_device_capability(layer.weight.device)[0] >= 10
            and sglang_attr("sglang.srt.layers.quantization.modelopt_quant", "fp4_gemm") is not None
        )
        aligned = layer.weight.shape[0] % 32 == 0 and layer.weight.shape[1] % 16 == 0
        return ok and aligned

    # -- forward --------------------------------------------------------------------------------
    def quantize_input(self, layer, x: torch.Tensor, want_dequant: bool = True):
        """(NVFP4Tensor, dequantized x or None): per token, or the static input scale; EngineLinear's bits.
        A row-parallel layer at TP > 1 sees a K slice of each token: its per-token scale is the
        full row's (`nvfp4.per_token_global_scale` with an all-reduce MAX over the TP group), as
        the trainer and the embedded engine (TP=1) have it."""
        gs = layer.trace_input_global_scale
        all_max = row_parallel_all_max(layer) if gs is None else None
        if all_max is not None:
            gs = nvfp4.per_token_global_scale(x, all_max)
            q = nvfp4.quantize(x, global_scale=gs)
            return q, (nvfp4.dequantize(q, x.dtype) if want_dequant else None)
        if x.device.type == "cpu":
            return nvfp4_quantize_dequantize(x, per_row_global=gs is None, global_scale=gs, dequant_dtype=x.dtype)
        from megatron_trace.kernels.dispatch import nvfp4_quantize

        q = nvfp4_quantize(x, global_scale=gs) if gs is not None else nvfp4_quantize(x, per_row_global=True)
        return q, (nvfp4.dequantize(q, x.dtype) if want_dequant else None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer._trace_dirty:
            self.refresh(layer)
        lead, x2 = x.shape[:-1], (x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))
        native = self._native(layer)
        packed = not native and layer.trace_weight_dequant is None and self._packed_gemm(x2)
        q, xq = self.quantize_input(layer, x2, want_dequant=not (native or packed))
        capture.record(layer.trace_site, q)
        if native:
            y = self._native_gemm(layer, q, x.dtype)
            y = y + bias if bias is not None else y
        elif packed:
            y = _w4a4_kernel()(q, self.quantized_weight(layer), bias, out_dtype=x.dtype, backend=self.gemm_backend)
        else:
            y = nn.functional.linear(xq, layer.trace_weight_dequant, bias)
        return y if x.dim() == 2 else y.reshape(*lead, y.shape[-1])

    @staticmethod
    def _native_gemm(layer, q: nvfp4.NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """SGLang's CUTLASS/FlashInfer FP4 GEMM; a per-token S_dec is applied to the output rows."""
        fp4_gemm = sglang_attr("sglang.srt.layers.quantization.modelopt_quant", "fp4_gemm")
        m, n = q.data.shape[0], layer.weight.shape[0]
        x_sf = swizzle_scales(q.scale).view(torch.float8_e4m3fn)
        w_sf = layer.trace_weight_scale_swizzled.view(torch.float8_e4m3fn)
        y = fp4_gemm(q.data, layer.weight.data, x_sf, w_sf, layer.trace_alpha.reshape(1), out_dtype, n)[:m, :n]
        if q.global_scale.dim():  # per-token activation scale: alpha held only the weight's S_dec
            y = (y.float() * nvfp4.decode_scale(q.global_scale).unsqueeze(-1)).to(out_dtype)
        return y


def _w4a4_kernel():
    """kernels.dispatch.fp4_linear_w4a4(q: NVFP4Tensor, weight: NVFP4Tensor, bias, ...) when importable."""
    return sglang_attr("megatron_trace.kernels.dispatch", "fp4_linear_w4a4")


class TraceMXFP4LinearMethod(_TraceLinearBase):
    """W4A4 MXFP4: BF16 weights quantized at load (rule from the config), activations per block of 32."""

    FMT = "mxfp4"

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        self._common(layer, input_size_per_partition, output_partition_sizes, input_size, params_dtype)
        self._param(
            layer, "weight", torch.zeros(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        )

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._load_rows(layer, param, loaded.to(param.dtype), shard_id)

    def refresh(self, layer: nn.Module) -> None:
        q = mxfp4.quantize(layer.weight.data.float(), rule=self.quant_config.mx_rule)
        set_derived(layer, "trace_weight_codes", q.data)
        set_derived(layer, "trace_weight_scales", q.scale)
        set_derived(layer, "trace_weight_dequant", mxfp4.dequantize(q, layer.params_dtype))
        layer._trace_dirty = False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks of 32 along K with no per-token scale: at TP > 1 a row-parallel layer's K chunk (a whole
        number of blocks, _common checks) quantizes to the full row's bytes there, so slot_capture's
        all-gather along K assembles TP=1's record as it does for NVFP4."""
        if layer._trace_dirty:
            self.refresh(layer)
        lead, x2 = x.shape[:-1], (x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))
        q = mxfp4.quantize(x2, rule=self.quant_config.mx_rule)
        capture.record(layer.trace_site, q)
        y = nn.functional.linear(mxfp4.dequantize(q, x.dtype), layer.trace_weight_dequant, bias)
        return y if x.dim() == 2 else y.reshape(*lead, y.shape[-1])
