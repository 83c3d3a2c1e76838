"""A step's samples as this rank's micro-batches: layout (packed or padded), response rows, rollout
logprobs and advantages per response token, guidance and routed experts per placement.

    samples ─► packing: first-fit-decreasing bins under the token budget (train or logprob
               recompute), or micro_batch_size rows per micro-batch (padded reference)
            ─► bins dealt over data-parallel ranks (balanced tokens, equal counts, empty fillers)
            ─► per micro-batch: MicroBatchLayout + the response rows the loss reads
Every rank computes the same plan from the same samples and keeps its own part.

Layouts (packed or padded):

Micro-batch layouts: samples packed into one token stream by a token budget (THD), or the
right-padded [B, S] reference layout.

    samples ─► lengths (input tokens = tokens[:-1]) ─► first-fit decreasing bins under the budget
            ─► per bin one stream [1, T]: sample j at rows cu[j]..cu[j+1], positions restarting at 0,
               each sample padded to a multiple of 2·CP (zigzag halves), the stream to a multiple of
               TP under sequence parallelism; context parallel rank r keeps chunks r and 2·CP−1−r of
               every sample ─► bins dealt to data-parallel ranks by tokens, counts made equal

Every row of a micro-batch is addressed as Megatron lays activations out, [S, B] flattened
(s·B + b; packed: B = 1, the row is the token's place in this rank's stream). A `Placement` says
which rows hold which positions of one sample; guidance, routing replay and the loss read it.

Guidance:

One micro-batch's rollout guidance in Megatron's row layout, assembled once per site.

Each sample's record covers its positions 0..T-1; a `Placement` says which rows of the
micro-batch (Megatron's [S, B] flattened, or a packed stream) hold which of its positions. Rows past
a record, padding and samples without one are left uncovered in the mask, where QAT rounds to
nearest. A row-parallel linear asks for its TP rank's K slice of the codes and scales. `QATState`
(qat.py) reads it at every guided site.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_trace.fp4 import RolloutRounding
from megatron_trace.guidance import GuidanceRecord
from megatron_trace.guidance.record import layer_of
from megatron_trace.rl import Sample


# -- layouts --------------------------------------------------------------------------------
@dataclass
class Placement:
    """One sample in a micro-batch: its rows on this rank and the token positions at them."""

    index: int  # the sample's index in the step's list
    rows: torch.Tensor  # long [n]: rows of the micro-batch's [S*B] layout
    positions: torch.Tensor  # long [n]: the sample's positions there (0 = its first prompt token)
    # rows start..start+n hold positions 0..n-1 (a packed sample without context parallelism):
    # its guidance copies as one slice
    start: int | None = None


@dataclass
class MicroBatchLayout:
    """One micro-batch's token ids, labels and positions [B, S], and where each sample sits."""

    ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    placements: list[Placement] = field(default_factory=list)
    cu_seqlens: torch.Tensor | None = None  # int32 [n+1], whole (padded) samples; None: padded layout
    max_seqlen: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def row_positions(self) -> torch.Tensor:
        """long [S*B]: each row's position within its sample (Megatron's row order)."""
        return self.positions.t().reshape(-1)

    def tokens(self) -> int:
        return sum(len(p.rows) for p in self.placements)


def columns(batch: int, seq_len: int) -> list[Placement]:
    """Placements of a [seq_len, batch] micro-batch whose sample j fills batch column j."""
    return [Placement(j, torch.arange(seq_len) * batch + j, torch.arange(seq_len)) for j in range(batch)]


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `budget`; a longer sample gets a bin alone.
    Longest first, each into the first bin it fits (ties keep input order): deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def packed_lengths(lengths: list[int], cp: int, stream_multiple: int) -> list[int]:
    """Each sample's length in the stream: a multiple of 2·CP under context parallelism (its
    zigzag halves), the last one longer so that every CP rank's stream is a multiple of
    `stream_multiple` (TP under sequence parallelism)."""
    align = 2 * cp if cp > 1 else 1
    out = [_round_up(n, align) for n in lengths]
    while sum(out) % (cp * stream_multiple):
        out[-1] += align
    return out


