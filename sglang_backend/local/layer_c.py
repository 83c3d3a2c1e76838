"""Runs dense decoder layers as single C calls (`megatron_trace/kernels/cpu_layer.py`) on CPU, in the
modes run_plan.py picks (this module decides nothing):

- "one_call": one call per layer, `decode_layer`, whose single-threaded GEMM reads a transposed
  dequantized copy of each weight (the engine's tiny test models, any batch);
- "stream": a run of consecutive layers in one call, `decode_layers_stream`, whose linears read the
  weights as stored through the decode GEMVs (megatron_trace/kernels/cpu_gemv) on torch's threads,
  one parallel region for the whole run. Its results are the per-kernel path's bits (the same C
  functions on the same inputs); it exists because that path pays for a parallel region and a
  Python call per kernel. A de-biased K (quant.kv_k_debias) streams with its offset table (`k_off`:
  RoPE_j(k bias) for the batch's positions, added to the K attention decodes; the qkv linear leaves
  the bias out of K);
- "kernels": `_Layer.forward_fused` (`cpu_fused`, `EngineLinear.forward_cpu`).

The per-forward work here is filling one argument object per layer (`cpu_layer.new_args()`):
pointers to the layer's weights (refreshed only after weight loads), its KV pages, the batch's
attention layout, and, for layers whose guidance is captured, the guidance log's rows for this
step, which the quantizers write into.
"""

from __future__ import annotations

import weakref

import torch

from megatron_trace.kernels import cpu_layer

from .run_plan import SIDE_CODES
from .run_plan import linears as _linears


def run_layers(layers, modes: list[str], x, batch, kv, rot, caps) -> torch.Tensor:
    """Every layer of a fused CPU forward (model.py) in its mode for this batch (RunPlan.modes):
    runs of consecutive "stream" layers in one call each; returns the last layer's pending residual."""
    residual, i = None, 0
    while i < len(layers):
        if modes[i] == "stream":
            j = i
            while j < len(layers) and modes[j] == "stream":
                j += 1
            residual = run_stream(layers[i:j], x, residual, batch, kv, rot, caps[i:j])
            i = j
            continue
        if modes[i] == "one_call":
            residual = run_layer(layers[i], x, residual, batch, kv, rot, caps[i])
        else:
            residual = layers[i].forward_fused(x, residual, batch, kv, rot, caps[i])
        i += 1
    return residual


def _static_args(layer, kv):
    a, args = layer.arch, cpu_layer.new_args()
    args.hidden, args.heads, args.kv_heads, args.head_dim = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    args.inter, args.qkv_n = layer.gate_up.out_features // 2, layer.qkv.out_features
    args.eps, args.attn_scale, args.kv_fmt = a.rms_norm_eps, a.head_dim**-0.5, int(kv.fmt == "nvfp4")
    args.num_slots = kv.num_pages * kv.page_size
    args.k_fmt, args.v_fmt = (SIDE_CODES.get(f, -1) for f in kv.side_fmt)
    pages = kv.layer_pages[layer.idx]
    if kv.fmt == "bf16":
        args.kc, args.vc = pages[0].data_ptr(), pages[1].data_ptr()
    else:  # (K data, K scales or None, V data, V scales or None)
        args.kc, args.ks, args.vc, args.vs = (None if t is None else t.data_ptr() for t in pages)
    return args


