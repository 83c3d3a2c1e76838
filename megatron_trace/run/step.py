"""A step's training side, every rank: the rollout's batch ─► the actor's update ─► the mismatch.

RolloutBatch (rank 0) ─► share_batch: every trainer rank gets the samples (JSON + record bytes
                          across processes; one process keeps its objects)
  ─► StepTrainer.train: drop samples older than algo.max_version_diff, their guidance records
     out of the store, Actor.train_step (QAT recompute guided by the records + policy loss +
     update), mismatch of the trainer's logprobs against the rollout's; the step's records
     released from the store
  ─► StepResult: what hooks log, checkpoint and measure (run/hooks.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from megatron_trace.config import Config
from megatron_trace.guidance import GuidanceRecord, StoredRecord, encode_routed_experts, wire_routed_experts
from megatron_trace.rl import Sample, mismatch_metrics
from megatron_trace.trainer.actor import TrainStepResult
from megatron_trace.trainer.comm import broadcast_blobs, broadcast_json

from .rollout import RolloutBatch

_WIRE_FIELDS = [f.name for f in fields(Sample) if f.name not in ("guidance", "routed_experts")]


@dataclass
class Trained:
    """What training one batch gave (the same on every rank)."""

    step: TrainStepResult | None  # None: every sample was too stale to train on
    mismatch: dict[str, float]  # rl.mismatch_metrics of the trained samples
    deltas: list[torch.Tensor]  # per sample: logp_train - logp_rollout of each response token
    dropped_stale: int
    guidance_bytes_per_token: float  # of the records this step trained with


@dataclass
class StepResult:
    """One RL step as the hooks see it."""

    step: int
    batch: RolloutBatch
    trained: Trained
    times: dict[str, float]  # seconds: rollout_s, train_s, transfer_s, step_s
    wire_bytes: int  # of the last weight sync
    metrics: dict[str, float] = field(default_factory=dict)  # what hooks add before it is logged


def share_batch(batch: RolloutBatch | None, store=None) -> RolloutBatch:
    """Rank 0's batch to every trainer rank (JSON + record bytes; no pickle). A single process keeps
    its batch as it is (stored records stay in the store); across ranks the records travel as bytes."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return batch
    meta = broadcast_json(
        None
        if batch is None
        else {
            "step": batch.step,
            "version": batch.version,
            "samples": [
                {
                    **{k: getattr(s, k) for k in _WIRE_FIELDS},
                    "routed_experts": None if s.routed_experts is None else encode_routed_experts(s.routed_experts),
                    "routed_shape": None if s.routed_experts is None else list(s.routed_experts.shape),
                    "guided": s.guidance is not None,
                }
                for s in batch.samples
            ],
            "stats": batch.stats,
            "shown": batch.shown,
            "reward_reasons": batch.reward_reasons,
        }
    )
    blobs = iter(
        broadcast_blobs(
            None if batch is None else [_record_bytes(s.guidance, store) for s in batch.samples if s.guidance]
        )
    )
    samples = []
    for d in meta["samples"]:
        s = Sample(**{k: d[k] for k in _WIRE_FIELDS})
        s.guidance = GuidanceRecord.from_bytes(next(blobs)) if d["guided"] else None
        if d["routed_experts"] is not None:
            s.routed_experts = wire_routed_experts(d["routed_experts"], s.sample_id).view(d["routed_shape"])
        samples.append(s)
    return RolloutBatch(meta["step"], meta["version"], samples, meta["stats"], meta["shown"], meta["reward_reasons"])


def _record_bytes(g: GuidanceRecord | StoredRecord, store) -> bytes:
    return store.get_bytes(g.key) if isinstance(g, StoredRecord) else g.to_bytes()


class StepTrainer:
    """Trains one batch (see the module doc); then releases the step's records from the store."""

    def __init__(self, cfg: Config, actor, store):
        self.cfg, self.actor, self.store = cfg, actor, store

    def train(self, batch: RolloutBatch, current_version: int) -> Trained:
        try:
            return self._train(batch, current_version)
        finally:
            if self.store is not None:
                self.store.release_step(batch.step)  # stale samples' records too

    def _train(self, batch: RolloutBatch, current_version: int) -> Trained:
        limit = self.cfg.algo.max_version_diff
        fresh = [s for s in batch.samples if current_version - min(s.version, batch.version) <= limit]
        dropped = len(batch.samples) - len(fresh)
        samples = [_with_record(s, self.store) for s in fresh]
        if not samples:
            return Trained(None, {}, [], dropped, 0.0)
        step = self.actor.train_step(samples, self.cfg.algo)
        m = mismatch_metrics(
            [s.rollout_logprobs for s in samples], [t.tolist() for t in step.logprobs], is_clip=self.cfg.algo.is_clip
        )
        records = [s.guidance for s in samples if s.guidance is not None]
        bpt = sum(r.nbytes() for r in records) / max(sum(r.num_positions for r in records), 1)
        deltas = [t - torch.tensor(s.rollout_logprobs) for t, s in zip(step.logprobs, samples)]
        return Trained(step, m, deltas, dropped, bpt)


def _with_record(s: Sample, store) -> Sample:
    """The sample with its guidance record in place of the store's handle."""
    if not isinstance(s.guidance, StoredRecord):
        return s
    return Sample(**{**{f.name: getattr(s, f.name) for f in fields(Sample)}, "guidance": store.get(s.guidance.key)})
