"""The TRACE quant method in real SGLang 0.5.23 linear layers at TP=2: two gloo ranks on CPU
(tests/mp_scripts/sglang_tp2_linears.py) load fused QKV (with a replicated KV head), o_proj,
gate/up and down_proj through SGLang's own weight loaders and forward, and match the same layers
unsharded. Row-parallel layers quantize each token with the FULL-row global scale on every shard
(all-reduce MAX over the layer's tp_group), so their codes equal TP=1's; a slice-local scale
would differ on every token of these inputs.

tests/mp_scripts/sglang_tp2_online_capture.py does the same for online NVFP4 (`trace_nvfp4`, a BF16
checkpoint quantized at load, the S_enc over the full weight) against the exporter's bytes, and for
guidance capture: the record assembled at TP=2 equals TP=1's byte for byte (NVFP4, and online MXFP4
with MXFP4 K/V pages).

A whole TP=2 SGLang server (two scheduler ranks over gloo, SGLang's CPU engine, started by our launcher
with online NVFP4 of a BF16-era fp32 checkpoint and full-code guidance) answers the embedded engine's
greedy tokens, logprobs and guidance records (test_tp2_server_matches_the_embedded_engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.ports import free_port

pytest.importorskip("sglang.srt.layers.linear")
REPO = Path(__file__).resolve().parents[1]


def run_two_ranks(out: Path, script: str) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "SGLANG_USE_CPU_ENGINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests/mp_scripts" / script),
        str(out),
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_two_ranks(tmp_path_factory.mktemp("sglang_tp2"), "sglang_tp2_linears.py")


@pytest.fixture(scope="module")
def online_ranks(tmp_path_factory):
    return run_two_ranks(tmp_path_factory.mktemp("sglang_tp2_online"), "sglang_tp2_online_capture.py")


@pytest.mark.parametrize("kind", ["qkv", "o", "gate_up", "down"])
def test_tp2_layer_matches_tp1(ranks, kind):
    for rank, rep in enumerate(ranks):
        r = rep[kind]
        assert r["tp"] == [rank, 2] and r["tp_ref"] == [0, 1]  # read from 0.5.23's tp_group
        assert r["codes_equal"] and r["scales_equal"] and r["global_scales_equal"], (rank, kind)
        if kind in ("qkv", "gate_up"):  # column-parallel: the same GEMM rows
            assert r["max_abs_diff"] == 0.0, (rank, kind, r)
        else:  # row-parallel: the all-reduce sums two partial GEMMs in another order
            assert r["max_abs_diff"] <= 4e-6 * r["ref_max"], (rank, kind, r)


def test_row_parallel_scale_is_the_full_row(ranks):
    # rank 1's half of every token is 10x smaller: its slice-local scale would differ on all 6 tokens
    assert ranks[1]["o"]["tokens_local_scale_differs"] == 6 and ranks[1]["down"]["tokens_local_scale_differs"] == 6
    assert ranks[1]["o"]["global_scales_equal"] and ranks[1]["down"]["global_scales_equal"]


def test_fp8_kv_scale_spans_the_heads_of_every_rank(ranks):
    """FP8 K in the plugin's per-side KV method at TP=2: one scale per token over all KV heads, MAX-reduced
    over SGLang's TP group, so every rank stores TP=1's bytes and scales for its head."""
    for rank, rep in enumerate(ranks):
        assert rep["kv_fp8"]["bytes_equal"] and rep["kv_fp8"]["scales_equal"], (rank, rep["kv_fp8"])
    assert ranks[1]["kv_fp8"]["tokens_local_scale_differs"] == 6  # a rank-local scale would differ on every token


@pytest.mark.parametrize("kind", ["qkv", "o", "gate_up", "down"])
def test_online_nvfp4_tp2_holds_the_exporters_bytes(online_ranks, kind):
    """trace_nvfp4 on a BF16 checkpoint at TP=2: each rank's codes, E4M3 scales and S_dec equal the
    exporter's ModelOpt tensors (to_modelopt_fused over the FULL weights) as SGLang's loader slices them,
    and the online TP=1 layer's on that slice; rank 1's own amax is not the full one (so a rank-local
    S_enc would have failed), and the outputs equal the exported layer's exactly."""
    for rank, rep in enumerate(online_ranks):
        r = rep[kind]
        assert r["vs_export"] == [True, True, True] and r["vs_tp1"] == [True, True, True], (rank, kind, r)
        assert r["max_abs_diff_export"] == 0.0, (rank, kind, r)
        if kind in ("qkv", "gate_up"):
            assert r["max_abs_diff_tp1"] == 0.0, (rank, kind, r)
        else:  # the row-parallel all-reduce sums two partial GEMMs in another order
            assert r["max_abs_diff_tp1"] <= 4e-6 * r["ref_max"], (rank, kind, r)
    assert online_ranks[1][kind]["local_amax_differs"] and not online_ranks[0][kind]["local_amax_differs"]
    assert online_ranks[0][kind]["export_s_dec"] == online_ranks[1][kind]["export_s_dec"]


