"""The engine's fused C kernels against plain torch written the way HF's Qwen modules compute.

fp32 results agree to a few ulp (other summation order, a polynomial exp); bfloat16 results
round at the same points as HF, so they agree to one bf16 step. The NVFP4-page attention is
bit-equal to the dense kernel run on `fp4.nvfp4.dequantize`d pages.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.fp4 import nvfp4
from megatron_trace.kernels import cpu_attention, cpu_fused
from sglang_backend.local.layers import Rope, rms_norm

pytestmark = [
    pytest.mark.isa_avx2,
    pytest.mark.isa_baseline,
    pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler here"),
]
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [8, 37, 128])
def test_add_rmsnorm_updates_the_stream_and_normalizes(dtype, n):
    g = torch.Generator().manual_seed(n)
    x, r = (torch.randn(5, n, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(n, generator=g).to(dtype)
    ref_x = x + r
    stream = x.clone()
    out = cpu_fused.add_rmsnorm(stream, r, w, 1e-6)
    assert torch.equal(stream, ref_x)  # the residual add rounds exactly like torch's
    _close(out, rms_norm(ref_x, w, 1e-6), dtype)
    alone = cpu_fused.add_rmsnorm(ref_x.clone(), None, w, 1e-6)  # no residual: the stream is untouched
    assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_hf_mlp_activation(dtype):
    gu = (torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp clamps at both ends
    _close(cpu_fused.silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_rotates_q_and_stores_k_v_in_their_slots(dtype, qk_norm):
    heads, kv_heads, d, t = 4, 2, 32, 5
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    rope, positions = Rope(d, 10000.0), torch.tensor([0, 3, 4, 9, 17])
    cos, sin = rope.tables(positions, dtype)
    qn, kn = (torch.randn(d, generator=g).to(dtype) for _ in range(2)) if qk_norm else (None, None)
    kc, vc = (torch.zeros(12, kv_heads, d, dtype=dtype) for _ in range(2))
    slots = torch.tensor([7, 3, 11, 0, 5])
    q = cpu_fused.qkv_rope(
        qkv, heads, kv_heads, d, *rope.tables_upto(18, dtype), positions, qn, kn, 1e-6, kc, vc, slots
    )
    q_ref = qkv[:, : heads * d].reshape(t, heads, d)
    k_ref = qkv[:, heads * d : (heads + kv_heads) * d].reshape(t, kv_heads, d)
    if qk_norm:
        q_ref, k_ref = rms_norm(q_ref, qn, 1e-6), rms_norm(k_ref, kn, 1e-6)
    _close(q, Rope.apply(q_ref, cos, sin), dtype)
    _close(kc[slots], Rope.apply(k_ref, cos, sin), dtype)
    assert torch.equal(vc[slots], qkv[:, (heads + kv_heads) * d :].reshape(t, kv_heads, d))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


def _attention_ref(q, kc, vc, table, row_seq, row_len):
    out = []
    g = q.shape[1] // kc.shape[1]
    for t in range(q.shape[0]):
        slots = table[row_seq[t], : row_len[t]]
        k = kc[slots].float().repeat_interleave(g, 1)
        v = vc[slots].float().repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t].float(), k) * q.shape[-1] ** -0.5, -1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.integers(1, 4),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 16, 20, 32]),
    width=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_paged_attention_matches_softmax_attention(seqs, kv_heads, group, d, width, seed, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    heads, slots = kv_heads * group, 64
    kc, vc = (torch.randn(slots, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randint(0, slots, (seqs, width), generator=g)
    rows = int(torch.randint(1, 9, (), generator=g))
    row_seq = torch.randint(0, seqs, (rows,), generator=g)
    row_len = torch.randint(1, width + 1, (rows,), generator=g)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    out = cpu_attention.paged_attention(q, kc, vc, table, row_seq, row_len, d**-0.5)
    _close(out, _attention_ref(q, kc, vc, table, row_seq, row_len), dtype)


def test_paged_attention_reads_a_wider_table_by_its_row_stride():
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(50, 2, 16, generator=g) for _ in range(2))
    wide = torch.randint(0, 50, (3, 30), generator=g)  # reserved width 30, rows see at most 9
    q, row_seq, row_len = torch.randn(3, 4, 16, generator=g), torch.tensor([0, 1, 2]), torch.tensor([9, 1, 4])
    a = cpu_attention.paged_attention(q, kc, vc, wide, row_seq, row_len, 0.25)
    b = cpu_attention.paged_attention(q, kc, vc, wide[:, :9].contiguous(), row_seq, row_len, 0.25)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_page_attention_equals_attention_over_dequantized_pages(dtype):
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(40, 2, 32, generator=g) * 3, torch.randn(40, 2, 32, generator=g)
    gk, gv = torch.tensor(0.37), torch.tensor(2.5)
    qk, qv = nvfp4.quantize(k, global_scale=gk), nvfp4.quantize(v, global_scale=gv)
    table, row_seq, row_len = (
        torch.randint(0, 40, (3, 12), generator=g),
        torch.tensor([0, 2, 2, 1]),
        torch.tensor([1, 12, 5, 7]),
    )
    q = torch.randn(4, 4, 32, generator=g).to(dtype)
    dense = cpu_attention.paged_attention(
        q, nvfp4.dequantize(qk, dtype), nvfp4.dequantize(qv, dtype), table, row_seq, row_len, 32**-0.5
    )
    paged = cpu_attention.paged_attention_nvfp4(
        q,
        qk.data,
        qk.scale,
        qv.data,
        qv.scale,
        float(nvfp4.decode_scale(gk)),
        float(nvfp4.decode_scale(gv)),
        table,
        row_seq,
        row_len,
        32**-0.5,
    )
    assert torch.equal(dense, paged)
