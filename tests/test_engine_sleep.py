"""The colocated engine's sleep: SGLang's release_memory_occupation / resume_memory_occupation on the
embedded engine, in-process and over its HTTP server, and how a run resolves rollout.colocated."""

import weakref

import pytest
from safetensors.torch import load_file

from megatron_trace.config import Config
from megatron_trace.kernels import cpu_alloc
from megatron_trace.models import make_tiny_checkpoint
from megatron_trace.run.rollout import engine_sleeps
from sglang_backend.api import GenerateRequest, SamplingParams, WeightBucket
from sglang_backend.client import RolloutClient, RolloutError
from sglang_backend.local import Engine
from sglang_backend.local.server import serve

# Wide enough that the engine's memory stands out of the process's: ~60 MB of weights as served
# (bf16) and a 280 MB KV pool, where the main command's tiny model holds ~20 MB in all.
SHAPE = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "vocab_size": 16000}
SHAPE |= {"num_attention_heads": 8, "num_key_value_heads": 2}
REQS = [
    GenerateRequest([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=12, temperature=0.0)),
    GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=12, temperature=1.0, n=2, sampling_seed=3)),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sleep"), "qwen2", seed=2, dtype="bfloat16", **SHAPE)


@pytest.fixture
def engine(ckpt):
    eng = Engine(str(ckpt), dtype="bfloat16", quantization="nvfp4", kv_cache_dtype="nvfp4", max_total_tokens=1 << 19)
    yield eng
    eng.shutdown()


def _generate(engine: Engine) -> list[tuple[list[int], list[float]]]:
    rids = engine.submit_all(REQS, drive=True)
    return [(r.output_ids, r.output_logprobs) for r in engine.wait([x for rs in rids for x in rs])]


def _checkpoint_bucket(ckpt, version: int) -> WeightBucket:
    return WeightBucket(load_file(ckpt / "model.safetensors"), version)


def test_release_returns_the_engines_memory_and_the_refilled_engine_generates_the_same_tokens(engine, ckpt):
    before = _generate(engine)
    kv_bytes = sum(getattr(engine.kv, n).nbytes for n in ("values", "codes", "scales") if hasattr(engine.kv, n))
    weight_bytes = sum(p.nbytes for p in engine.model.parameters())
    cpu_alloc.return_freed_memory()  # the generation's temporaries: the drop below is the engine's
    rss = cpu_alloc.resident_gib()
    engine.release_memory_occupation(["kv_cache", "weights"])
    dropped = (rss - cpu_alloc.resident_gib()) * 2**30
    # the pool and the served weights at least (the FP4 codes, scales and BF16 sources go too)
    assert dropped >= 0.9 * (kv_bytes + weight_bytes), (dropped, kv_bytes, weight_bytes)
    assert engine.get_model_info()["memory_released"] == ["kv_cache", "weights"]
    with pytest.raises(RuntimeError, match="kv_cache and weights memory is released"):
        _generate(engine)
    ok, msg = engine.update_weights_from_bucket(_checkpoint_bucket(ckpt, 1))
    assert not ok and "resume_memory_occupation(['weights']) first" in msg
    engine.resume_memory_occupation(["weights", "kv_cache"])
    # resumed, not refilled: generation would read zeros, so it is refused until the sync
    with pytest.raises(RuntimeError, match=r"resumed but \d+ tensors have not been refilled"):
        _generate(engine)
    ok, msg = engine.update_weights_from_bucket(_checkpoint_bucket(ckpt, 1))
    assert ok, msg
    assert _generate(engine) == before  # token for token, logprob for logprob


def test_kv_cache_alone_sleeps_and_wakes_without_a_weight_update(engine):
    before = _generate(engine)
    pool = weakref.ref(engine.kv)
    engine.release_memory_occupation(["kv_cache"])
    # gone with the weights still loaded: the layers' cached C arguments had kept it alive
    assert pool() is None
    assert engine.get_model_info()["memory_released"] == ["kv_cache"]
    engine.resume_memory_occupation(["kv_cache"])
    assert _generate(engine) == before


def test_release_is_refused_while_requests_wait_and_tags_are_checked(engine):
    engine.pause_generation()  # the request below stays queued: no race with the worker
    rids = engine.submit(REQS[0])
    with pytest.raises(RuntimeError, match="needs an idle engine: 0 sequences run and 1 requests wait"):
        engine.release_memory_occupation(None)
    engine.continue_generation()
    engine.wait(rids)
    with pytest.raises(ValueError, match=r"unknown memory tags \['gpu'\]; allowed: weights, kv_cache, cuda_graph"):
        engine.release_memory_occupation(["gpu"])
    engine.release_memory_occupation(["cuda_graph"])  # SGLang's third tag: nothing of it here
    assert engine.get_model_info()["memory_released"] == []


def test_the_http_server_answers_the_same_calls(engine, ckpt):
    """Over the embedded server, through the client the http backend uses: SGLang's endpoints."""
    srv = serve(engine, api_key="k", max_body_bytes=128 << 20)  # one bucket: the whole checkpoint, 60 MB
    client = RolloutClient(srv.url, api_key="k", retries=0)

    def generate():  # one request at a time: the same batches each time, so the same bits
        return [(r.output_ids, r.output_logprobs, r.weight_version) for req in REQS for r in client.generate([req])]

    try:
        before = generate()
        client.release_memory_occupation(["kv_cache", "weights"])
        with pytest.raises(RolloutError, match="memory is released"):
            client.generate(REQS[:1])
        with pytest.raises(RolloutError, match="unknown memory tags"):
            client.release_memory_occupation(["everything"])
        client.resume_memory_occupation(["weights", "kv_cache"])
        client.update_weights(_checkpoint_bucket(ckpt, 2))
        after = generate()
        assert [r[:2] for r in after] == [r[:2] for r in before] and {r[2] for r in after} == {"2"}
    finally:
        client.close()
        srv.shutdown()


@pytest.mark.parametrize(
    "overrides, sleeps",
    [
        ([], True),  # the embedded engine shares the process: it sleeps
        (["rollout.colocated=off"], False),
        (["rollout.backend=http"], False),  # a server may be anywhere: only when told
        (["rollout.backend=http", "rollout.colocated=on"], True),
        (["algo.async_rollout=true"], False),  # it rolls out while the trainer trains
    ],
)
def test_rollout_colocated_is_resolved_once(overrides, sleeps):
    assert engine_sleeps(Config.load(None, overrides)) is sleeps


def test_colocated_on_with_async_rollout_is_refused():
    with pytest.raises(ValueError, match="rollout.colocated=on frees the rollout engine while the trainer trains"):
        engine_sleeps(Config.load(None, ["rollout.colocated=on", "algo.async_rollout=true"]))