def test_guidance_record_at_tp2_equals_tp1(online_ranks):
    """The record every TP=2 rank assembles (row-parallel K chunks and K/V heads all-gathered, the column-
    parallel sites' replicated inputs as they are) is TP=1's record byte for byte; without the assembly
    it is not. Rank 0 is the one that publishes. The same for online MXFP4 with MXFP4 K/V (E8M0 blocks
    never straddle ranks and carry no per-token scale, so the same all-gathers assemble it)."""
    sites = [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.k_cache",
        "model.layers.0.self_attn.v_cache",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    for rank, rep in enumerate(online_ranks):
        for fmt in ("guidance", "guidance_mxfp4"):  # online NVFP4 + NVFP4 K/V; online MXFP4 + MXFP4 K/V
            g = rep[fmt]
            assert g["tp_rank"] == rank and g["sites"] == sites, (fmt, g)
            assert g["gathered_sites"] == sorted(sites[1:4] + sites[5:]), (fmt, g)
            assert g["record_equal"] and not g["unassembled_record_equal"], (fmt, rank, g)
            assert g["record_bytes"] > 0


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    from megatron_trace.models import make_tiny_checkpoint
    from sglang_backend.local import Engine
    from sglang_backend.local.server import serve
    from sglang_backend.server_process import ServerStartError, SGLangProcess

    ckpt = str(make_tiny_checkpoint(tmp_path_factory.mktemp("q2"), "qwen2", seed=1))
    # the launcher gives each CPU TP rank its own cores (SGLANG_CPU_OMP_THREADS_BIND; SGLang would ask
    # for one NUMA node per rank)
    env = {"TRACE_GUIDANCE_DIR": str(tmp_path_factory.mktemp("guidance"))}
    flags = [
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "16",
        "--tp-size",
        "2",
        "--quantization",
        "nvfp4",
        "--guidance-mode",
        "full",
    ]
    try:
        srv = SGLangProcess(ckpt, flags, log_path=tmp_path_factory.mktemp("sglang") / "server.log", env=env)
    except ServerStartError as e:
        pytest.fail(str(e))
    engine = Engine(ckpt, quantization="nvfp4", guidance_mode="full", guided_layers="last_half")
    emb = serve(engine)
    try:
        yield srv.url, emb.url
    finally:
        srv.stop()
        emb.shutdown()
        engine.shutdown()


def test_tp2_server_matches_the_embedded_engine(tp2_server):
    """Online NVFP4 at TP=2 (the S_enc of the full weights) and guidance at TP=2 (down_proj's K chunks
    gathered, rank 0 publishing): greedy tokens equal the embedded engine's, logprobs within 1e-5, and every
    sample's record (n = 2 included) agrees with the engine's as the TP=1 server's does."""
    from sglang_backend.api import GenerateRequest, SamplingParams
    from sglang_backend.client import RolloutClient
    from tests.sglang_server import PROMPTS, check_agreement, guidance_agreement  # the TP=1 server's agreement bar

    sg, emb = (RolloutClient(url, retries=0) for url in tp2_server)
    greedy = [SamplingParams(max_new_tokens=6, temperature=0, n=n, ignore_eos=True) for n in (1, 2)]
    reqs = [
        GenerateRequest(PROMPTS[0], greedy[1], rid="multi", return_guidance=True),
        GenerateRequest(PROMPTS[2], greedy[0], rid="single", return_guidance=True),
    ]
    a, b = sg.generate(reqs), emb.generate(reqs)
    assert len(a) == len(b) == 3 and [r.output_ids for r in a] == [r.output_ids for r in b]
    worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.output_logprobs, rb.output_logprobs))
    assert worst <= 1e-5, worst
    for ra, rb in zip(a, b):
        check_agreement(
            guidance_agreement(sg.fetch_guidance(ra.guidance_handle), emb.fetch_guidance(rb.guidance_handle))
        )


@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 4))
def test_kv_head_owners_take_each_head_once(size, log_heads):
    """Against SGLang's QKVParallelLinear rule: with H >= tp rank r holds H/tp heads from r*H/tp; with
    H < tp it holds head r // (tp // H). The owners' heads in rank order are 0..H-1, each once."""
    from sglang_backend.plugin.layer_tp import kv_head_owner_ranks

    heads = 1 << log_heads

    def held(r: int) -> list[int]:
        return list(range(r * heads // size, (r + 1) * heads // size)) if heads >= size else [r // (size // heads)]

    assert [h for r in kv_head_owner_ranks(heads, size) for h in held(r)] == list(range(heads))


def test_kv_head_owners_refuse_an_uneven_split():
    from sglang_backend.plugin.layer_tp import kv_head_owner_ranks

    with pytest.raises(ValueError, match="3 KV heads do not split over 2 TP ranks"):
        kv_head_owner_ranks(3, 2)
