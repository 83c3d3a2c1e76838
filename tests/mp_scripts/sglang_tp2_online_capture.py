"""Online NVFP4 (`trace_nvfp4`) and guidance capture in real SGLang 0.5.23 linear layers at TP=2 (gloo, CPU).

    PYTHONPATH=. SGLANG_USE_CPU_ENGINE=1 python -m torch.distributed.run --nproc-per-node 2 \
        tests/mp_scripts/sglang_tp2_online_capture.py OUT_DIR

The layers of sglang_tp2_linears.py (QKV with one replicated KV head, o_proj, gate/up, down_proj), all
FP4 by the quant policy, load a BF16 checkpoint through their own weight_loader and quantize it at load.
Per rank, OUT_DIR/rank{r}.json says, per layer, whether the online weight codes / E4M3 scales / S_enc
equal (a) the exporter's ModelOpt tensors (`to_modelopt_fused`, what megatron_trace/transfer sends)
loaded into the same TP=2 layer by SGLang's loader and (b) the online TP=1 layer's on this rank's
slice; the output differences to both. Then guidance: the four layers and the plugin's NVFP4 KV method
(2 KV heads, one per rank) run under a SlotCapture assembled for TP (slot_capture.assemble_at_tp), and
the record's bytes are compared with TP=1's record of the same inputs; a capture without the assembly
is the negative control. The same guidance check runs for online MXFP4 (`trace_mxfp4`) linears with
MXFP4 K/V pages (the plugin's per-side KV method): E8M0 blocks, no global scale.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megatron_trace.fp4 import nvfp4
from megatron_trace.fp4.modelopt import to_modelopt_fused
from megatron_trace.models.quant_policy import QuantPolicy
from tests.mp_scripts import sglang_tp2_linears as base

KINDS = ("qkv", "o", "gate_up", "down")
ALL_LINEARS = tuple(f"*.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
SLOTS = torch.tensor([5, 2, 9, 0, 7, 3])  # KV slots of the T=6 tokens: not in order, as in a radix-cached batch
KV_HEADS, HEAD_DIM = 2, 32


def shrink_rank1_part(kind: str, sid, w: torch.Tensor) -> torch.Tensor:
    """Rank 1's part of the full weight 10x smaller (the replicated k/v too), so the full weight's amax
    lies on rank 0 only: a rank-local amax would give rank 1 another S_enc and other codes."""
    w = w.clone()
    if kind in ("o", "down"):
        w[:, w.shape[1] // 2 :] /= 10
    elif sid in ("k", "v"):
        w /= 10
    else:
        w[w.shape[0] // 2 :] /= 10
    return w


def load_bf16(layer, shards, biases) -> None:
    """A BF16 checkpoint through the layer's own loaders (SGLang narrows each tensor to the rank's slice)."""
    for sid, w in shards:
        p = layer.weight
        p.weight_loader(p, w, sid) if sid is not None else p.weight_loader(p, w)
        if biases is not None:
            layer.bias.weight_loader(layer.bias, biases[sid], sid)
    layer.quant_method.process_weights_after_loading(layer)


def weight_bits(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, E4M3 scale bytes, per-row S_dec) the layer serves: what ModelOpt's weight, weight_scale and
    weight_scale_2 hold (an S_dec can have two S_enc neighbours; dequantization uses the S_dec)."""
    q = layer.quant_method.quantized_weight(layer)
    return q.data, q.scale.view(torch.uint8), nvfp4.decode_scale(q.global_scale)


def first(y):
    return y[0] if isinstance(y, tuple) else y