def _zigzag(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of a (padded) sample context-parallel rank `rank` keeps: chunks r and 2·CP−1−r."""
    if cp == 1:
        return torch.arange(length)
    c = length // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def pack(
    tokens: list[list[int]],
    indices: list[int],
    *,
    cp: int = 1,
    cp_rank: int = 0,
    stream_multiple: int = 1,
    length: int | None = None,
) -> MicroBatchLayout:
    """One packed micro-batch [1, T/CP] of the samples `indices` (tokens: every sample's ids);
    `length`: the whole stream's T when every micro-batch must have one shape (pipeline stages
    exchange fixed-size activations), the last sample padded to it."""
    n = [len(tokens[i]) - 1 for i in indices]
    padded = packed_lengths(n, cp, stream_multiple)
    if length is not None:
        if length < sum(padded):
            raise ValueError(f"stream length {length} < the {sum(padded)} tokens packed")
        padded[-1] += length - sum(padded)
    ids, labels, pos, places, row = [], [], [], [], 0
    for i, length, full in zip(indices, n, padded):
        t = torch.tensor(tokens[i], dtype=torch.long)
        p = _zigzag(full, cp, cp_rank)
        real = p < length
        ids.append(torch.where(real, t[p.clamp(max=length - 1)], 0))
        labels.append(torch.where(real, t[(p + 1).clamp(max=length)], 0))
        pos.append(p)
        places.append(Placement(i, row + torch.nonzero(real)[:, 0], p[real], row if cp == 1 else None))
        row += len(p)
    cu = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return MicroBatchLayout(
        torch.cat(ids)[None], torch.cat(labels)[None], torch.cat(pos)[None], places, cu, max(padded)
    )


def pad(tokens: list[list[int]], indices: list[int], batch: int, seq: int) -> MicroBatchLayout:
    """The reference layout: `batch` rows right-padded to `seq` (the step's longest sample, a
    multiple of TP under sequence parallelism)."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    labels = torch.zeros(batch, seq, dtype=torch.long)
    places = []
    for col, (b, i) in zip(columns(batch, seq), enumerate(indices)):
        t = torch.tensor(tokens[i], dtype=torch.long)
        n = len(t) - 1
        ids[b, :n], labels[b, :n] = t[:-1], t[1:]
        places.append(Placement(i, col.rows[:n], col.positions[:n]))
    return MicroBatchLayout(ids, labels, torch.arange(seq).expand(batch, seq).clone(), places)


def deal(loads: list[int], ranks: int) -> list[list[int]]:
    """Micro-batch indices per data-parallel rank: heaviest first to the least loaded rank, so
    token counts balance; the caller evens out the counts (`filler`)."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    total = [0] * ranks
    for m in sorted(range(len(loads)), key=lambda i: -loads[i]):
        r = min(range(ranks), key=lambda k: (total[k], len(out[k])))
        out[r].append(m)
        total[r] += loads[m]
    return [sorted(x) for x in out]


def filler(cp: int = 1, cp_rank: int = 0, stream_multiple: int = 1, length: int | None = None) -> MicroBatchLayout:
    """A micro-batch holding no sample (one padding sequence): a data-parallel rank with fewer bins
    runs these so every rank runs the same schedule; it adds nothing to the loss or the metrics."""
    layout = pack([[0, 0]], [0], cp=cp, cp_rank=cp_rank, stream_multiple=stream_multiple, length=length)
    layout.placements = []
    return layout


# -- guidance rows ----------------------------------------------------------------------
@dataclass
class MicroBatchGuidance:
    """Rollout records of one micro-batch's samples (records[i] sits at placements[i]), over
    `n_rows` rows."""

    records: list[GuidanceRecord | None]
    placements: list[Placement]
    n_rows: int
    _cache: dict = field(default_factory=dict)

    @classmethod
    def padded(cls, records: list[GuidanceRecord | None], seq_len: int) -> MicroBatchGuidance:
        """Records of a [seq_len, B = len(records)] micro-batch, sample j in batch column j."""
        return cls(records, columns(len(records), seq_len), seq_len * len(records))

    def release(self) -> None:
        """Drop the assembled (device) site tensors; they are rebuilt from the records if asked again."""
        self._cache.clear()

    def recorded_layers(self) -> set[int]:
        """Layers the rollout recorded any site of: in guided mode each of their FP4 sites must be
        there, or that site would silently round to nearest (`missing_site_error`)."""
        if "layers" not in self._cache:
            self._cache["layers"] = {layer_of(n) for r in self.records if r is not None for n in r.sites}
        return self._cache["layers"]

    def missing_site_error(self, name: str) -> ValueError | None:
        """The error for a guided site that no record of this micro-batch holds although its layer
        is guided, or None when the layer is not guided (nothing recorded there by design)."""
        if layer_of(name) not in self.recorded_layers():
            return None
        held = sorted({n for r in self.records if r is not None for n in r.sites if layer_of(n) == layer_of(name)})
        ids = [r.sample_id for r in self.records if r is not None][:3]
        return ValueError(
            f"trainer.qat_mode=guided: QAT site {name} is FP4 in the trainer, but the rollout's guidance "
            f"records (samples {ids}) hold no such site; its layer has {held}. The rollout did not record "
            "this site (a server or plugin that cannot capture this format or these experts?), so it "
            "would silently round to nearest: make the rollout record it, or keep the site out of "
            "quant.targets / use trainer.qat_mode=rtn"
        )

    def site(self, name: str, k_slice: slice | None, dev) -> tuple[RolloutRounding, torch.Tensor] | None:
        """Rounding tensors [rows, ..., K_local/...] and the mask of covered rows, or None."""
        key = (name, None if k_slice is None else (k_slice.start, k_slice.stop))
        if key in self._cache:
            return self._cache[key]
        present = [r for r in self.records if r is not None and name in r.sites]
        if not present:
            self._cache[key] = None
            return None
        ref = present[0].sites[name]
        full = present[0].mode == "full"
        n = self.n_rows
        inner = tuple(ref.scale.shape[1:-1])
        scale = torch.zeros(n, *inner, ref.scale.shape[-1], dtype=torch.uint8)
        payload = torch.zeros(n, *inner, ref.payload.shape[-1], dtype=torch.uint8)
        gs = torch.ones(n, *inner, dtype=torch.float32)
        mask = torch.zeros(n, dtype=torch.bool)
        for rec, place in zip(self.records, self.placements):
            if rec is None or name not in rec.sites:
                continue
            site = rec.sites[name]
            if place.start is not None:
                t = min(site.positions(), len(place.rows))
                rows, pos = slice(place.start, place.start + t), slice(0, t)
            else:
                held = place.positions < site.positions()
                rows, pos = place.rows[held], place.positions[held]
            scale[rows], payload[rows] = site.scale[pos], site.payload[pos]
            g = site.global_scale if site.global_scale.dim() == 0 else site.global_scale[pos]
            gs[rows] = g.reshape(*g.shape, *([1] * (gs.dim() - g.dim()))) if g.dim() else g  # FP8: S_enc per token
            mask[rows] = True
        if k_slice is not None:
            k0, k1 = k_slice.start, k_slice.stop
            per = 2 if full else 8  # elements per payload byte
            block = ref.payload.shape[-1] * per // ref.scale.shape[-1]  # 16 (NVFP4) or 32 (MXFP4)
            scale = scale[..., k0 // block : k1 // block]
            payload = payload[..., k0 // per : k1 // per]

        def flat(t):
            return t.contiguous().to(dev)

        rr = RolloutRounding(
            flat(scale), flat(gs), codes=flat(payload) if full else None, mantissa=None if full else flat(payload)
        )
        out = (rr, mask.to(dev))
        self._cache[key] = out
        return out


# -- the step's micro-batches ------------------------------------------------------------
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
    layout: MicroBatchLayout
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


def micro_batch(samples: list[Sample], layout: MicroBatchLayout) -> MicroBatch:
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
        lengths = packed_lengths([len(t) - 1 for t in tokens], part.cp, 1)
        bins = first_fit_decreasing(lengths, budget)
    else:
        if part.cp > 1:
            raise ValueError("trainer.cp > 1 needs packed micro-batches (trainer.packing=true)")
        bins = [list(range(i, min(i + batch, len(samples)))) for i in range(0, len(samples), batch)]
    loads = [sum(len(tokens[i]) - 1 for i in b) for b in bins]
    mine = deal(loads, part.dp_shards)[part.dp_rank]
    count = -(-len(bins) // part.dp_shards)
    length = None
    if packed and part.fixed_shape:
        multiple = part.stream_multiple
        length = max(sum(packed_lengths([len(tokens[i]) - 1 for i in b], part.cp, multiple)) for b in bins)
    shape = {"cp": part.cp, "cp_rank": part.cp_rank, "stream_multiple": part.stream_multiple, "length": length}
    seq = -(-max(len(t) - 1 for t in tokens) // part.stream_multiple) * part.stream_multiple
    out = []
    for b in mine:
        if packed:
            layout = pack(tokens, bins[b], **shape)
        else:
            layout = pad(tokens, bins[b], batch, seq)
        out.append(micro_batch(samples, layout))
    while len(out) < count:
        if packed:
            layout = filler(**shape)
        else:
            layout = pad([[0, 0]], [0], batch, seq)
            layout.placements = []  # padding only
        out.append(micro_batch(samples, layout))
    return out
