"""How the embedded engine runs each layer and each linear, decided here and nowhere else.

    model + KV cache ──► RunPlan (once per cache; `Engine.model_info()["cpu_layers"]` reports it)
      fused        the C kernels serve this run: CPU, fp32/bf16, pages in the model's dtype; else torch
      layers[i]    LayerPlan(mode, max_rows):
                     "one_call"  decode_layer, the whole layer in one C call (small dense layers)
                     "stream"    decode_layers_stream, runs of consecutive layers per call, <= max_rows tokens
                     "kernels"   per-kernel C (cpu_fused + EngineLinear.forward_cpu)
                     "torch"     _Layer.forward (not fused)
    per forward    RunPlan.modes(rows, captures): a layer falls back to "kernels" for a batch wider
                   than its max_rows, or when its guidance capture cannot be written by the C quantizers
    per linear     linear_stream_rows(lin): forward_cpu streams the weights as stored through
                   cpu_gemv up to this many rows, torch's GEMM above (benchmarks/cpu_linears.py)

layer_c.py executes the C modes; it decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import cpu_fused, cpu_gemv

from .guidance_log import LoggedCapture

# Up to this many rows (decode batches) a CPU linear streams its weights as stored through cpu_gemv
# (bytes-read bound decode); above it torch's GEMM over the dequantized copy, packed once for oneDNN
# (compute bound), except W4A4 up to W4A4_STREAM_MAX_ROWS: its integer row tiles stay ahead there
# (benchmarks/cpu_linears.py on the 0.5B widths: level with the packed GEMM at 8 rows, behind at 16).
STREAM_MAX_ROWS = 4
W4A4_STREAM_MAX_ROWS = 8
# Above this many MLP weights per layer a layer does not run as one decode_layer call: that kernel's
# GEMM is single-threaded over dequantized weights, which only small models (where one call saves
# more than threads would) should pay.
ONE_CALL_MAX_WEIGHTS = 1 << 22
# kv_side.fmt (cpu_fused.h) of each page format decode_layers_stream writes and reads
SIDE_CODES = {"bf16": 0, "nvfp4": 1, "fp8": 2}
LINEARS = ("qkv", "o_proj", "gate_up", "down")
MODES = ("one_call", "stream", "kernels", "torch")


@dataclass(frozen=True)
class LayerPlan:
    mode: str  # one of MODES
    max_rows: int = 0  # the widest batch "one_call" / "stream" take (wider: "kernels")


@dataclass(frozen=True)
class RunPlan:
    fused: bool
    layers: tuple[LayerPlan, ...]
    c_captures: bool  # the C quantizers can write this cache's K/V guidance (they log FP4 sides only)

    def modes(self, rows: int, captures) -> list[str]:
        """Each layer's mode for a batch of `rows` tokens with these per-layer capture objects."""
        out = []
        for lp, cap in zip(self.layers, captures):
            c_ok = cap is None or (self.c_captures and isinstance(cap, LoggedCapture))
            out.append(lp.mode if lp.mode in ("kernels", "torch") or (rows <= lp.max_rows and c_ok) else "kernels")
        return out

    def describe(self) -> str:
        """e.g. "24 streamed (<= 4 rows; wider: per kernel)" or "2 one-call GEMM, 2 per kernel"."""
        counts: dict[str, int] = {}
        for lp in self.layers:
            key = {
                "one_call": "one-call GEMM",
                "stream": f"streamed (<= {lp.max_rows} rows; wider: per kernel)",
                "kernels": "per kernel",
                "torch": "torch",
            }[lp.mode]
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in counts.items())


def plan_for(model, kv) -> RunPlan:
    """The plan of `model` (a QwenEngineModel) over `kv` (a PagedKVCache)."""
    if not fused(model, kv):
        return RunPlan(False, tuple(LayerPlan("torch") for _ in model.layers), False)
    layers = []
    for layer in model.layers:
        if _one_call(layer, kv):
            layers.append(LayerPlan("one_call", 1 << 62))
        elif _streams(layer, kv):
            layers.append(LayerPlan("stream", min(linear_stream_rows(lin) for lin in linears(layer))))
        else:
            layers.append(LayerPlan("kernels"))
    return RunPlan(True, tuple(layers), "fp8" not in kv.side_fmt)


def fused(model, kv) -> bool:
    """The C kernels serve CPU float32/bfloat16 runs whose KV pages share the model's dtype."""
    return (
        model.embed.device.type == "cpu"
        and cpu_fused.available(model.dtype)
        and (kv.fmt != "bf16" or kv.values.dtype == model.dtype)
        and kv.dtype == model.dtype
    )


def is_w4a4(lin) -> bool:
    return lin.weight_fmt == "nvfp4" and lin.act_fmt == "nvfp4" and isinstance(lin.qweight, nvfp4.NVFP4Tensor)


def linear_stream_rows(lin) -> int:
    """The most rows an EngineLinear's forward_cpu streams through cpu_gemv (above: torch's GEMM)."""
    return W4A4_STREAM_MAX_ROWS if is_w4a4(lin) else STREAM_MAX_ROWS


def linears(layer) -> list:
    """A dense layer's four EngineLinears, in the C arguments' order."""
    return [getattr(layer, n) for n in LINEARS]


def _dense(layer, kv, stream: bool = False) -> bool:
    """A dense layer whose activations are BF16 or NVFP4 in whole blocks, over BF16 or NVFP4 pages
    (stream: each side BF16, NVFP4 or FP8, so FP8 K + NVFP4 V too)."""
    pages_ok = all(f in SIDE_CODES for f in kv.side_fmt) if stream else kv.fmt in ("bf16", "nvfp4")
    if layer.moe or (layer.k_debias and not stream) or not pages_ok:  # decode_layer knows no K offset
        return False
    if not cpu_fused.available(layer.input_norm.dtype):
        return False
    return all(lin.act_fmt in (None, "nvfp4") and not (lin.act_fmt and lin.in_features % 16) for lin in linears(layer))


def _one_call(layer, kv) -> bool:
    return _dense(layer, kv) and layer.gate_up.in_features * layer.gate_up.out_features <= ONE_CALL_MAX_WEIGHTS


def _streams(layer, kv) -> bool:
    """A bf16 layer whose linears hold BF16 or NVFP4 weights (what forward_cpu streams) that
    decode_layer does not take (larger layers; small ones over FP8 or mixed pages)."""
    if not _dense(layer, kv, stream=True) or layer.input_norm.dtype != torch.bfloat16 or not cpu_gemv.available():
        return False
    return all(
        lin.weight_fmt is None or (lin.weight_fmt == "nvfp4" and isinstance(lin.qweight, nvfp4.NVFP4Tensor))
        for lin in linears(layer)
    )
