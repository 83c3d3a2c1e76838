"""MXFP4 W4A4 and MXFP4 K/V through a real SGLang 0.5.23 server on CPU, with guidance: the plugin's
online trace_mxfp4 linears record their activation sites (E8M0 per 32) and its per-side KV method
(plugin/kv_sides.py) records the K/V pages (E8M0 per 16, ceil rule) into the one record format the
embedded engine writes. One real server (tiny fp32 checkpoint, `--quantization mxfp4 --kv-cache-dtype
mxfp4`, full-code guidance of the last half), compared with the embedded engine on the same flags.
SGLang must be installed (the test command installs it).
"""

from __future__ import annotations

import pytest
import sglang  # noqa: F401 - a missing SGLang fails this module, it is not skipped

from megatron_trace.guidance import GuidanceRecord
from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.api import GenerateRequest
from sglang_backend.client import RolloutClient
from sglang_backend.local import Engine
from tests.sglang_server import PREFIX, PROMPTS, greedy, start_sglang

GUIDED = (2, 3)  # the last half of the tiny model's four layers
# the default policy quantizes the MLP; --kv-cache-dtype mxfp4 adds each guided layer's K and V pages
SITES = {f"model.layers.{i}.mlp.{s}" for i in GUIDED for s in ("gate_up_proj", "down_proj")} | {
    f"model.layers.{i}.self_attn.{s}" for i in GUIDED for s in ("k_cache", "v_cache")
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("q2mx"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def stacks(ckpt, tmp_path_factory):
    flags = ("--quantization", "mxfp4", "--kv-cache-dtype", "mxfp4", "--guidance-mode", "full")
    gen = start_sglang(ckpt, tmp_path_factory, *flags)
    url = next(gen)
    engine = Engine(ckpt, quantization="mxfp4", kv_cache_dtype="mxfp4", guidance_mode="full")
    client = RolloutClient(url, retries=0)
    try:
        yield client, engine
    finally:
        client.close()
        engine.shutdown()
        gen.close()  # stops the server (the generator's finally)


def test_greedy_matches_the_embedded_engine(stacks):
    client, engine = stacks
    assert engine.kv.side_fmt == ("mxfp4", "mxfp4")
    reqs = [GenerateRequest(p, greedy(), rid=f"mx{i}") for i, p in enumerate(PROMPTS)]
    got = client.generate(reqs)
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    want = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
    assert [r.output_ids for r in got] == [w["output_ids"] for w in want]
    diffs = [
        abs(r.output_logprobs[j] - w["meta_info"]["output_token_logprobs"][j][0])
        for r, w in zip(got, want)
        for j in range(8)
    ]
    print("max |dlogp| over", len(diffs), "positions:", max(diffs))
    assert max(diffs) <= 1e-5, max(diffs)


def _compare(a: GuidanceRecord, b: GuidanceRecord) -> dict[str, float]:
    """Two records of one sample: the same sites (the engine's set, MXFP4 activations and K/V), positions,
    shapes and static S_enc 1.0; returns per site the fraction of equal code bytes and E8M0 scale bytes."""
    assert set(a.sites) == set(b.sites) == SITES, (sorted(a.sites), sorted(b.sites))
    assert (a.mode, a.num_positions) == (b.mode, b.num_positions) == ("full", a.num_positions)
    out = {}
    for name, x in a.sites.items():
        y = b.sites[name]
        assert x.payload.shape == y.payload.shape and x.scale.shape == y.scale.shape, name
        assert x.global_scale.dim() == 0 and float(x.global_scale) == float(y.global_scale) == 1.0, name
        same = int((x.payload == y.payload).sum()) + int((x.scale == y.scale).sum())
        out[name] = same / (x.payload.numel() + x.scale.numel())
    return out


def test_guidance_records_equal_the_engines_for_every_mxfp4_site(stacks):
    """n = 2 over a prompt and one reusing a prefix the radix cache holds: every sample's record has
    the engine's MXFP4 sites (E8M0 per 32 of the MLP inputs, per 16 of K/V: [T, kv_heads, D/16]) and
    their codes and scale bytes equal the engine's."""
    client, engine = stacks
    client.generate([GenerateRequest(PREFIX + [99], greedy(max_new_tokens=1))])  # the prefix into the radix cache
    reqs = [
        GenerateRequest(PREFIX + [60, 61], greedy(n=2, max_new_tokens=6), rid="mxg-pre", return_guidance=True),
        GenerateRequest(PROMPTS[2], greedy(max_new_tokens=5), rid="mxg-one", return_guidance=True),
    ]
    got = client.generate(reqs)
    rids = [rid for group in engine.submit_all(reqs) for rid in group]
    want = engine.wait(rids)
    assert len(got) == len(want) == 3 and [r.output_ids for r in got] == [w.output_ids for w in want]
    for r, rid, n_pos in zip(got, rids, (len(PREFIX) + 2 + 5, len(PREFIX) + 2 + 5, len(PROMPTS[2]) + 4)):
        mine, theirs = client.fetch_guidance(r.guidance_handle), engine.fetch_guidance(rid)
        rec = mine
        assert rec.num_positions == n_pos
        k = rec.sites["model.layers.2.self_attn.k_cache"]
        assert k.scale.shape[1:] == (engine.arch.num_kv_heads, engine.arch.head_dim // 16)
        equal = _compare(mine, theirs)
        print("record", r.rid, f"{rec.bytes_per_token():.0f} B/token", "min equal fraction", min(equal.values()))
        assert all(v == 1.0 for v in equal.values()), equal
