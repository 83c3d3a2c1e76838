"""Real SGLang 0.5.23 linear layers at TP=2 (gloo, CPU) with the TRACE quant method, against the
same layers unsharded (`parallel_group="replicated"`, TP=1) in the same process.

    python -m torch.distributed.run --nproc-per-node 2 tests/mp_scripts/sglang_tp2_linears.py OUT_DIR

Per rank, for a Qwen2-style QKV (4 q heads, 1 KV head: replicated at TP=2), o_proj, gate/up and
down_proj, loaded from ModelOpt NVFP4 tensors through the layers' own weight_loader and run
through the layers' own forward (row-parallel all-reduce included), writes OUT_DIR/rank{r}.json:
the TP (rank, size) the plugin reads, the max |TP=2 - TP=1| output difference per layer, whether
this rank's input codes/scales/global scales equal the TP=1 ones on its slice, and for the
row-parallel layers how many tokens a slice-local global scale would have changed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402

from megatron_trace.fp4 import nvfp4  # noqa: E402
from megatron_trace.fp4.modelopt import to_modelopt_fused  # noqa: E402

H, HEAD, NQ, NKV, INTER, T = 64, 16, 4, 1, 128, 6


def setup(rank: int, world: int) -> None:
    """SGLang's own steps (as sglang.test.test_utils.publish_build_topology, which imports extras)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=world, device="cpu"), role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def build(kind: str, cfg, replicated: bool):
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    g = {"parallel_group": "replicated"} if replicated else {}
    if kind == "qkv":
        return QKVParallelLinear(
            H,
            HEAD,
            NQ,
            NKV,
            bias=True,
            params_dtype=torch.float32,
            quant_config=cfg,
            prefix="model.layers.0.self_attn.qkv_proj",
            **g,
        )
    if kind == "o":
        return RowParallelLinear(
            NQ * HEAD,
            H,
            bias=False,
            params_dtype=torch.float32,
            quant_config=cfg,
            prefix="model.layers.0.self_attn.o_proj",
            **g,
        )
    if kind == "gate_up":
        return MergedColumnParallelLinear(
            H,
            [INTER, INTER],
            bias=False,
            params_dtype=torch.float32,
            quant_config=cfg,
            prefix="model.layers.0.mlp.gate_up_proj",
            **g,
        )
    return RowParallelLinear(
        INTER, H, bias=False, params_dtype=torch.float32, quant_config=cfg, prefix="model.layers.0.mlp.down_proj", **g
    )


def weights(kind: str, gen: torch.Generator) -> list[tuple[object, torch.Tensor]]:
    """(shard id, full HF weight) per shard, the same on every rank."""
    shapes = {
        "qkv": [("q", NQ * HEAD), ("k", NKV * HEAD), ("v", NKV * HEAD)],
        "o": [(None, H)],
        "gate_up": [(0, INTER), (1, INTER)],
        "down": [(None, H)],
    }[kind]
    k = {"o": NQ * HEAD, "down": INTER}.get(kind, H)
    return [(sid, torch.randn(n, k, generator=gen) * 0.2) for sid, n in shapes]


def load(layer, shards, biases=None) -> None:
    """As SGLang's Qwen2 load_weights does: each checkpoint tensor through param.weight_loader."""
    mo = to_modelopt_fused([w for _, w in shards])  # fused shards share one global scale
    for (sid, _), tensors in zip(shards, mo):
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, sid) if sid is not None else p.weight_loader(p, t)
        if biases is not None:
            layer.bias.weight_loader(layer.bias, biases[sid], sid)
    layer.quant_method.process_weights_after_loading(layer)


