"""The engine keeps freed heap memory (megatron_trace/kernels/cpu_alloc.py), so a large temporary made again every
decode step reuses pages instead of page-faulting them in: counted by the kernel's minor-fault
counter, not timed."""

import resource

import pytest
import torch

from megatron_trace.kernels import cpu_alloc, cpu_fused, cpu_routes

pytestmark = pytest.mark.skipif(not cpu_fused.available(torch.float32), reason="CPU kernels not built")


def _faults_of(make, times: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        make()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_repeated_large_temporary_reuses_its_pages():
    status = cpu_alloc.keep_freed_memory()
    if not status.startswith("glibc"):
        pytest.skip(status)
    assert cpu_alloc.keep_freed_memory() == status  # applied once per process

    def logits():  # a 32-row step's logits of a 151,936-token vocabulary, written once
        torch.empty(32, 151936).fill_(1.0)

    _faults_of(logits, 20)  # the heap grows to the pattern once
    pages = 32 * 151936 * 4 // 4096  # 4748: what one fresh mapping faults in (glibc's default: every time)
    # then ten more fault in less than one mapping's pages in all (measured: 0)
    assert _faults_of(logits, 10) < pages


def test_freed_memory_kept_by_the_engine_policy_goes_back_on_request():
    """What a finished phase freed stays resident under keep_freed_memory (below its 1 GiB trim
    threshold) until return_freed_memory gives it back: the quality gate's engines before the trainer."""
    status = cpu_alloc.keep_freed_memory()
    if not status.startswith("glibc"):
        pytest.skip(status)
    cpu_alloc.return_freed_memory()  # start from a trimmed heap
    chunks = [torch.ones(4 << 20) for _ in range(32)]  # 32 x 16 MiB = 512 MiB, each from the heap
    base = cpu_alloc._resident_bytes()
    del chunks
    kept = base - cpu_alloc._resident_bytes()
    assert kept < 64 << 20  # freed, still resident (measured: 0)
    assert cpu_alloc.return_freed_memory() > 448 << 20  # measured: 512 MiB


@pytest.mark.skipif(
    cpu_routes.routes().bf16_gemm != "bf16",
    reason="this CPU runs bf16 GEMMs in fp32 (kernels/cpu_routes.py): MKL's, which keep no per-shape oneDNN kernels",
)
@pytest.mark.parametrize("caches", ["bounded", "torch's default"])
def test_gemm_kernel_caches_stop_growing_once_full(caches):
    """oneDNN and ideep keep a compiled kernel per GEMM shape and direction (1,024 each by default,
    ~1.8 MiB a new token count at down_proj's shape); every packed micro-batch brings a new one. The
    train entry point bounds both: after 48 token counts have filled them, 24 more add nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for var in cpu_alloc.KERNEL_CACHE_VARS:
        env.pop(var, None)
        if caches != "bounded":
            env[var] = "1024"
    cmd = [sys.executable, str(root / "tests/mp_scripts/gemm_shapes_memory.py"), "48", "24"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    if caches == "bounded":
        assert grown["later"] < 12, grown  # heap noise (4.8 MiB over 48 more); unbounded: 1.8 MiB a count
    else:
        assert grown["later"] > 24, grown  # what the bound removes: the test sees it


def test_a_cpu_train_step_returns_freed_heap_where_fresh_mappings_follow(tmp_path, monkeypatch):
    """Before each micro-batch, before its backward (the head's fresh fp32 weight grad) and before the
    embedding's backward (its fresh dense weight grad, after every layer's): the points where the
    kept heap would sit under a new mapping. A forward-only pass trims nothing."""
    from megatron_trace.config import AlgoConfig, TrainerConfig
    from megatron_trace.models import ModelArch, QuantPolicy, make_tiny_checkpoint
    from megatron_trace.rl import Sample
    from megatron_trace.trainer.actor import Actor
    from megatron_trace.trainer.gpt import _unwrap
    from megatron_trace.trainer.parallel import destroy, init_distributed

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=3)
    init_distributed()
    try:
        arch = ModelArch.from_hf_config(ckpt)
        cfg = TrainerConfig(qat_mode="rtn", dtype="bfloat16", recompute="full", max_tokens_per_microbatch=16)
        actor = Actor(arch, QuantPolicy(kv="nvfp4"), cfg, hf_path=ckpt)
        events: list[str] = []
        monkeypatch.setattr(cpu_alloc, "return_freed_memory", lambda collect=True: events.append("trim") or 0)
        model = _unwrap(actor.ddp)
        for layer in model.decoder.layers:
            layer.register_full_backward_hook(lambda *_: events.append("layer backward"))
        model.embedding.word_embeddings.register_full_backward_pre_hook(lambda *_: events.append("embedding"))
        g = torch.Generator().manual_seed(0)
        batch = []
        for i in range(2):  # one sample per micro-batch
            ids = torch.randint(0, arch.vocab_size, (14,), generator=g).tolist()
            batch.append(Sample(f"s{i}", ids[:6], ids[6:], [-2.0] * 8, advantage=(-1.0) ** i))
        actor.compute_logprobs(batch)
        assert events == []
        actor.train_step(batch, AlgoConfig())
        one = ["trim", "trim"] + ["layer backward"] * arch.num_layers + ["trim", "embedding"]
        assert events == one * 2
    finally:
        destroy()