def column_slice(y1: torch.Tensor, tp2, shards, rank: int, world: int) -> torch.Tensor:
    """This rank's output columns of a column-parallel TP=1 output (replicated KV heads share a chunk)."""
    cols, off = [], 0
    for i, (_, w) in enumerate(shards):
        n, per = w.shape[0], tp2.logical_widths[i]
        chunk = rank * (n // per) // world
        cols.append(torch.arange(off + chunk * per, off + (chunk + 1) * per))
        off += n
    return y1[:, torch.cat(cols)]


def main(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TRACE_QUANT_POLICY"] = json.dumps(
        {"policy": QuantPolicy(kv="bf16", targets=ALL_LINEARS).to_dict(), "num_layers": 1}
    )
    base.setup(rank, world)
    from sglang_backend.plugin.online_quant import TraceNVFP4OnlineConfig, TraceNVFP4OnlineLinearMethod
    from sglang_backend.plugin.quant_config import TraceFP4Config

    online, export_cfg = TraceNVFP4OnlineConfig(), TraceFP4Config()
    gen = torch.Generator().manual_seed(1)
    x_h = torch.randn(base.T, base.H, generator=gen) * 3
    x_a, x_i = torch.randn(base.T, base.NQ * base.HEAD, generator=gen), torch.randn(base.T, base.INTER, generator=gen)
    x_a[:, : x_a.shape[1] // 2] *= 10  # rank 0's half holds each token's amax: a slice-local S_enc would differ
    x_i[:, : x_i.shape[1] // 2] *= 10
    inputs = {"qkv": x_h, "o": x_a, "gate_up": x_h, "down": x_i}
    report: dict = {"rank": rank}
    layers2, layers1 = {}, {}
    for kind in KINDS:
        shards = [
            (sid, shrink_rank1_part(kind, sid, w).to(torch.bfloat16).float())  # BF16 values
            for sid, w in base.weights(kind, gen)
        ]
        biases = {s: torch.randn(w.shape[0], generator=gen) for s, w in shards} if kind == "qkv" else None
        tp2, tp1 = base.build(kind, online, False), base.build(kind, online, True)
        exp2 = base.build(kind, export_cfg, False)
        assert isinstance(tp2.quant_method, TraceNVFP4OnlineLinearMethod), type(tp2.quant_method)
        load_bf16(tp2, shards, biases)
        load_bf16(tp1, shards, biases)
        base.load(exp2, shards, biases)  # the exporter's tensors, as an NVFP4 checkpoint
        layers2[kind], layers1[kind] = tp2, tp1
        got, want = weight_bits(tp2), weight_bits(exp2)
        r = {"vs_export": [bool(torch.equal(a, b)) for a, b in zip(got, want)]}
        full = weight_bits(tp1)
        row = kind in ("o", "down")
        if row:  # this rank's K chunk of every row
            k = tp2.input_size_per_partition
            full = (
                full[0][:, rank * k // 2 : (rank + 1) * k // 2],
                full[1][:, rank * k // 16 : (rank + 1) * k // 16],
                full[2],
            )
        else:
            full = tuple(
                column_slice(t.T, tp2, shards, rank, world).T
                if t.dim() == 2
                else column_slice(t.unsqueeze(0), tp2, shards, rank, world)[0]
                for t in full
            )
        r["vs_tp1"] = [bool(torch.equal(a, b)) for a, b in zip(got, full)]
        full_amax = torch.stack([w.abs().amax() for _, w in shards]).amax()
        r["local_amax_differs"] = bool(tp2.weight.data.abs().amax() != full_amax)
        r["export_s_dec"] = float(to_modelopt_fused([w for _, w in shards])[0]["weight_scale_2"])
        x = inputs[kind]
        x_loc = x.chunk(world, dim=1)[rank] if row else x
        with torch.no_grad():
            y2, y1, ye = first(tp2(x_loc)), first(tp1(x)), first(exp2(x_loc))
        y1 = y1 if row else column_slice(y1, tp2, shards, rank, world)
        r["max_abs_diff_tp1"], r["ref_max"] = float((y2 - y1).abs().max()), float(y1.abs().max())
        r["max_abs_diff_export"] = float((y2 - ye).abs().max())
        report[kind] = r
    report["guidance"] = guidance_check(rank, world, layers2, layers1, inputs)
    report["guidance_mxfp4"] = mxfp4_guidance_check(rank, world, inputs)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    torch.distributed.barrier()


def run_sites(cap, layers, inputs, kv_k, kv_v, rank: int | None, world: int, kv_method=None) -> None:
    """The four linears and the K/V store of one layer under `cap`, in a decoder layer's order
    (K/V through `kv_method`, by default the plugin's NVFP4 KV method)."""
    from sglang_backend.plugin import capture
    from sglang_backend.plugin.kv_capture import TraceNVFP4KVMethod

    kv = kv_method or TraceNVFP4KVMethod(num_layers=1)
    heads = KV_HEADS if rank is None else KV_HEADS // world
    bufs = kv.create_buffers(16, heads, HEAD_DIM, 1, "cpu")
    with capture.capture_batch(SLOTS, SLOTS, buffer=cap), torch.no_grad():
        for kind in KINDS:
            x = inputs[kind]
            row = rank is not None and kind in ("o", "down")
            layers[kind](x.chunk(world, dim=1)[rank] if row else x)
            if kind == "qkv":
                hs = slice(None) if rank is None else slice(rank * heads, (rank + 1) * heads)
                kv.quantize_and_store(
                    bufs["k_buffer"][0],
                    bufs["v_buffer"][0],
                    bufs["k_scale_buffer"][0],
                    bufs["v_scale_buffer"][0],
                    SLOTS,
                    kv_k[:, hs],
                    kv_v[:, hs],
                    kv.k_scales_gpu[0],
                    kv.v_scales_gpu[0],
                )


def guidance_check(rank: int, world: int, layers2, layers1, inputs, kv_method=None) -> dict:
    from sglang.srt.runtime_context import get_parallel

    from sglang_backend.plugin.slot_capture import SlotCapture, assemble_at_tp

    g = torch.Generator().manual_seed(7)
    kv_k, kv_v = (torch.randn(base.T, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    kv_k[:, 1] /= 50  # the heads differ in scale, so a wrong head order changes the bytes
    model2 = torch.nn.ModuleDict(layers2)
    cap2, raw2, cap1 = (SlotCapture(16, "full", [0]) for _ in range(3))
    assemble_at_tp(cap2, model2, get_parallel(), KV_HEADS)
    run_sites(cap2, layers2, inputs, kv_k, kv_v, rank, world, kv_method)
    run_sites(raw2, layers2, inputs, kv_k, kv_v, rank, world, kv_method)
    run_sites(cap1, layers1, inputs, kv_k, kv_v, None, world, kv_method)
    rec2, raw, rec1 = cap2.record("r0", SLOTS), raw2.record("r0", SLOTS), cap1.record("r0", SLOTS)
    return {
        "tp_rank": cap2.tp_rank,
        "gathered_sites": sorted(cap2.gathers),
        "sites": list(cap1.sites),
        "record_equal": rec2 == rec1,
        "record_bytes": len(rec1),
        "unassembled_record_equal": raw == rec1,
    }


def mxfp4_guidance_check(rank: int, world: int, inputs) -> dict:
    """guidance_check for online MXFP4 (`trace_mxfp4`: E8M0 per 32, no global scale) with MXFP4 K/V pages
    (the plugin's per-side KV method, E8M0 per 16): the TP=2 assembly must give TP=1's record here too."""
    from sglang_backend.plugin import kv_sides
    from sglang_backend.plugin.online_quant import TraceMXFP4OnlineConfig
    from sglang_backend.plugin.quant_method import TraceMXFP4LinearMethod

    os.environ["TRACE_QUANT_POLICY"] = json.dumps(
        {"policy": QuantPolicy(kv="bf16", format="mxfp4", targets=ALL_LINEARS).to_dict(), "num_layers": 1}
    )
    cfg, gen = TraceMXFP4OnlineConfig(), torch.Generator().manual_seed(2)
    layers2, layers1 = {}, {}
    for kind in KINDS:
        shards = base.weights(kind, gen)
        biases = {s: torch.randn(w.shape[0], generator=gen) for s, w in shards} if kind == "qkv" else None
        layers2[kind], layers1[kind] = base.build(kind, cfg, False), base.build(kind, cfg, True)
        assert isinstance(layers2[kind].quant_method, TraceMXFP4LinearMethod), type(layers2[kind].quant_method)
        load_bf16(layers2[kind], shards, biases)
        load_bf16(layers1[kind], shards, biases)
    kv = kv_sides.per_side_method_class(("mxfp4", "mxfp4"))(num_layers=1, device="cpu", page_size=16)
    return guidance_check(rank, world, layers2, layers1, inputs, kv)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
