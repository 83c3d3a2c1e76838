"""Runs a whole dense decoder layer as one C call (`kernels/cpu_layer.py`) on CPU.

The per-forward work here is filling one argument object per layer (`cpu_layer.new_args()`): pointers to the layer's
weights (transposed for the GEMM; refreshed only after weight loads), its KV pages, the batch's
attention layout, and, for layers whose guidance is captured, the guidance log's rows for this
step, which the quantizers write into. `supports` is False for what the kernel does not serve
(MoE, MXFP4 activations or KV, FP4 widths that are not whole blocks, real-size layers); the model
then runs the per-kernel path (`cpu_fused`), whose linears stream their weights at decode widths
through kernels/cpu_gemv.
"""

from __future__ import annotations

import torch

from kernels import cpu_fused, cpu_layer

_LINEARS = ("qkv", "o_proj", "gate_up", "down")


# Above this many MLP weights per layer the layer runs kernel by kernel, whose linears stream the
# weights as stored across torch's threads at decode (kernels/cpu_gemv) and use torch's GEMM for
# prefill; this kernel's own GEMM is single-threaded and reads dequantized weights, which only
# small models (where one call saves more than threads would) should pay.
ONE_CALL_MAX_WEIGHTS = 1 << 22


def supports(layer, kv) -> bool:
    """Whether `layer` (a model._Layer) should run as one C call over this KV cache."""
    if layer.moe or kv.fmt not in ("bf16", "nvfp4") or not cpu_fused.available(layer.input_norm.dtype):
        return False
    if layer.gate_up.in_features * layer.gate_up.out_features > ONE_CALL_MAX_WEIGHTS:
        return False
    for name in _LINEARS:
        lin = getattr(layer, name)
        if lin.act_fmt not in (None, "nvfp4") or (lin.act_fmt and lin.in_features % 16):
            return False
    return True


def _static_args(layer, kv):
    a, args = layer.arch, cpu_layer.new_args()
    args.hidden, args.heads, args.kv_heads, args.head_dim = a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    args.inter, args.qkv_n = layer.gate_up.out_features // 2, layer.qkv.out_features
    args.eps, args.attn_scale, args.kv_fmt = a.rms_norm_eps, a.head_dim**-0.5, int(kv.fmt == "nvfp4")
    args.num_slots = kv.num_pages * kv.page_size
    pages = kv.layer_pages[layer.idx]
    args.kc, args.vc = pages[0].data_ptr(), pages[-2 if kv.fmt == "nvfp4" else 1].data_ptr()
    if kv.fmt == "nvfp4":
        args.ks, args.vs = pages[1].data_ptr(), pages[3].data_ptr()
    return args


class _Plan:
    """A layer's C arguments and the Python objects they point into, refreshed only when a weight
    load (finalize) or load_state_dict changed one of its linears."""

    def __init__(self, layer, kv):
        self.kv, self.args = kv, _static_args(layer, kv)
        self.linears = tuple(getattr(layer, n) for n in _LINEARS)
        self.weights = tuple(lin.weight for lin in self.linears)
        self.layer, self.key, self.keep = layer, None, None
        self.capturing, self.cap_token = False, None  # cap_token: (log layout, KV scales) the addresses are for

    def refresh(self) -> None:
        key = tuple((lin._generation, w._version) for lin, w in zip(self.linears, self.weights))
        if key == self.key:
            return
        layer, args = self.layer, self.args
        keep = [lin.weight_t() for lin in self.linears]
        args.qkv_wt, args.o_wt, args.gu_wt, args.down_wt = (w.data_ptr() for w in keep)
        args.in_norm, args.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        if layer.arch.qk_norm:
            args.q_norm, args.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
        qkv, o = self.linears[0], self.linears[1]
        args.qkv_b = qkv.bias.data_ptr() if qkv.bias is not None else None
        args.o_b = o.bias.data_ptr() if o.bias is not None else None
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


def run_layer(layer, x: torch.Tensor, residual: torch.Tensor | None, batch, kv, rot, capture) -> torch.Tensor:
    """x (the residual stream) += residual, then the layer; returns its MLP output (the next residual)."""
    plan = layer.__dict__.get("_c_plan")
    if plan is None or plan.kv is not kv:
        plan = layer.__dict__["_c_plan"] = _Plan(layer, kv)
    plan.refresh()
    args, t = plan.args, x.shape[0]
    table, row_seq, row_len, _ = batch.attention_layout()
    _set_capture(plan, args, capture, batch.kv_global_scales[layer.idx] if kv.fmt == "nvfp4" else None)
    if kv.fmt == "nvfp4":
        args.sdec_k, args.sdec_v = batch.kv_decode_scales[layer.idx]
        gs = kv.global_scale.data_ptr() + 8 * layer.idx  # [layers, 2] fp32, contiguous
        args.gs_k, args.gs_v = gs, gs + 4
    out = torch.empty_like(x)
    args.T, args.x, args.res_out = t, x.data_ptr(), out.data_ptr()
    args.res_in = None if residual is None else residual.data_ptr()
    args.cos, args.sin, args.pos = rot[0].data_ptr(), rot[1].data_ptr(), batch.positions.data_ptr()
    args.table, args.ldt, args.row_seq, args.row_len = (
        table.data_ptr(),
        table.stride(0),
        row_seq.data_ptr(),
        row_len.data_ptr(),
    )
    args.write_slots = batch.write_slots.data_ptr()
    cpu_layer.run(args, x.dtype)
    return out


def _set_capture(plan: _Plan, args, capture, kv_scales) -> None:
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


def _point_at_log(plan: _Plan, args, log, kv_scales) -> None:
    """Row-0 addresses of every captured site of this layer in the guidance log (None: not captured)."""
    data, scale, gs = list(args.cap_data), list(args.cap_scale), list(args.cap_gs)
    for i, site, rows, static, value in plan.act_sites:
        data[i], scale[i], gs[i] = log.pointers(site, *rows, static_gs=static, static_value=value)
    args.cap_data, args.cap_scale, args.cap_gs = data, scale, gs
    if plan.kv.fmt == "nvfp4":
        layer, kv, kv_gs = plan.layer, list(args.cap_kv), list(args.cap_kv_gs)
        for which in (0, 1):
            kv[2 * which], kv[2 * which + 1], kv_gs[which] = log.pointers(
                layer.kv_sites[which],
                *plan.kv_rows,
                static_gs=plan.kv.global_scale[layer.idx, which],
                static_value=kv_scales[which],
            )
        args.cap_kv, args.cap_kv_gs = kv, kv_gs
