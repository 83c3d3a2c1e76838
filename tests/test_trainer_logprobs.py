"""Chunked vocab-parallel logprobs: values, entropy and gradients equal the whole-vocabulary
reference (log_softmax at the temperature, top-k/top-p renormalized, autograd), one chunk or many,
on one rank and split over two gloo ranks; the distributed top-k/top-p support equals
`keep_mask` on the gathered probabilities exactly."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.trainer.logprobs import VocabSpec, _support, chunked_logprobs
from sglang_backend.api import keep_mask, needs_filter, support_logprob

pytestmark = pytest.mark.isa_avx2

H, V = 16, 96


def _data(seed: int, rows: int, vocab_rows: int = V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, H, generator=g)
    w = torch.randn(vocab_rows, H, generator=g) * 0.8
    labels = torch.randint(0, V, (rows,), generator=g)
    return h, w, labels


def _reference(h, w, labels, real: int, t: float, top_k: int, top_p: float):
    logp = torch.log_softmax((h @ w[:real].t()) / t, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    if needs_filter(top_k, top_p, 0.0, real):
        with torch.no_grad():
            keep = keep_mask(logp.exp(), top_k, top_p)
        return support_logprob(logp, labels, keep), ent
    return logp.gather(-1, labels[:, None])[:, 0], ent


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.4, 1.6),
    top_k=st.sampled_from([-1, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    chunk_rows=st.sampled_from([1, 3, 64]),
)
def test_one_rank_equals_the_whole_vocabulary_reference(seed, temperature, top_k, top_p, chunk_rows):
    h, w, labels = _data(seed, 11, vocab_rows=V + 32)  # 32 rows of Megatron's vocab padding
    spec = VocabSpec(0, V, temperature, top_k, top_p, chunk_bytes=chunk_rows * 4 * (V + 32))
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want, want_ent = _reference(hr, wr, labels, V, temperature, top_k, top_p)
    (want * torch.linspace(-1, 2, len(labels))).sum().backward()
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    got, ent = chunked_logprobs(hc, wc, labels, spec)
    (got * torch.linspace(-1, 2, len(labels))).sum().backward()
    # torch's own log_softmax per row; the GEMM over a chunk of rows may round its last bit apart
    assert torch.allclose(got, want.detach(), atol=1e-5, rtol=1e-6)
    assert torch.allclose(ent, want_ent.detach(), atol=1e-5)
    assert torch.allclose(hc.grad, hr.grad, atol=1e-5, rtol=1e-5)
    assert torch.allclose(wc.grad, wr.grad, atol=1e-5, rtol=1e-5)
    assert not wc.grad[V:].any()  # padding rows get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_bits_with_one_gemm_less(dtype, monkeypatch):
    """trainer.logprob_keep_logits_mb: the forward's h·Wᵀ kept for the backward gives the bits the
    recomputing backward gives (values and both grads), and the backward forms no logits of its own;
    logits larger than the allowance are recomputed."""
    from megatron_trace.trainer import logprobs

    calls = []
    real = logprobs._chunk_logits
    monkeypatch.setattr(logprobs, "_chunk_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, w, labels = _data(5, 23, vocab_rows=V + 32)
    h, w = h.to(dtype), w.to(dtype)
    need = len(labels) * V * w.element_size()
    out = {}
    for keep in (0, need - 1, need):
        calls.clear()
        spec = VocabSpec(0, V, 0.7, chunk_bytes=4 * 4 * (V + 32), keep_logits_bytes=keep)  # six chunks
        hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = chunked_logprobs(hc, wc, labels, spec)
        (lp * torch.linspace(-1, 2, len(labels))).sum().backward()
        out[keep] = (lp.detach(), ent, hc.grad, wc.grad, len(calls))
    assert [out[k][-1] for k in (0, need - 1, need)] == [12, 12, 6]
    for a, b in zip(out[0][:-1], out[need][:-1]):
        assert torch.equal(a, b)
    kept = []  # a forward-only pass (no_grad, the logprob recompute) keeps nothing
    monkeypatch.setattr(logprobs._ChunkedLogprob, "apply", lambda *a: kept.append(a[-1]) or (a[0][:, 0], a[0][:, 0]))
    spec = VocabSpec(0, V, keep_logits_bytes=need)
    with torch.no_grad():
        chunked_logprobs(h.clone().requires_grad_(), w.clone().requires_grad_(), labels, spec)
    chunked_logprobs(h.clone().requires_grad_(), w, labels, spec)
    assert kept == [0, need]


def test_a_bf16_head_has_megatrons_output_layer_gradients():
    """bf16 weights (the real config's trainer): the weight grad is each chunk's bf16 GEMM of the
    logits grad in bf16 (what Megatron's output layer computes from its bf16 logits), summed in fp32.
    Against autograd through the whole-vocabulary bf16 reference (one bf16 GEMM over every row) it
    agrees to bf16's rounding, and it is no further than that reference from the fp64 gradient."""
    h, w, labels = _data(3, 23)
    h, w = h.bfloat16(), w.bfloat16()
    spec = VocabSpec(0, V, chunk_bytes=4 * 4 * V)  # 4 rows a chunk: six chunks
    weights = torch.linspace(-1, 2, len(labels))
    grads = {}
    for name, dtype in (("chunked", None), ("bf16", torch.bfloat16), ("fp64", torch.float64)):
        hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
        if dtype is None:
            got, _ = chunked_logprobs(hc, wc, labels, spec)
        else:
            hd, wd = hc.to(dtype), wc.to(dtype)
            got = torch.log_softmax((hd @ wd.t()).double(), -1).gather(-1, labels[:, None])[:, 0]
        (got * weights.to(got.dtype)).sum().backward()
        grads[name] = (hc.grad.double(), wc.grad.double())
    for i in range(2):  # hidden, weight
        ref, exact, mine = grads["bf16"][i], grads["fp64"][i], grads["chunked"][i]
        scale = exact.abs().max()
        assert torch.allclose(mine, ref, atol=2**-7 * scale, rtol=2**-6)
        assert (mine - exact).abs().max() <= (ref - exact).abs().max() + 2**-8 * scale


def _worker(rank: int, world: int, path: str, cases) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        out = []
        per = (V + 32) // world
        for seed, t, top_k, top_p in cases:
            h, w, labels = _data(seed, 9, vocab_rows=V + 32)
            group = dist.group.WORLD
            spec = VocabSpec(rank * per, V, t, top_k, top_p, chunk_bytes=2 * 4 * per, group=group)
            hc, wc = h.clone().requires_grad_(), w[rank * per : (rank + 1) * per].clone().requires_grad_()
            got, ent = chunked_logprobs(hc, wc, labels, spec)
            (got * torch.linspace(-1, 2, len(labels))).sum().backward()
            dist.all_reduce(hc.grad)  # the input's grad: Megatron's TP copy all-reduces it
            # the support on given probabilities (every rank its slice of one tensor)
            probs = torch.softmax(torch.randn(9, V, generator=torch.Generator().manual_seed(seed)) * 3, -1)
            local = probs[:, rank * per : min((rank + 1) * per, V)]
            keep = _support(local, VocabSpec(rank * per, V, 1.0, top_k, top_p, group=group))
            out.append((got.detach(), ent, hc.grad, wc.grad, keep))
        torch.save(out, f"{path}.{rank}.pt")
    finally:
        dist.destroy_process_group()


CASES = [(1, 1.0, -1, 1.0), (2, 0.7, 5, 1.0), (3, 1.3, -1, 0.3), (4, 1.0, 40, 0.9), (5, 0.5, 1, 0.5)]


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        mp.start_processes(_worker, args=(2, path, CASES), nprocs=2, join=True, start_method="spawn")
        yield [torch.load(f"{path}.{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_two_vocab_parallel_ranks_equal_the_reference(two_ranks, case):
    seed, t, top_k, top_p = CASES[case]
    h, w, labels = _data(seed, 9, vocab_rows=V + 32)
    per = (V + 32) // 2
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    want, want_ent = _reference(hr, wr, labels, V, t, top_k, top_p)
    (want * torch.linspace(-1, 2, len(labels))).sum().backward()
    for rank, res in enumerate(two_ranks):
        got, ent, h_grad, w_grad, keep = res[case]
        assert torch.allclose(got, want.detach(), atol=1e-5, rtol=1e-6), rank
        assert torch.allclose(ent, want_ent.detach(), atol=1e-5), rank
        assert torch.allclose(h_grad, hr.grad, atol=1e-5, rtol=1e-5), rank
        assert torch.allclose(w_grad, wr.grad[rank * per : (rank + 1) * per], atol=1e-5, rtol=1e-5), rank
    probs = torch.softmax(torch.randn(9, V, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    whole = keep_mask(probs, top_k, top_p) if needs_filter(top_k, top_p, 0.0, V) else None
    parts = [res[case][4] for res in two_ranks]
    if whole is None:
        assert all(p is None for p in parts)
    else:
        assert torch.equal(torch.cat(parts, -1), whole)


def test_the_chunked_head_reuses_one_workspace_and_holds_what_the_memory_model_says():
    """At the real 0.5B's vocab and hidden size (151,936 x 896, bf16) under the engine's heap policy,
    which keeps freed memory: a forward + backward over five chunks page-faults in about its own
    buffers' pages (the workspace, the fp32 weight grad, one chunk's bf16 product, the bf16 grad), not
    a fresh product and logits per chunk, and the second call's peak is the memory model's logits
    term, measured (fresh per-chunk tensors grew it call by call: 0.9 -> 2.0 GiB for the forward)."""
    import resource

    from megatron_trace.kernels import cpu_alloc
    from megatron_trace.perf import memory as pm

    status = cpu_alloc.keep_freed_memory()
    if not status.startswith("glibc"):
        pytest.skip(status)
    vocab, hidden, rows, chunk = 151_936, 896, 128, 16 << 20  # 27 rows a chunk: five chunks
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    spec = VocabSpec(0, vocab, chunk_bytes=chunk)

    def call() -> tuple[float, int]:
        w.grad = h.grad = None
        cpu_alloc.return_freed_memory()
        base = cpu_alloc.reset_peak_rss()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        lp, _ = chunked_logprobs(h, w, labels, spec)
        lp.sum().backward()
        return (cpu_alloc.peak_rss() - base) * 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    call()
    peak, faults = call()
    chunk_rows = chunk // (4 * vocab) * 4 * vocab  # the workspace's rows, whole
    own = 3.25 * chunk_rows + vocab * hidden * (4 + 2) + vocab * hidden * 2  # + the bf16 grad it returns
    assert faults < 1.1 * own / 4096, (faults, own / 4096)  # a fresh product a chunk: 2.2x these
    m = pm.ModelSpec("head", layers=0, hidden=hidden, heads=1, kv_heads=1, head_dim=1, vocab=vocab)
    plan = pm.TrainerPlan(tokens_per_microbatch=rows, logprob_chunk_mb=chunk / 2**20)
    model = pm.estimate(m, plan)["logits"]  # the memory model's term for this shape
    assert 0.9 * model < peak < 1.1 * model, (peak / 2**30, model / 2**30)