class _CArgs:
    """A layer's C arguments and the Python objects they point into, refreshed only when a weight
    load (finalize) or load_state_dict changed one of its linears. stream: the streamed linears'
    fields (lin_*), else the GEMM's transposed copies (*_wt)."""

    def __init__(self, layer, kv, stream: bool):
        self.kv, self.stream, self.args = kv, stream, _static_args(layer, kv)
        self.linears = tuple(_linears(layer))
        self.weights = tuple(lin.weight for lin in self.linears)
        # weak: _C_ARGS maps layer -> plan weakly, and a plan holding its layer would keep every
        # engine ever built (weights, KV pages) alive: the quality gate's two engines were 5 GB
        self.layer, self.key, self.keep = weakref.ref(layer), None, None
        self.capturing, self.cap_token = False, None  # cap_token: (log layout, KV scales) the addresses are for
        self.k_off = None  # de-biased K: this forward's offset table, alive while args point at it

    def refresh(self) -> None:
        key = tuple((lin.generation, w._version) for lin, w in zip(self.linears, self.weights))
        if key == self.key:
            return
        layer, args = self.layer(), self.args
        keep = self._stream_weights() if self.stream else self._gemm_weights()
        args.in_norm, args.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        if layer.arch.qk_norm:
            args.q_norm, args.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
        statics = [lin.input_global_scale for lin in self.linears]
        args.act_mode = [
            0 if lin.act_fmt is None else (1 if gs is None else 2) for lin, gs in zip(self.linears, statics)
        ]
        args.act_gs = [None if gs is None else gs.data_ptr() for gs in statics]
        keep.extend(statics)
        values = [None if lin.input_global_scale is None else float(lin.input_global_scale) for lin in self.linears]
        # guidance: (index, site, row shapes, static S_enc, its value) of each NVFP4-activation linear
        self.act_sites = [
            (i, lin.site, ((lin.in_features // 2,), (lin.in_features // 16,), ()), lin.input_global_scale, values[i])
            for i, lin in enumerate(self.linears)
            if lin.act_fmt == "nvfp4"
        ]
        a = layer.arch
        self.kv_rows = ((a.num_kv_heads, a.head_dim // 2), (a.num_kv_heads, a.head_dim // 16), ())
        self.key, self.keep, self.cap_token = key, keep, None

    def _gemm_weights(self) -> list:
        args, keep = self.args, [lin.weight_t() for lin in self.linears]
        args.qkv_wt, args.o_wt, args.gu_wt, args.down_wt = (w.data_ptr() for w in keep)
        qkv, o = self.linears[0], self.linears[1]
        args.qkv_b = qkv.bias.data_ptr() if qkv.bias is not None else None
        args.o_b = o.bias.data_ptr() if o.bias is not None else None
        return keep

    def _stream_weights(self) -> list:
        """What forward_cpu hands cpu_gemv: the bf16 weight, or the NVFP4 codes, E4M3 scales and S_dec
        per row as stored; fp32 biases."""
        kinds, w, sc, gdec, bias, keep = [], [], [], [], [], []
        for lin in self.linears:
            if lin.weight_fmt is None:
                t = (lin.weight.detach().contiguous(), None, None)
            else:
                q = lin.qweight
                t = (q.data.contiguous(), q.scale.contiguous().view(torch.uint8), lin.global_decode())
            b = None if lin.bias is None else lin.bias.detach().float().contiguous()
            kinds.append(1 if lin.weight_fmt is None else 2)
            for dst, v in zip((w, sc, gdec, bias), (*t, b)):
                dst.append(None if v is None else v.data_ptr())
                keep.append(v)
        args = self.args
        args.lin_kind, args.lin_w, args.lin_scales, args.lin_gdec, args.lin_bias = kinds, w, sc, gdec, bias
        return keep


_C_ARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its _CArgs


def forget(layers) -> None:
    """Drop these layers' cached C arguments: they hold the KV pool they point into, which a
    release_memory_occupation("kv_cache") must give back while the layers stay."""
    for layer in layers:
        _C_ARGS.pop(layer, None)


def _plan(layer, kv, stream: bool) -> _CArgs:
    plan = _C_ARGS.get(layer)
    if plan is None or plan.kv is not kv or plan.stream != stream:
        plan = _C_ARGS[layer] = _CArgs(layer, kv, stream)
    plan.refresh()
    return plan


def _fill(plan: _CArgs, layer, x: torch.Tensor, batch, kv, rot, capture):
    """The per-forward fields of one layer's arguments (all but the residual in / out)."""
    args = plan.args
    table, row_seq, row_len, width = batch.attention_layout()
    plan.k_off = layer.k_bias_columns(width) if layer.k_debias else None  # kept alive through the call
    args.k_off = None if plan.k_off is None else plan.k_off.data_ptr()
    nvfp4_pages = "nvfp4" in kv.side_fmt
    _set_capture(plan, args, capture, batch.kv_global_scales[layer.idx] if nvfp4_pages else None)
    if nvfp4_pages:
        args.sdec_k, args.sdec_v = batch.kv_decode_scales[layer.idx]
        gs = kv.global_scale.data_ptr() + 8 * layer.idx  # [layers, 2] fp32, contiguous
        args.gs_k, args.gs_v = gs, gs + 4
    args.T, args.x = x.shape[0], x.data_ptr()
    args.cos, args.sin, args.pos = rot[0].data_ptr(), rot[1].data_ptr(), batch.positions.data_ptr()
    args.table, args.ldt, args.row_seq, args.row_len = (
        table.data_ptr(),
        table.stride(0),
        row_seq.data_ptr(),
        row_len.data_ptr(),
    )
    args.write_slots = batch.write_slots.data_ptr()
    return args


def run_layer(layer, x: torch.Tensor, residual: torch.Tensor | None, batch, kv, rot, capture) -> torch.Tensor:
    """x (the residual stream) += residual, then the layer; returns its MLP output (the next residual)."""
    args = _fill(_plan(layer, kv, stream=False), layer, x, batch, kv, rot, capture)
    out = torch.empty_like(x)
    args.res_in = None if residual is None else residual.data_ptr()
    args.res_out = out.data_ptr()
    cpu_layer.run(args, x.dtype)
    return out


def run_stream(layers, x: torch.Tensor, residual: torch.Tensor | None, batch, kv, rot, captures) -> torch.Tensor:
    """`run_layer` for a run of consecutive `streams` layers (x.shape[0] <= each one's stream_rows)
    in one C call; returns the last layer's MLP output."""
    outs = torch.empty(len(layers), *x.shape, dtype=x.dtype)
    arg_list = []
    for layer, capture, out in zip(layers, captures, outs):
        args = _fill(_plan(layer, kv, stream=True), layer, x, batch, kv, rot, capture)
        args.res_in = None if residual is None else residual.data_ptr()
        args.res_out = out.data_ptr()
        residual = out
        arg_list.append(args)
    cpu_layer.run_stream(arg_list, x.dtype)
    return residual


def _set_capture(plan: _CArgs, args, capture, kv_scales) -> None:
    """Point the quantizers at the guidance log for this step, or at nothing. `capture` must offer
    `.log` and `.row` (the scheduler's does; the model sends others down the per-kernel path).
    kv_scales: this layer's [S_enc of K, S_enc of V] as floats (NVFP4 KV)."""
    if capture is not None:
        plan.capturing = True
        log = capture.log
        if plan.cap_token != (log.layout, kv_scales):  # addresses moved, or a static scale changed
            _point_at_log(plan, args, log, kv_scales)
            plan.cap_token = (log.layout, kv_scales)
        args.cap_row = capture.row
    elif plan.capturing:
        args.cap_data = args.cap_scale = args.cap_gs = args.cap_kv = [None] * 4
        args.cap_kv_gs = [None] * 2
        plan.capturing, plan.cap_token = False, None


def _point_at_log(plan: _CArgs, args, log, kv_scales) -> None:
    """Row-0 addresses of every captured site of this layer in the guidance log (None: not captured)."""
    data, scale, gs = list(args.cap_data), list(args.cap_scale), list(args.cap_gs)
    for i, site, rows, static, value in plan.act_sites:
        data[i], scale[i], gs[i] = log.pointers(site, *rows, static_gs=static, static_value=value)
    args.cap_data, args.cap_scale, args.cap_gs = data, scale, gs
    if "nvfp4" in plan.kv.side_fmt:
        layer, kv, kv_gs = plan.layer(), list(args.cap_kv), list(args.cap_kv_gs)
        for which in (w for w in (0, 1) if plan.kv.side_fmt[w] == "nvfp4"):  # FP8 sides: per-kernel path
            kv[2 * which], kv[2 * which + 1], kv_gs[which] = log.pointers(
                layer.kv_sites[which],
                *plan.kv_rows,
                static_gs=plan.kv.global_scale[layer.idx, which],
                static_value=kv_scales[which],
            )
        args.cap_kv, args.cap_kv_gs = kv, kv_gs
