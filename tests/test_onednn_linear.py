"""megatron_trace/kernels/onednn_linear: the prepacked oneDNN bf16 GEMM gives F.linear's bits, and the engine never
multiplies by a packed copy older than its weights (updates, refused updates rolled back)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from megatron_trace.kernels import onednn_linear
from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.local import Engine
from tests.helpers import WIDE  # above the one-call C layer: batches run the torch GEMMs

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason=f"{onednn_linear.unavailable_reason()}")


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 80), n=st.integers(1, 300), k=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 99))
def test_the_packed_gemm_gives_f_linears_bits(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = onednn_linear.PackedWeight().linear(x, w, b, key=0)
    assert torch.equal(got, torch.nn.functional.linear(x, w, b))


def test_a_new_key_repacks_and_the_same_key_reuses():
    w, x = torch.randn(64, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    packed = onednn_linear.PackedWeight()
    first = packed.linear(x, w, None, key=(w.data_ptr(), w._version))
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(packed.linear(x, w, None, key=(w.data_ptr(), w._version)), 2 * first)
    assert torch.equal(packed.linear(x, 3 * w, None, key=(w.data_ptr(), w._version)), 2 * first)  # the cache


def _batch(eng):
    prompts = [[3 + i, 9 + 2 * i, 17 + i] for i in range(6)]  # 6 rows: above the decode widths
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    out = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
    return [(o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]]) for o in out]


def test_engine_batches_after_a_weight_update_and_a_rollback_use_the_weights_in_force(tmp_path):
    """BF16 engine: a batch, an update to another checkpoint's weights (every linear and the LM head),
    a batch equal to a fresh engine's on those weights; then a refused update (rolled back with
    load_state_dict), and batches equal to that fresh engine's still."""
    a = make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=1, dtype="bfloat16", **WIDE)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=2, dtype="bfloat16", **WIDE)
    eng, fresh = Engine(str(a), dtype="bfloat16"), Engine(str(b), dtype="bfloat16")
    try:
        assert "gemm: onednn-packed" in eng.get_model_info()["cpu_linear"]
        before = _batch(eng)
        new = load_file(str(b / "model.safetensors"))
        assert eng.update_weights_from_tensor(new)[0]
        want = _batch(fresh)
        assert _batch(eng) == want != before
        half = dict(list(new.items())[:3])
        half["lm_head.weight"] = torch.full_like(new["lm_head.weight"], float("nan"))
        ok, message = eng.update_weights_from_tensor(half)
        assert not ok and "NaN" in message
        bad_shape = {"model.norm.weight": new["model.norm.weight"], "lm_head.weight": new["lm_head.weight"][:5]}
        ok, message = eng.update_weights_from_tensor(bad_shape)
        assert not ok and "shape" in message  # failed after the norm was written: rolled back
        assert _batch(eng) == want
    finally:
        eng.shutdown()
        fresh.shutdown()


def test_without_onednn_the_engine_says_so_and_gives_the_same_numbers(tmp_path, monkeypatch):
    """(Where a CPU has no bf16 path at all, packing is off from the start: tests/test_cpu_routes.py.)"""
    path = make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=1, dtype="bfloat16", **WIDE)
    eng = Engine(str(path), dtype="bfloat16")
    try:
        packed = _batch(eng)
        monkeypatch.setattr(onednn_linear, "unavailable_reason", lambda: "no oneDNN in this torch (test)")
        plain = _batch(eng)
        assert eng.get_model_info()["cpu_linear"].endswith("gemm: F.linear (no oneDNN in this torch (test))")
        assert plain == packed  # F.linear's bits either way
    finally:
        eng.shutdown()
