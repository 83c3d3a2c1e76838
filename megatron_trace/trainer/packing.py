"""Micro-batch layouts: samples packed into one token stream by a token budget (THD), or the
right-padded [B, S] reference layout.

    samples ─► lengths (input tokens = tokens[:-1]) ─► first-fit decreasing bins under the budget
            ─► per bin one stream [1, T]: sample j at rows cu[j]..cu[j+1], positions restarting at 0,
               each sample padded to a multiple of 2·CP (zigzag halves), the stream to a multiple of
               TP under sequence parallelism; context parallel rank r keeps chunks r and 2·CP−1−r of
               every sample ─► bins dealt to data-parallel ranks by tokens, counts made equal

Every row of a micro-batch is addressed as Megatron lays activations out, [S, B] flattened
(s·B + b; packed: B = 1, the row is the token's place in this rank's stream). A `Placement` says
which rows hold which positions of one sample; guidance, routing replay and the loss read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
