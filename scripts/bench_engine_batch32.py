"""Engine-only decode throughput of the tiny model at batch 32 for a checkout ROOT (no HF baseline).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_batch32.py ROOT

For bisecting engine speed across commits (`git worktree add /tmp/x REV`, run it on each root in
turn, alternate): the project's tiny qwen2, 32 prompts x 16 tokens + 64 greedy new tokens, 1 thread,
BF16-equiv and NVFP4 W4A4 + NVFP4 KV, median of 9 generate calls after a warm-up; prints tok/s.
Uses only Engine and make_tiny_checkpoint, so it runs against older checkouts too.
"""

import statistics
import sys
import tempfile
import time

root = sys.argv[1]
sys.path.insert(0, root)
import torch  # noqa: E402

torch.set_num_threads(1)
from megatron_trace.models import make_tiny_checkpoint  # noqa: E402
from sglang_backend.local import Engine  # noqa: E402

ck = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen2", seed=0)
out = {}
for name, kw in (
    ("bf16", dict(quantization=None, kv_cache_dtype="auto")),
    ("fp4", dict(quantization="nvfp4", kv_cache_dtype="nvfp4")),
):
    eng = Engine(str(ck), **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (16,), generator=g).tolist() for _ in range(32)]
    sp = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    eng.generate(input_ids=prompts, sampling_params=sp)
    ts = []
    for _ in range(9):
        t = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        ts.append(time.perf_counter() - t)
    out[name] = 32 * 64 / statistics.median(ts)
    eng.shutdown()
print(root, {k: round(v) for k, v in out.items()})
