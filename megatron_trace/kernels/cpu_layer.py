"""One C call per dense decoder layer for the embedded engine on CPU (`cpu_layer_typed.h`): the
fused kernels chained with a small GEMM, so a decode step crosses from Python into C once per
layer instead of ~12 times. `run_stream` runs several larger bf16 layers at decode widths in one
call and one parallel region, their linears streaming the weights as stored
(`cpu_layer_stream.cpp`).

    x ─► add+RMSNorm ─► [NVFP4 act quant?] ─► qkv GEMM ─► q/k norm, RoPE ─► K/V into pages
      ─► paged attention ─► [act quant?] ─► o GEMM ─► add+RMSNorm ─► [act quant?] ─► gate_up GEMM
      ─► SiLU·up ─► [act quant?] ─► down GEMM ─► residual for the next layer
Activation and KV quantization are the C quantizers every CPU path uses (`cpu_quant.c`). Dense
(BF16-policy) and NVFP4 KV pages, NVFP4 W4A4/W4A16 and BF16 linears are served; MoE layers and
MXFP4 run the per-kernel path (`cpu_fused`). The arguments are one `LayerArgs` (fields: the lists
in `cpu_layer.h`, from which the C struct and this class are both generated); sglang_backend/local
/layer_c.py fills them.
"""

from __future__ import annotations

import torch

from . import cpu_build


def new_args():
    """A zeroed LayerArgs (requires the built kernels: check `cpu_fused.available()` first)."""
    return cpu_build.library().LayerArgs()


def run(args, dtype: torch.dtype) -> None:
    rc = cpu_build.library().decode_layer(args, dtype == torch.bfloat16)
    if rc:
        raise _ERRORS[rc][0](f"decode_layer: {_ERRORS[rc][1]}")


def run_stream(arg_list: list, dtype: torch.dtype) -> None:
    """Layers in order (lin_kind 1/2, each res_in the previous res_out), bf16 only."""
    if dtype != torch.bfloat16:
        raise TypeError(f"decode_layers_stream serves bfloat16 layers, not {dtype}")
    rc = cpu_build.library().decode_layers_stream(arg_list)
    if rc:
        raise _ERRORS[rc][0](f"decode_layers_stream: {_ERRORS[rc][1]}")


_ERRORS = {
    1: (FloatingPointError, "an FP4 quantizer met NaN (the activations diverged)"),
    2: (MemoryError, "out of memory for its scratch buffers"),
    3: (IndexError, "a KV slot lies outside the cache"),
    4: (ValueError, "a KV global scale is not finite and positive"),
}
