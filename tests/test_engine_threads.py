"""Which thread runs the engine's steps: a caller that submits and waits (`generate`, the in-process
rollout) runs them itself, so the process keeps one OpenMP pool (a second one, on the worker,
made every parallel region pay a thread wake-up); requests nobody drives (the HTTP server's
submit + wait) run on the worker. Steps are attributed by recording the thread inside the
scheduler, not by timing."""

import threading

import pytest

from megatron_trace.models import make_tiny_checkpoint
from sglang_backend.api import GenerateRequest, SamplingParams
from sglang_backend.local import Engine, InProcessBackend

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = Engine(str(make_tiny_checkpoint(tmp_path_factory.mktemp("thr"), "qwen2", seed=3)), dtype="bfloat16")
    yield e
    e.shutdown()


@pytest.fixture
def step_threads(eng, monkeypatch):
    seen, real = [], eng.scheduler.step
    monkeypatch.setattr(eng.scheduler, "step", lambda: (seen.append(threading.get_ident()), real())[1])
    return seen


def test_generate_runs_every_step_on_the_callers_thread(eng, step_threads):
    want = eng.generate(input_ids=[[5, 6, 7], [9]], sampling_params=GREEDY)
    assert step_threads and set(step_threads) == {threading.get_ident()}
    step_threads.clear()
    # the in-process rollout backend drives too, and gets the same tokens
    got = InProcessBackend(eng).generate([GenerateRequest(p, SamplingParams(**GREEDY)) for p in ([5, 6, 7], [9])])
    assert set(step_threads) == {threading.get_ident()}
    assert [r.output_ids for r in got] == [o["output_ids"] for o in want]


def test_undriven_requests_run_on_the_worker(eng, step_threads):
    rids = eng.submit(GenerateRequest([4, 5], SamplingParams(**GREEDY)))
    out = eng.wait(rids)  # a plain wait (the HTTP server's) does not step
    assert len(out[0].output_ids) == 3
    assert step_threads and set(step_threads) == {eng._worker.ident}


def test_a_driver_finishing_hands_the_rest_to_the_worker(eng, step_threads):
    """Undriven work queued beside a driven request completes after the driver returns."""
    eng.pause_generation()
    try:
        other = eng.submit(GenerateRequest([8], SamplingParams(**{**GREEDY, "max_new_tokens": 6})))
        mine = eng.submit_all([GenerateRequest([3], SamplingParams(**GREEDY))], drive=True)[0]
    finally:
        eng.continue_generation()
    assert len(eng.wait(mine)[0].output_ids) == 3
    assert len(eng.wait(other)[0].output_ids) == 6
    assert threading.get_ident() in step_threads
