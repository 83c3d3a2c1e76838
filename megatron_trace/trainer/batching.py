"""A step's samples as this rank's micro-batches: layout (packed or padded), response rows, rollout
logprobs and advantages per response token, guidance and routed experts per placement.

    samples ─► packing: first-fit-decreasing bins under the token budget (train or logprob
               recompute), or micro_batch_size rows per micro-batch (padded reference)
            ─► bins dealt over data-parallel ranks (balanced tokens, equal counts, empty fillers)
            ─► per micro-batch: MicroBatchLayout + the response rows the loss reads
Every rank computes the same plan from the same samples and keeps its own part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_trace.rl import Sample

from . import packing
from .micro_batch_guidance import MicroBatchGuidance


@dataclass(frozen=True)
class Partition:
    """Where this rank sits: data-parallel shards of the micro-batches (1: every rank runs them
    all), context parallelism, and the stream multiple sequence parallelism needs."""

    dp_shards: int = 1
    dp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    stream_multiple: int = 1
    fixed_shape: bool = False  # pipeline parallel: every micro-batch of a step has one shape


@dataclass
class MicroBatch:
    layout: packing.MicroBatchLayout
    resp_rows: torch.Tensor  # long [R]: rows holding response labels
    resp_sample: torch.Tensor  # long [R]: which sample (index in the step's list)
    resp_offset: torch.Tensor  # long [R]: which response token of it
    rollout_lp: torch.Tensor  # fp32 [R]
    adv: torch.Tensor  # fp32 [R]
    guidance: MicroBatchGuidance | None
    routed: list = field(default_factory=list)  # per placement: the sample's routed experts or None
    names: list = field(default_factory=list)  # per placement: the sample id


def _check(samples: list[Sample]) -> None:
    for s in samples:
        if len(s.rollout_logprobs) != len(s.response_ids):
            raise ValueError(
                f"sample {s.sample_id}: {len(s.rollout_logprobs)} rollout logprobs for "
                f"{len(s.response_ids)} response tokens"
            )
        if not s.response_ids or not s.prompt_ids:
            raise ValueError(f"sample {s.sample_id}: needs a prompt and at least one response token")
        if s.guidance is not None:
            s.guidance.validate(len(s.tokens) - 1)


def micro_batch(samples: list[Sample], layout: packing.MicroBatchLayout) -> MicroBatch:
    """The loss's view of one layout: response rows and their rollout logprobs / advantages."""
    rows, who, off, lp, adv = [], [], [], [], []
    for p in layout.placements:
        s = samples[p.index]
        first = len(s.prompt_ids) - 1  # the label at this position is the first response token
        sel = p.positions >= first
        k = p.positions[sel] - first
        rows.append(p.rows[sel])
        who.append(torch.full_like(k, p.index))
        off.append(k)
        lp.append(torch.tensor(s.rollout_logprobs, dtype=torch.float32)[k])
        adv.append(torch.full(k.shape, float(s.advantage)))
    records = [samples[p.index].guidance for p in layout.placements]
    guidance = (
        MicroBatchGuidance(records, layout.placements, layout.ids.numel())
        if any(r is not None for r in records)
        else None
    )

    def cat(parts, dtype):
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

    return MicroBatch(
        layout,
        cat(rows, torch.long),
        cat(who, torch.long),
        cat(off, torch.long),
        cat(lp, torch.float32),
        cat(adv, torch.float32),
        guidance,
        [samples[p.index].routed_experts for p in layout.placements],
        [samples[p.index].sample_id for p in layout.placements],
    )


def plan(samples: list[Sample], *, packed: bool, budget: int, batch: int, part: Partition) -> list[MicroBatch]:
    """This rank's micro-batches of the step (same count on every data-parallel rank)."""
    _check(samples)
    tokens = [s.tokens for s in samples]
    if packed:
        lengths = packing.packed_lengths([len(t) - 1 for t in tokens], part.cp, 1)
        bins = packing.first_fit_decreasing(lengths, budget)
    else:
        if part.cp > 1:
            raise ValueError("trainer.cp > 1 needs packed micro-batches (trainer.packing=true)")
        bins = [list(range(i, min(i + batch, len(samples)))) for i in range(0, len(samples), batch)]
    loads = [sum(len(tokens[i]) - 1 for i in b) for b in bins]
    mine = packing.deal(loads, part.dp_shards)[part.dp_rank]
    count = -(-len(bins) // part.dp_shards)
    length = None
    if packed and part.fixed_shape:
        multiple = part.stream_multiple
        length = max(sum(packing.packed_lengths([len(tokens[i]) - 1 for i in b], part.cp, multiple)) for b in bins)
    shape = {"cp": part.cp, "cp_rank": part.cp_rank, "stream_multiple": part.stream_multiple, "length": length}
    seq = -(-max(len(t) - 1 for t in tokens) // part.stream_multiple) * part.stream_multiple
    out = []
    for b in mine:
        if packed:
            layout = packing.pack(tokens, bins[b], **shape)
        else:
            layout = packing.pad(tokens, bins[b], batch, seq)
        out.append(micro_batch(samples, layout))
    while len(out) < count:
        if packed:
            layout = packing.filler(**shape)
        else:
            layout = packing.pad([[0, 0]], [0], batch, seq)
            layout.placements = []  # padding only
        out.append(micro_batch(samples, layout))
    return out