def main(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup(rank, world)
    from sglang_backend.plugin.layer_tp import tp_rank_size
    from sglang_backend.plugin.quant_config import TraceFP4Config

    cfg = TraceFP4Config()
    gen = torch.Generator().manual_seed(0)
    x_h = torch.randn(T, H, generator=gen) * 3
    x_h[:, : H // 2] *= 10  # the rank-0 half holds each token's amax: rank 1's slice-local scale differs
    x_a, x_i = torch.randn(T, NQ * HEAD, generator=gen), torch.randn(T, INTER, generator=gen)
    x_a[:, : NQ * HEAD // 2] *= 10
    x_i[:, : INTER // 2] *= 10
    report: dict = {"rank": rank}
    for kind, x in (("qkv", x_h), ("o", x_a), ("gate_up", x_h), ("down", x_i)):
        shards = weights(kind, gen)
        biases = {s: torch.randn(w.shape[0], generator=gen) for s, w in shards} if kind == "qkv" else None
        tp2, tp1 = build(kind, cfg, False), build(kind, cfg, True)
        load(tp2, shards, biases)
        load(tp1, shards, biases)
        r = {"tp": list(tp_rank_size(tp2)), "tp_ref": list(tp_rank_size(tp1))}
        row = kind in ("o", "down")
        k_loc = x.shape[1] // world
        x_loc = x[:, rank * k_loc : (rank + 1) * k_loc] if row else x
        with torch.no_grad():
            y2, y1 = tp2(x_loc), tp1(x)
        y2, y1 = (y2[0] if isinstance(y2, tuple) else y2), (y1[0] if isinstance(y1, tuple) else y1)
        if not row:  # column-parallel: this rank's output columns of each shard
            cols, off = [], 0
            for _sid, w in shards:
                n = w.shape[0]
                per = tp2.logical_widths[len(cols)]
                chunk = rank * (n // per) // world  # replicated KV heads share a chunk
                cols.append(torch.arange(off + chunk * per, off + (chunk + 1) * per))
                off += n
            y1 = y1[:, torch.cat(cols)]
        r["max_abs_diff"] = float((y2 - y1).abs().max())
        r["ref_max"] = float(y1.abs().max())
        q2, _ = tp2.quant_method.quantize_input(tp2, x_loc)
        q1, _ = tp1.quant_method.quantize_input(tp1, x)
        if row:
            q1 = nvfp4.NVFP4Tensor(
                q1.data[:, rank * k_loc // 2 : (rank + 1) * k_loc // 2],
                q1.scale[:, rank * k_loc // 16 : (rank + 1) * k_loc // 16],
                q1.global_scale,
            )
            local = nvfp4.quantize(x_loc, per_row_global=True)  # what a slice-local scale would give
            r["tokens_local_scale_differs"] = int((local.global_scale != q1.global_scale).sum())
        r["codes_equal"] = bool(torch.equal(q2.data, q1.data))
        r["scales_equal"] = bool(torch.equal(q2.scale, q1.scale))
        r["global_scales_equal"] = bool(torch.equal(q2.global_scale, q1.global_scale))
        report[kind] = r
    report["kv_fp8"] = kv_fp8_check(rank)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    torch.distributed.barrier()


def kv_fp8_check(rank: int) -> dict:
    """The plugin's per-side KV method (FP8 K + NVFP4 V) with this rank's one of 2 KV heads: FP8's
    per-token scale must be the one over BOTH heads (all-reduce MAX over SGLang's TP group), so its
    bytes and scales equal TP=1's slice; rank 1's head is 100x smaller, so a local scale would differ."""
    from megatron_trace.fp4 import fp8
    from sglang_backend.plugin.kv_sides import per_side_method_class

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(T, 2, 32, generator=g), torch.randn(T, 2, 32, generator=g)
    k[:, 1] /= 100
    m = per_side_method_class(("fp8", "nvfp4"))(num_layers=1, device="cpu", page_size=16)
    m.configure_attention_backends("torch_native", "torch_native")
    bufs = m.create_buffers(16, 1, 32, 1, "cpu")
    loc = torch.arange(T)
    m.quantize_and_store(
        bufs["k_buffer"][0],
        bufs["v_buffer"][0],
        bufs["k_scale_buffer"][0],
        bufs["v_scale_buffer"][0],
        loc,
        k[:, rank : rank + 1],
        v[:, rank : rank + 1],
        m.k_scales_gpu[0:1],
        m.v_scales_gpu[0:1],
    )
    ref = fp8.quantize(k, dims=2)  # TP=1: both heads
    got_scale = bufs["k_scale_buffer"][0][loc].contiguous().view(torch.float32).reshape(-1)
    local = fp8.quantize(k[:, rank : rank + 1], dims=2)
    return {
        "bytes_equal": bool(torch.equal(bufs["k_buffer"][0][loc], ref.data[:, rank : rank + 1])),
        "scales_equal": bool(torch.equal(got_scale, ref.scale)),
        "tokens_local_scale_differs": int((local.scale != ref.scale).sum()),
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]))
