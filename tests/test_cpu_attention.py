"""The threaded (row, KV head) paged-attention kernel (megatron_trace/kernels/cpu_attention_typed.h) on the shapes its
fast paths key on: head dims 64 and 128 (unrolled), lengths around its 8-position blocks and 32-row
prefetch distance, GQA groups of 1 to 7, several rows per sequence and batches of sequences.

Dense pages agree with softmax attention in float64 to the tolerances tests/test_cpu_fused.py uses;
NVFP4 and mixed-format pages are bit-equal to the dense kernel over the pages dequantized in the
model dtype; and the bits do not depend on how many threads split the work items.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import fp8, nvfp4
from megatron_trace.kernels import cpu_attention, cpu_fused

pytestmark = [
    pytest.mark.isa_avx2,
    pytest.mark.isa_baseline,
    pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler here"),
]
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _reference(q, kc, vc, table, row_seq, row_len, scale):
    """softmax(q k^T * scale) v per row in float64 over the row's slots, query head h on KV head h // G."""
    g = q.shape[1] // kc.shape[1]
    out = []
    for t in range(q.shape[0]):
        slots = table[row_seq[t], : row_len[t]]
        k = kc[slots].double().repeat_interleave(g, 1)
        v = vc[slots].double().repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t].double(), k) * scale, -1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


def _problem(seed, seqs, kv_heads, group, d, longest, dtype, slots=None):
    g = torch.Generator().manual_seed(seed)
    slots = slots or seqs * longest + 7
    k, v = torch.randn(slots, kv_heads, d, generator=g) * 2, torch.randn(slots, kv_heads, d, generator=g)
    table = torch.stack([torch.randperm(slots, generator=g)[:longest] for _ in range(seqs)])  # scattered slots
    rows = int(torch.randint(1, 7, (), generator=g))
    row_seq = torch.randint(0, seqs, (rows,), generator=g)
    row_len = torch.randint(1, longest + 1, (rows,), generator=g)
    row_len[0] = longest  # one row spans the whole table width
    q = torch.randn(rows, kv_heads * group, d, generator=g).to(dtype)
    return q, k, v, table, row_seq, row_len


LENGTHS = st.sampled_from([1, 7, 8, 9, 31, 32, 33, 40, 65, 100])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    seqs=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 7]),
    d=st.sampled_from([16, 24, 64, 128]),
    longest=LENGTHS,
    bf16=st.booleans(),
)
def test_dense_pages_match_float64_softmax_attention(seed, seqs, kv_heads, group, d, longest, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, table, row_seq, row_len = _problem(seed, seqs, kv_heads, group, d, longest, dtype)
    kc, vc = k.to(dtype), v.to(dtype)
    out = cpu_attention.paged_attention(q, kc, vc, table, row_seq, row_len, d**-0.5)
    ref = _reference(q, kc, vc, table, row_seq, row_len, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    seqs=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 7]),
    d=st.sampled_from([16, 64, 128]),
    longest=LENGTHS,
    bf16=st.booleans(),
)
def test_nvfp4_and_fp8_pages_equal_dense_attention_over_their_dequantized_pages(
    seed, seqs, kv_heads, group, d, longest, bf16
):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, table, row_seq, row_len = _problem(seed, seqs, kv_heads, group, d, longest, dtype)
    gk, gv = torch.tensor(0.37), torch.tensor(2.5)
    qk, qv = nvfp4.quantize(k, global_scale=gk), nvfp4.quantize(v, global_scale=gv)
    sk, sv = float(nvfp4.decode_scale(gk)), float(nvfp4.decode_scale(gv))
    kd, vd = nvfp4.dequantize(qk, dtype), nvfp4.dequantize(qv, dtype)
    dense = cpu_attention.paged_attention(q, kd, vd, table, row_seq, row_len, 0.2)
    paged = cpu_attention.paged_attention_nvfp4(
        q, qk.data, qk.scale, qv.data, qv.scale, sk, sv, table, row_seq, row_len, 0.2
    )
    assert torch.equal(dense, paged)
    k8 = fp8.quantize(k, dims=2)  # FP8 K beside NVFP4 V: the mixed-format use of the same kernel
    k8d = fp8.dequantize(k8, dtype)
    mixed = cpu_attention.paged_attention_kv(
        q, "fp8", (k8.data, k8.scale), 0.0, "nvfp4", (qv.data, qv.scale), sv, table, row_seq, row_len, 0.2
    )
    assert torch.equal(mixed, cpu_attention.paged_attention(q, k8d, vd, table, row_seq, row_len, 0.2))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_results_do_not_depend_on_the_thread_count(fmt):
    q, k, v, table, row_seq, row_len = _problem(3, 4, 2, 7, 64, 600, torch.bfloat16)  # above the serial cutoff
    if fmt == "nvfp4":
        qk, qv = nvfp4.quantize(k), nvfp4.quantize(v)
        sk, sv = float(nvfp4.decode_scale(qk.global_scale)), float(nvfp4.decode_scale(qv.global_scale))

        def run():
            return cpu_attention.paged_attention_nvfp4(
                q, qk.data, qk.scale, qv.data, qv.scale, sk, sv, table, row_seq, row_len, 0.125
            )
    else:
        kc, vc = k.bfloat16(), v.bfloat16()

        def run():
            return cpu_attention.paged_attention(q, kc, vc, table, row_seq, row_len, 0.125)

    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run())
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    seqs=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 7]),
    d=st.sampled_from([16, 64]),
    longest=LENGTHS,
    bf16=st.booleans(),
    k_fmt=st.sampled_from(["nvfp4", "fp8"]),
)
def test_a_k_offset_by_column_equals_attention_over_the_offset_rows(
    seed, seqs, kv_heads, group, d, longest, bf16, k_fmt
):
    """k_add (a de-biased K cache's RoPE_pos(b)): the kernel's K at table column j is
    (decoded.float() + k_add[j]).to(dtype), the engine's torch read, bit for bit."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, table, row_seq, row_len = _problem(seed, seqs, kv_heads, group, d, longest, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    add = torch.randn(longest + 3, kv_heads, d, generator=g) * 30  # Qwen2.5-sized bias
    if k_fmt == "nvfp4":
        gk = torch.tensor(0.37)
        qk = nvfp4.quantize(k, global_scale=gk)
        kd, pages, sdec = nvfp4.dequantize(qk, dtype), (qk.data, qk.scale), float(nvfp4.decode_scale(gk))
    else:
        qk = fp8.quantize(k, dims=2)
        kd, pages, sdec = fp8.dequantize(qk, dtype), (qk.data, qk.scale), 0.0
    vd = v.to(dtype)
    cols = torch.arange(longest)
    dense_k = (kd[table].float() + add[cols][None]).to(dtype).reshape(-1, kv_heads, d)  # [seqs * longest]
    dense_table = torch.arange(seqs * longest).view(seqs, longest)
    want = cpu_attention.paged_attention(
        q, dense_k, vd[table].reshape(-1, kv_heads, d), dense_table, row_seq, row_len, 0.2
    )
    # "bf16" names the model-dtype side (fp32 pages in an fp32 model)
    got = cpu_attention.paged_attention_kv(
        q, k_fmt, pages, sdec, "bf16", (vd, None), 1.0, table, row_seq, row_len, 0.2, k_add=add
    )
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="k_add must be contiguous fp32"):
        cpu_attention.paged_attention_kv(
            q, k_fmt, pages, sdec, "bf16", (vd, None), 1.0, table, row_seq, row_len, 0.2, k_add=add[: longest - 1]
        )
