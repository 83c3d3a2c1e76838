"""A failing step or guidance record answers every request with an abort; the engine keeps serving."""

import pytest

from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.local import Engine
from sglang_backend.local import engine as engine_mod

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("err"), "qwen2", seed=2)
    e = Engine(str(ckpt), quantization="nvfp4", kv_cache_dtype="nvfp4", max_running_requests=2)
    yield e
    e.shutdown()


def _fail_once(monkeypatch, obj, name):
    real, calls = getattr(obj, name), []

    def boom(*a, **k):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected failure")
        return real(*a, **k)

    monkeypatch.setattr(obj, name, boom)


def test_failing_prefill_aborts_admitted_and_waiting_requests(eng, monkeypatch):
    want = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY)
    _fail_once(monkeypatch, eng.model, "forward")  # first forward = the prefill of admitted groups
    # 3 prompts, n=2 on the first: 2 are admitted (max_running 2), the rest wait.
    out = eng.generate(
        input_ids=[[5, 6, 7], [8, 9], [10, 11]],
        sampling_params=[{**GREEDY, "n": 2}, GREEDY, GREEDY],
        rid=["a", "b", "c"],
    )
    assert len(out) == 4
    for o in out:
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert "injected failure" in o["meta_info"]["finish_reason"]["message"]
    assert len(eng.kv.free_pages) == eng.kv.num_pages  # every reserved page came back
    again = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in want]


def test_failing_decode_aborts_running_requests(eng, monkeypatch):
    calls = []
    real = eng.model.forward

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected decode failure")
        return real(*a, **k)

    monkeypatch.setattr(eng.model, "forward", fail_second)
    out = eng.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY)
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
    monkeypatch.setattr(eng.model, "forward", real)
    assert len(eng.generate(input_ids=[5, 6], sampling_params=GREEDY)["output_ids"]) == 4


def test_failing_guidance_record_aborts_only_that_request(eng, monkeypatch):
    _fail_once(monkeypatch, engine_mod, "guidance_record")
    out = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_guidance=True)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected failure" in out["meta_info"]["finish_reason"]["message"]
    ok = eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, return_guidance=True)
    assert ok["meta_info"]["finish_reason"]["type"] == "length" and ok["meta_info"]["guidance_handle"]
    eng.fetch_guidance(ok["meta_info"]["guidance_handle"])


def test_guidance_without_any_quantized_site_is_refused_by_name(tmp_path):
    """W4A16 MXFP4 weights + BF16 KV: no site records codes, so a guidance request is an error
    naming the policy (not a record with nothing in it); a KV-only NVFP4 engine records K/V guidance."""
    ckpt = make_tiny_checkpoint(tmp_path, "qwen2", seed=2)
    e = Engine(str(ckpt), quantization="w4a16_mxfp4", kv_cache_dtype="bf16")
    try:
        with pytest.raises(ValueError, match="quantized sites.*format mxfp4, activations bf16, K bf16, V bf16"):
            e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY, return_guidance=True)
    finally:
        e.shutdown()
    e = Engine(str(ckpt), quantization=None, kv_cache_dtype="nvfp4")
    try:
        out = e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY, return_guidance=True, rid="kv")
        record = e.fetch_guidance(out[0]["meta_info"].get("guidance_handle", "kv"))
        assert {name.rsplit(".", 1)[1] for name in record.sites} == {"k_cache", "v_cache"}
        assert len(record.sites) == 2 * len(e.guided) and record.num_positions == 3 + 4 - 1  # K and V per guided layer
    finally:
        e.shutdown()
