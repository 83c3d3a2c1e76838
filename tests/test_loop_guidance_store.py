"""The RL loop keeps waiting guidance in the GuidanceStore: the rollout puts each record as it
fetches it (so in async mode step k+1's records are stored, and spilled, while step k trains),
the waiting batch holds handles, the step that trains gets them back and releases them. With a
zero memory budget everything spills and training sees exactly the records it sees without it."""

import pytest
import torch

from megatron_trace.config import Config
from megatron_trace.data import ArithmeticTask, CharTokenizer, get_reward_fn
from megatron_trace.guidance import GuidanceRecord, GuidanceStore, StoredRecord
from megatron_trace.run.step import StepTrainer, share_batch
from megatron_trace.trainer.actor import TrainStepResult
from sglang_backend.api import GenerateResult
from tests.helpers import make_record, tiny_rollout

RESPONSE = [3, 4]


class GuidedServer:
    """The rollout side with the plugin: two tokens per sample and a guidance record behind a handle."""

    def __init__(self):
        self.fetched = {}

    def generate(self, reqs):
        return [
            GenerateResult(
                f"{r.rid}-{k}",
                RESPONSE,
                [-0.5, -0.7],
                {"type": "length", "length": 2},
                len(r.input_ids),
                "0",
                guidance_handle=f"{r.rid}-{k}",
            )
            for r in reqs
            for k in range(r.sampling_params.n)
        ]

    def fetch_guidance(self, handle: str) -> GuidanceRecord:
        # A fresh, distinct record per fetch (the same rid in two steps is two records)
        record = make_record(handle, positions=4, seed=len(self.fetched))
        self.fetched.setdefault(handle, []).append(record.to_bytes())
        return record


class RecordingActor:
    """Stands in for the Megatron actor: keeps the record bytes each train step was given."""

    def __init__(self):
        self.seen = []

    def train_step(self, samples, algo):
        self.seen.append({s.sample_id: s.guidance.to_bytes() for s in samples})
        return TrainStepResult({"loss": 0.0}, [torch.tensor(s.rollout_logprobs) for s in samples], {}, {}, {}, {})


class SamePrompts:
    """Every step draws the same prompts: async mode's worst case, equal rids in two waiting steps."""

    def __init__(self, task):
        self.task = task

    def sample(self, n, step):
        return self.task.sample(n, 0)


def _two_overlapping_steps(store):
    """Step 1 is rolled out from the same weight version before step 0 trains, as async mode does."""
    cfg = Config.load("configs/tiny_cpu.yaml", ["rollout.prompts_per_step=2", "rollout.n_samples=2"])
    tok, server, actor = CharTokenizer(), GuidedServer(), RecordingActor()
    prompts = SamePrompts(ArithmeticTask(tokenizer=tok))
    rollout = tiny_rollout(cfg, server, tok, prompts, get_reward_fn("exact_match"), store=store)
    runner = StepTrainer(cfg, actor, store)
    batches = [share_batch(rollout.run(step, version=0), store) for step in (0, 1)]
    if store is not None:
        store.flush()  # the writer thread has stored (or spilled) every record put so far
    stats_before_training = store.stats() if store is not None else None
    for b in batches:
        runner.train(b, current_version=0)
    return batches, server, actor, stats_before_training


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_records_wait_in_the_store_and_train_as_fetched(tmp_path, budget):
    with GuidanceStore(budget, tmp_path / "spill") as store:
        batches, server, actor, waiting = _two_overlapping_steps(store)
        assert all(isinstance(s.guidance, StoredRecord) for b in batches for s in b.samples)  # handles, not records
        assert waiting["records"] == 8  # both steps at once: keys are per step
        # a zero budget spills every record (their bytes on disk), a large one keeps them as objects
        assert (waiting["bytes_spilled_total"] > 0, waiting["bytes_in_memory"] > 0) == (budget == 0, budget > 0)
        assert store.stats()["records"] == 0 and store.stats()["bytes_in_memory"] == 0  # released after training
    assert len(server.fetched) == 4 and all(len(v) == 2 for v in server.fetched.values())  # each rid, both steps
    for step, seen in enumerate(actor.seen):
        assert seen == {rid: server.fetched[rid][step] for rid in seen}  # byte for byte, spilled or not


def test_without_a_store_the_batch_carries_the_records():
    batches, server, actor, _ = _two_overlapping_steps(None)
    assert all(isinstance(s.guidance, GuidanceRecord) for b in batches for s in b.samples)
    for step, seen in enumerate(actor.seen):
        assert seen == {rid: server.fetched[rid][step] for rid in seen}


def test_a_step_that_trains_nothing_still_releases_its_records(tmp_path):
    cfg = Config.load(
        "configs/tiny_cpu.yaml", ["rollout.prompts_per_step=1", "rollout.n_samples=2", "algo.max_version_diff=0"]
    )
    tok = CharTokenizer()
    with GuidanceStore(0, tmp_path / "spill") as store:
        rollout = tiny_rollout(
            cfg, GuidedServer(), tok, ArithmeticTask(tokenizer=tok), get_reward_fn("exact_match"), store=store
        )
        batch = rollout.run(0, version=0)
        trained = StepTrainer(cfg, RecordingActor(), store).train(batch, current_version=1)  # all stale
        assert trained.step is None and trained.dropped_stale == 2
        assert store.stats()["records"] == 0
